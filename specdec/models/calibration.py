"""Matmul layouts and forward costs, measured when a service starts.

The target's cost of a Verify of r rows (K + 1 = r) decides what K pays, and on a CPU it depends
on the machine, the thread count and the matmul kernel (`specdec.models.cpu_layout`). So a service
measures its own model, in two steps:
1. per weight shape and row count r = 1..max_rows, the fastest layout: every layer of that shape
   run on r random rows in each candidate layout, a few interleaved repeats (seconds in all);
2. the curve: a cached forward over r new rows after a fixed prefix, r = 1..max_rows, with the
   layouts chosen, reported in `ModelInfo.forward_cost_ms` for the coordinator's K policy.
The layers of one shape are timed together so their weights stream from memory, as in a forward.
Where the `panels` kernel is available, the curve of that plan is timed against the curve of
`panels` for every shape and row count, interleaved, and the faster (by the sum over rows) is
kept: timed alone, a shape's layers can sit in the last-level cache, and a plan that mixes
layouts streams two copies of the weights through it; one copy read by one kernel for every row
count does not (on an AMX Xeon the mixed plan took 35.2 / 39.1 / 41.7 ms at 1 / 3 / 5 rows,
`panels` alone 32.4 / 37.0 / 41.1).
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from specdec.models.cpu_layout import LayoutPlan, drop_unused_copies, planned_linears, use_layout_plans
from specdec.models.layouts import AUTO, COPIES, LAYOUTS, LINEAR, PANELS

_SESSION = "\x00calibration"  # a cache key no client sends (keys are UUIDs or user strings)


@dataclass(frozen=True)
class ForwardCosts:
    """What `plan_layouts` measured."""

    seconds: tuple[float, ...]  # [r - 1]: best time of a cached forward over r new rows
    layouts: dict[str, tuple[str, ...]]  # "in->out": [r - 1] the layout chosen for that shape

    def milliseconds(self) -> list[float]:
        return [round(s * 1e3, 3) for s in self.seconds]

    def describe(self) -> str:
        return "; ".join(f"{shape}: {','.join(chosen)}" for shape, chosen in self.layouts.items())


def _seconds(run: Callable[[], object]) -> float:
    started = time.perf_counter()
    run()
    return time.perf_counter() - started


@torch.inference_mode()
def tune_layouts(model, plans: dict[tuple[int, int], LayoutPlan], max_rows: int, repeats: int = 3) -> None:
    """Set each shape's plan to its fastest layout for 1..max_rows rows (call on the model's thread)."""
    layers = planned_linears(model)
    for shape, plan in plans.items():
        modules = layers.get(shape, [])
        candidates = [c for c in LAYOUTS if c not in COPIES or all(m.has_copy(c) for m in modules)]
        for rows in range(1, max_rows + 1):
            x = torch.randn(rows, shape[0])
            best = dict.fromkeys(candidates, float("inf"))
            for _ in range(repeats):
                for layout in candidates:  # in turn, so drift on a busy machine hits them alike
                    plan.set(rows, layout)
                    best[layout] = min(best[layout], _seconds(lambda x=x, ms=modules: [m(x) for m in ms]))
            plan.set(rows, min(candidates, key=best.__getitem__))


def forward_costs(runner, max_rows: int, prefix_len: int = 64, repeats: int = 3) -> tuple[float, ...]:
    """Best seconds of a cached forward over r = 1..max_rows new rows after a prefix_len-token
    prefix (call on the model's thread). Token ids are a fixed pattern: a forward's cost does not
    depend on which tokens it reads. Leaves no cache entry and no trace in the cache counters."""
    return compare_forward_costs(runner, max_rows, [lambda: None], prefix_len, repeats)[0]


def compare_forward_costs(
    runner, max_rows: int, setups: list[Callable[[], object]], prefix_len: int = 64, repeats: int = 3
) -> list[tuple[float, ...]]:
    """forward_costs under each setup (a function that sets the plans), the setups in turn within
    each repeat so that drift on a busy machine hits them alike; the last setup stays applied."""
    prefix = [(7 * i + 3) % runner.vocab_size for i in range(prefix_len)]
    forward = _forward_fn(runner)
    hits, misses = runner.cache.hits, runner.cache.misses  # the KV-cache metrics count clients' calls
    best = [[float("inf")] * max_rows for _ in setups]
    try:
        for setup in setups:  # warm-up: allocations, the OpenMP team, the prefix's cache, each kernel
            setup()
            forward(prefix + [1], 1)
        for _ in range(repeats):
            for setup, curve in zip(setups, best):
                setup()
                for rows in range(1, max_rows + 1):
                    curve[rows - 1] = min(curve[rows - 1], _seconds(lambda r=rows: forward(prefix + [1] * r, r)))
    finally:
        runner.cache.drop(_SESSION)
        runner.cache.hits, runner.cache.misses = hits, misses
    return [tuple(curve) for curve in best]


def _forward_fn(runner):
    """forward(token_ids, rows): the runner's cached forward; a draft fed the target's hidden states
    gets zeros (its cost does not depend on their values)."""
    if not runner.needs_target_hidden:
        return lambda token_ids, rows: runner.last_logits(_SESSION, token_ids, rows)

    def forward(token_ids, rows):
        fed = torch.zeros((len(token_ids), runner.hidden_size), dtype=torch.float32)
        return runner.last_logits(_SESSION, token_ids, rows, input_hidden=fed)

    return forward


def _tuned_or_panels(runner, plans: dict[tuple[int, int], LayoutPlan], max_rows: int) -> tuple[float, ...]:
    """Keep the tuned plans or switch every shape to `panels`, whichever forward curve is faster."""
    layers = planned_linears(runner.model)
    if not all(m.has_copy(PANELS) for group in layers.values() for m in group):
        return forward_costs(runner, max_rows)
    tuned = {shape: (plan.default, dict(plan.by_rows)) for shape, plan in plans.items()}

    def use_panels():
        for plan in plans.values():
            plan.default, plan.by_rows = PANELS, {}

    if runner.fuses_layers():
        # Short forwards run the fused layers on the panels whatever the plans say: the plans serve
        # prompts and the head, where panels keep a row's logits independent of its company.
        use_panels()
        return forward_costs(runner, max_rows)

    def use_tuned():
        for shape, plan in plans.items():
            plan.default, plan.by_rows = tuned[shape][0], dict(tuned[shape][1])

    tuned_seconds, panels_seconds = compare_forward_costs(runner, max_rows, [use_tuned, use_panels])
    if sum(panels_seconds) < sum(tuned_seconds):
        return panels_seconds
    use_tuned()
    return tuned_seconds


def plan_layouts(
    runner, layout: str, max_rows: int, int8: bool = False, before_measuring: Callable[[], object] | None = None
) -> ForwardCosts | None:
    """Apply a service's `linear_layout` setting to its model and measure its forward costs.

    "auto" swaps the float32 CPU linears for planned ones and keeps the fastest layout per weight
    shape and row count; a named layout applies to all. The curve is measured either way (None
    when max_rows is 0). Weight copies that no plan uses are freed. int8: linears with 4- or 8-bit
    weights multiply int8 rows at every row count instead (`cpu_layout.PlannedLinear`).
    before_measuring: called once the plans apply, before any forward (what else the curve must
    include, such as the caches' dtype).
    """
    auto = layout == AUTO
    copies = COPIES if auto else tuple(c for c in COPIES if c == layout)
    plans = use_layout_plans(runner.model, LINEAR if auto else layout, copies, int8)
    if before_measuring is not None:
        before_measuring()
    costs = None
    if max_rows > 0:
        if auto:
            runner.on_model_thread(tune_layouts, runner.model, plans, max_rows)
            seconds = runner.on_model_thread(_tuned_or_panels, runner, plans, max_rows)
        else:
            seconds = runner.on_model_thread(forward_costs, runner, max_rows)
        chosen = {f"{i}->{o}": tuple(plan.layout(r) for r in range(1, max_rows + 1)) for (i, o), plan in plans.items()}
        costs = ForwardCosts(seconds, chosen)
    if drop_unused_copies(runner.model):
        return_freed_memory()
    return costs


def return_freed_memory() -> None:
    """Hand the heap glibc keeps after frees back to the system: the weight copies no plan uses
    (SmolLM2's target: resident 2.41 GB after loading, 1.49 GB after this; the dropped copies
    and loading's buffers would otherwise count against the pod's memory limit for good)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc: nothing to trim this way

