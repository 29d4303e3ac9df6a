"""Matmul layouts and forward costs, measured when a service starts.

The target's cost of a Verify of r rows (K + 1 = r) decides what K pays, and on a CPU it depends
on the machine, the thread count and the matmul kernel (`specdec.models.cpu_layout`). So a service
measures its own model, in two steps:
1. per weight shape and row count r = 1..max_rows, the fastest layout: every layer of that shape
   run on r random rows in each candidate layout, a few interleaved repeats (seconds in all);
2. the curve: a cached forward over r new rows after a fixed prefix, r = 1..max_rows, with the
   layouts chosen, reported in `ModelInfo.forward_cost_ms` for the coordinator's K policy.
The layers of one shape are timed together so their weights stream from memory, as in a forward.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from specdec.models.cpu_layout import LayoutPlan, drop_unused_copies, planned_linears, use_layout_plans
from specdec.models.layouts import AUTO, COPIES, LAYOUTS, LINEAR

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
    prefix = [(7 * i + 3) % runner.vocab_size for i in range(prefix_len)]
    forward = _forward_fn(runner)
    hits, misses = runner.cache.hits, runner.cache.misses  # the KV-cache metrics count clients' calls
    try:
        forward(prefix + [1], 1)  # warm-up: allocations, the OpenMP team, the prefix's cache
        best = [float("inf")] * max_rows
        for _ in range(repeats):
            for rows in range(1, max_rows + 1):
                best[rows - 1] = min(best[rows - 1], _seconds(lambda r=rows: forward(prefix + [1] * r, r)))
    finally:
        runner.cache.drop(_SESSION)
        runner.cache.hits, runner.cache.misses = hits, misses
    return tuple(best)


def _forward_fn(runner):
    """forward(token_ids, rows): the runner's cached forward; a draft fed the target's hidden states
    gets zeros (its cost does not depend on their values)."""
    if not runner.needs_target_hidden:
        return lambda token_ids, rows: runner.last_logits(_SESSION, token_ids, rows)

    def forward(token_ids, rows):
        fed = torch.zeros((len(token_ids), runner.hidden_size), dtype=torch.float32)
        return runner.last_logits(_SESSION, token_ids, rows, input_hidden=fed)

    return forward


def plan_layouts(runner, layout: str, max_rows: int) -> ForwardCosts | None:
    """Apply a service's `linear_layout` setting to its model and measure its forward costs.

    "auto" swaps the float32 CPU linears for planned ones and keeps the fastest layout per weight
    shape and row count; a named layout applies to all. The curve is measured either way (None
    when max_rows is 0). Weight copies that no plan uses are freed.
    """
    auto = layout == AUTO
    copies = COPIES if auto else tuple(c for c in COPIES if c == layout)
    plans = use_layout_plans(runner.model, LINEAR if auto else layout, copies)
    costs = None
    if max_rows > 0:
        if auto:
            runner.on_model_thread(tune_layouts, runner.model, plans, max_rows)
        seconds = runner.on_model_thread(forward_costs, runner, max_rows)
        chosen = {f"{i}->{o}": tuple(plan.layout(r) for r in range(1, max_rows + 1)) for (i, o), plan in plans.items()}
        costs = ForwardCosts(seconds, chosen)
    drop_unused_copies(runner.model)
    return costs
