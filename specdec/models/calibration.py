"""What a cached forward costs per number of new rows, measured when a service starts.

The target's cost of a Verify of r rows (K + 1 = r) decides what K pays, and on a CPU it depends
on the machine, the thread count and the matmul kernel (`specdec.models.cpu_layout`). So a service
times its own forwards: for r = 1..max_rows, each candidate layout, a few interleaved repeats over a
fixed cached prefix; it keeps the fastest layout per r and reports the resulting curve in
`ModelInfo.forward_cost_ms`, which the coordinator's K policy reads as the shape of its verify cost.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from specdec.models.cpu_layout import LayoutPlan, drop_transposed, use_layout_plan
from specdec.models.layouts import AUTO, LAYOUTS, LINEAR, TRANSPOSED

_SESSION = "\x00calibration"  # a cache key no client can send (keys are UUIDs or user strings)


@dataclass(frozen=True)
class ForwardCosts:
    """Seconds of a cached forward over r new rows, r = 1..len(seconds), in the layouts chosen."""

    seconds: tuple[float, ...]  # [r - 1]: the chosen layout's best time
    layouts: tuple[str, ...]  # [r - 1]: the layout chosen for r rows
    measured: dict[str, tuple[float, ...]]  # every candidate's best time per r (for logs)

    def milliseconds(self) -> list[float]:
        return [round(s * 1e3, 3) for s in self.seconds]


def calibrate(
    runner,
    max_rows: int,
    plan: LayoutPlan | None = None,
    candidates: tuple[str, ...] = LAYOUTS,
    prefix_len: int = 64,
    repeats: int = 3,
) -> ForwardCosts:
    """Time `runner`'s cached forwards over 1..max_rows new rows; with a `plan`, try each candidate
    layout per row count and leave the plan on the fastest (without one, the curve as loaded).

    Runs on the caller's thread (call it through `runner.on_model_thread`). Token ids are a fixed
    pattern: the cost of a forward does not depend on which tokens it reads.
    """
    layouts = candidates if plan is not None else ("as loaded",)
    prefix = [(7 * i + 3) % runner.vocab_size for i in range(prefix_len)]
    forward = _forward_fn(runner)
    hits, misses = runner.cache.hits, runner.cache.misses  # the KV-cache metrics count clients' calls
    forward(prefix + [1], 1)  # warm-up: allocations, OpenMP team, the prefix's cache
    best: dict[str, list[float]] = {layout: [float("inf")] * max_rows for layout in layouts}
    try:
        for repeat in range(repeats):
            for rows in range(1, max_rows + 1):
                tail = [(repeat + rows + i) % runner.vocab_size for i in range(rows)]
                for layout in layouts:  # interleaved, so drift on a busy machine hits them alike
                    if plan is not None:
                        plan.set(rows, layout)
                    started = time.perf_counter()
                    forward(prefix + tail, rows)
                    elapsed = time.perf_counter() - started
                    best[layout][rows - 1] = min(best[layout][rows - 1], elapsed)
    finally:
        runner.cache.drop(_SESSION)
        runner.cache.hits, runner.cache.misses = hits, misses
    chosen = tuple(min(layouts, key=lambda layout: best[layout][r]) for r in range(max_rows))
    if plan is not None:
        for rows, layout in enumerate(chosen, start=1):
            plan.set(rows, layout)
    seconds = tuple(best[layout][r] for r, layout in enumerate(chosen))
    return ForwardCosts(seconds, chosen, {layout: tuple(times) for layout, times in best.items()})


def _forward_fn(runner):
    """forward(token_ids, rows): the runner's cached forward; a draft fed the target's hidden states
    gets zeros (its cost does not depend on their values)."""
    if not runner.needs_target_hidden:
        return lambda token_ids, rows: runner.last_logits(_SESSION, token_ids, rows)
    import torch

    def forward(token_ids, rows):
        fed = torch.zeros((len(token_ids), runner.hidden_size), dtype=torch.float32)
        return runner.last_logits(_SESSION, token_ids, rows, input_hidden=fed)

    return forward


def plan_layouts(runner, layout: str, max_rows: int) -> ForwardCosts | None:
    """Apply a service's `linear_layout` setting to its model and measure its forward costs.

    "auto" swaps the float32 CPU linears for planned ones and keeps the fastest layout per row
    count; a named layout applies to every row count. The curve is measured either way (None when
    max_rows is 0). Returns after freeing the transposed copies if nothing uses them.
    """
    auto = layout == AUTO
    plan = LayoutPlan(LINEAR if auto else layout)
    swapped = use_layout_plan(runner.model, plan, keep_transposed=auto or layout == TRANSPOSED)
    costs = None
    if max_rows > 0:
        tune = plan if auto and swapped else None
        costs = runner.on_model_thread(calibrate, runner, max_rows, tune)
    if not plan.uses(TRANSPOSED):
        drop_transposed(runner.model)
    return costs
