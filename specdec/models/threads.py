"""The intra-op thread count per forward, chosen from measured speed (graceful under CPU contention).

torch runs each kernel as an OpenMP parallel region that ends at a barrier: with N threads, a
forward is as fast as its slowest thread at every barrier. When other processes hold some of the
cores (co-located services, a noisy neighbour), the kernel deschedules one of our threads and the
others wait for it, hundreds of times per forward. Measured on this 2-vCPU machine with other work
running: a SmolLM2 forward over 2-4 new rows took ~775 ms with 2 threads and ~200 ms with 1
(1 row: 155 vs 117 ms); quiet, 2 threads win (60 vs 100+ ms). No fixed count is right for both, so
the governor measures: per row count it keeps a smoothed time for each candidate thread count,
uses the fastest, and re-times the others now and then, so it follows the load as it comes and goes.

Thread count changes only the order of float additions inside a kernel, never which law a service
returns beyond float32 rounding (the layouts of `cpu_layout` already differ that much by row count).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

_MAX_KEY = 17  # row counts past 16 (prefills) share one record


class ThreadGovernor:
    """Chooses among `candidates` thread counts per row count: the first (all CPUs) until others
    are timed; every `explore_every`-th use of a row count times one that is not the current best."""

    def __init__(
        self,
        candidates: tuple[int, ...],
        set_threads: Callable[[int], None],
        get_threads: Callable[[], int],
        explore_every: int = 48,
        smoothing: float = 0.3,
        clock: Callable[[], float] = time.perf_counter,
    ):
        if not candidates or min(candidates) < 1:
            raise ValueError(f"thread candidates must be >= 1, got {candidates}")
        self.candidates = tuple(dict.fromkeys(candidates))  # in order of preference, no repeats
        self.set_threads = set_threads
        # Read back, not remembered: two models in one process share the setting.
        self.get_threads = get_threads
        self.explore_every = explore_every
        self.smoothing = smoothing
        self.clock = clock
        self.seconds: dict[tuple[int, int], float] = {}  # (row key, threads) -> smoothed seconds
        self.uses: dict[int, int] = {}  # row key -> forwards run

    def seed(self, rows: int, threads: int, seconds: float) -> None:
        """A time measured elsewhere (the start-up calibration), as if this governor had timed it."""
        self.seconds[min(rows, _MAX_KEY), threads] = seconds

    def choose(self, rows: int) -> int:
        key = min(rows, _MAX_KEY)
        if not any((key, t) in self.seconds for t in self.candidates):
            return self.candidates[0]  # all the CPUs until there is something to compare
        best = self._best(key)
        uses = self.uses.get(key, 0)
        if uses % self.explore_every == self.explore_every - 1:
            # Now and then another candidate, untimed ones included: a first forward of a shape
            # is slow (allocations), so trying the others at once would judge it on that one.
            others = [t for t in self.candidates if t != best]
            return others[(uses // self.explore_every) % len(others)] if others else best
        return best

    def _best(self, key: int) -> int:
        return min(self.candidates, key=lambda t: self.seconds.get((key, t), float("inf")))

    def record(self, rows: int, threads: int, seconds: float) -> None:
        key = min(rows, _MAX_KEY)
        self.uses[key] = self.uses.get(key, 0) + 1
        old = self.seconds.get((key, threads))
        if old is None or threads != self._best(key):
            # A re-timed candidate's record is stale (the load has moved since): replace it. The
            # best one is timed every use: smooth it, so one slow forward does not flip the choice.
            self.seconds[key, threads] = seconds
        else:
            self.seconds[key, threads] = old + self.smoothing * (seconds - old)

    @contextmanager
    def forward(self, rows: int) -> Iterator[None]:
        """Around one forward over `rows` new rows, on the model's thread: set, time, record."""
        threads = self.choose(rows)
        if threads != self.get_threads():
            self.set_threads(threads)
        started = self.clock()
        yield
        self.record(rows, threads, self.clock() - started)


@contextmanager
def one_thread() -> Iterator[None]:
    """torch's small ops on the calling thread alone for a while (a step's laws: a few hundred
    microseconds of softmax over the vocabulary). Between forwards the callers those laws wake run
    on the other cores, and a 2-thread region waits at its barrier for a worker they deschedule;
    on one thread the ops only share a core. Measured quiet (49,152 logits, float64 softmax): 1 row
    0.144 ms on one thread against 0.124 on two, 8 rows 1.48 against 0.98."""
    import torch

    before = torch.get_num_threads()
    if before == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def set_torch_threads(count: int) -> None:
    """torch's intra-op thread count for the calling thread. A thread's first torch call sets its
    count to the one last set by any thread; that happens here first, so it cannot undo this later."""
    import torch

    torch.get_num_threads()
    torch.set_num_threads(count)


def thread_candidates(available: int) -> tuple[int, ...]:
    """All the CPUs this process may use first, then fewer: one, and half when that differs."""
    return tuple(dict.fromkeys((available, max(1, available // 2), 1)))
