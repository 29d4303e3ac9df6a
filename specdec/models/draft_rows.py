"""Which drafted rows a shared step verifies: those whose expected tokens pay for their rows.

A round the target drafts by its own lookup under auto K (`VerifyRequest.lookup_acceptance`) knows
what each drafted row yields in expectation: the j-th draft c_1 ... c_j tokens, c_i the
coordinator's acceptance where a draft reaches position i (`StepItem.gains`). Each row also
lengthens the forward that every sequence of the step waits for, and the coordinator, pricing its
K alone, cannot see that. Before each step `DraftRows.trim` keeps drafted rows, best first, while
each raises the step's expected tokens per second:

    keep a row of gain g  iff  (T + g) / C(S, R + 1) > T / C(S, R)

T the step's expected tokens so far (one per sequence, plus the gains kept), C its seconds: a plane
in its sequences S and new rows R fitted to recent steps (`StepFit`), its row slope leaning on the
model's start-up forward-cost curve. Among many sequences a row costs them all, and only likely
drafts stay. A step of one sequence is left as asked: there the request's own K policy already
prices its rows by its calls' seconds. (Cutting there too, one of two one-stream benchmark runs
drafted little on code editing, auto K 1.08x of K = 0 against 1.51-1.65x in three others; not
pinned down, and nothing to gain alone.)

Lossless: what a round verifies is fixed before its forward, from the history, the other sequences
and timings, never from the round's own uniforms; a round cut to its first j drafts is a round of
that shorter draft (`speculative_round` reads one uniform per examined draft, then the final draw).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from specdec.core.kpolicy import PREFILL_ROWS_PER_SEQUENCE, StepFit, curve_at
from specdec.models.runner import StepItem

# A step's weight in the fit after this many more steps: e^-1 (the fit follows a drifting machine
# and changing loads; a few seconds of steps at 8 streams).
MEMORY_STEPS = 256


class DraftRows:
    """The step-cost fit and the cut, on the model thread (one per scheduler)."""

    def __init__(self):
        self.fit = StepFit(forget=1.0 - 1.0 / MEMORY_STEPS)
        self.row_prior_s = 0.0  # seconds a row adds, by the start-up curve (0: by the steps' mean row)
        self.cut = 0  # drafted rows left out so far (metrics)

    def use_curve(self, seconds: Sequence[float]) -> None:
        """The model's start-up forward costs ([r - 1]: seconds of r rows of one sequence): what a
        row adds past their end (`curve_at`: their upper half's slope, where rows cost what the
        products add), as a row's prior cost."""
        if seconds:
            self.row_prior_s = curve_at(seconds, len(seconds) + 1) - seconds[-1]

    def observe(self, sequences: int, rows: int, seconds: float) -> None:
        """A step's size and seconds; a prompt's (more rows than rounds make) is not a round's cost."""
        if rows <= PREFILL_ROWS_PER_SEQUENCE * sequences:
            self.fit.add(sequences, rows, seconds)

    def trim(self, items: list[StepItem], rows: int) -> tuple[list[StepItem], int]:
        """The items as the step runs them, drafted rows left out where they do not pay, and the
        step's new rows then (`rows`: before)."""
        gains = sorted(((g, i) for i, item in enumerate(items) for g in item.gains), key=lambda gi: -gi[0])
        if not gains or not self.fit.n or len(items) < 2:
            return items, rows
        sequences, base = len(items), rows - len(gains)
        seconds = self._seconds(sequences, base)
        per_row = self._seconds(sequences, base + 1) - seconds  # (the plane's slope: one per step)
        tokens, kept = float(sequences), [0] * len(items)
        for gain, i in gains:  # (within an item, its rows in order: gains do not increase)
            if gain * seconds <= tokens * per_row:  # (T + g) / (C + b) <= T / C
                break  # this row and every later one, no better, would slow the step's tokens
            tokens, seconds = tokens + gain, seconds + per_row
            kept[i] += 1
        self.cut += len(gains) - sum(kept)
        cut = [_cut(item, len(item.gains) - keep) for item, keep in zip(items, kept, strict=True)]
        return cut, base + sum(kept)

    def _seconds(self, sequences: int, rows: int) -> float:
        _, mean_rows, mean_s = self.fit.means()
        prior = self.row_prior_s or mean_s / max(1.0, mean_rows)
        return self.fit.predict(sequences, rows, prior)


def _cut(item: StepItem, drop: int) -> StepItem:
    """The item without its last `drop` drafted rows."""
    if not drop:
        return item
    end = len(item.token_ids) - drop
    return replace(item, token_ids=item.token_ids[:end], num_last=item.num_last - drop, gains=item.gains[:-drop])
