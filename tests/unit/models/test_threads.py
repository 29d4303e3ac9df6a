"""ThreadGovernor: the fastest measured thread count per row count, re-timing the others now and then."""

from __future__ import annotations

import pytest

from specdec.models.threads import ThreadGovernor, thread_candidates


class _Machine:
    """A fake clock whose forwards cost cost(rows, threads) seconds; records thread changes."""

    def __init__(self, cost):
        self.cost, self.now, self.threads, self.changes = cost, 0.0, 2, 0

    def set_threads(self, n):
        self.threads, self.changes = n, self.changes + 1

    def run(self, governor, rows, forwards):
        used = []
        for _ in range(forwards):
            with governor.forward(rows):
                used.append(self.threads)
                self.now += self.cost(rows, self.threads)
        return used


def _governor(machine, explore_every=8):
    return ThreadGovernor(
        (2, 1), machine.set_threads, lambda: machine.threads, explore_every, clock=lambda: machine.now
    )


def test_it_times_each_candidate_then_keeps_the_fastest_and_explores_now_and_then():
    contended = _Machine(lambda rows, threads: 0.2 if threads == 1 else 0.78)
    used = contended.run(_governor(contended), rows=3, forwards=24)
    assert used[:2] == [2, 1]  # each candidate timed once
    assert used[2:7] == [1] * 5 and used.count(2) == 1 + 3  # then 1 thread, 2 re-timed every 8th use
    quiet = _Machine(lambda rows, threads: 0.06 if threads == 2 else 0.1)
    assert quiet.run(_governor(quiet), rows=1, forwards=10)[2:] == [2] * 5 + [1] + [2] * 2


def test_row_counts_keep_separate_records_and_it_follows_the_load():
    load = {"busy": True}
    machine = _Machine(lambda rows, threads: (0.2 if threads == 1 else 0.78) if load["busy"] else 0.06 * threads**-1)
    governor = _governor(machine, explore_every=4)
    machine.run(governor, rows=1, forwards=2)
    assert (2, 2) not in governor.seconds and {(1, 1), (1, 2)} <= set(governor.seconds)
    assert machine.run(governor, rows=5, forwards=6)[-1] == 1
    load["busy"] = False
    used = machine.run(governor, rows=5, forwards=16)
    assert used[:5] == [1, 2, 2, 2, 2]  # the first re-time found 2 threads faster again
    assert used.count(1) == 4  # and 1 thread is re-timed every 4th use from then on


def test_candidates_and_bad_input():
    assert thread_candidates(2) == (2, 1) and thread_candidates(8) == (8, 4, 1) and thread_candidates(1) == (1,)
    with pytest.raises(ValueError, match=">= 1"):
        ThreadGovernor((0,), lambda n: None, lambda: 1)
