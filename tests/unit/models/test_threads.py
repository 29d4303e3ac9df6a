"""ThreadGovernor: the fastest measured thread count per row count, re-timing the others now and then."""

from __future__ import annotations

import pytest

from specdec.models.threads import ThreadGovernor, set_torch_threads, thread_candidates


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


def test_it_starts_on_all_cpus_then_times_the_others_now_and_then_and_keeps_the_fastest():
    contended = _Machine(lambda rows, threads: 0.2 if threads == 1 else 0.78)
    used = contended.run(_governor(contended), rows=3, forwards=24)
    assert used[:7] == [2] * 7 and used[7] == 1  # the 8th use tries 1 thread
    assert used[8:15] == [1] * 7 and used[15] == 2 and used[16:] == [1] * 7 + [2]
    quiet = _Machine(lambda rows, threads: 0.06 if threads == 2 else 0.1)
    assert quiet.run(_governor(quiet), rows=1, forwards=10) == [2] * 7 + [1] + [2] * 2


def test_seeded_times_count_and_row_counts_keep_separate_records():
    load = {"busy": True}
    machine = _Machine(lambda rows, threads: (0.2 if threads == 1 else 0.78) if load["busy"] else 0.06 / threads)
    governor = _governor(machine, explore_every=4)
    governor.seed(5, 2, 0.05)  # a quiet start-up calibration
    machine.run(governor, rows=1, forwards=4)
    assert (1, 1) in governor.seconds and (5, 1) not in governor.seconds
    assert machine.run(governor, rows=5, forwards=8) == [2, 2, 2, 1, 1, 1, 1, 2]  # EMA of 2 rose; 1 won
    load["busy"] = False
    used = machine.run(governor, rows=5, forwards=8)
    assert used == [1, 1, 1, 2, 2, 2, 2, 1]  # re-timing found 2 threads faster again


def test_candidates_and_bad_input():
    assert thread_candidates(2) == (2, 1) and thread_candidates(8) == (8, 4, 1) and thread_candidates(1) == (1,)
    with pytest.raises(ValueError, match=">= 1"):
        ThreadGovernor((0,), lambda n: None, lambda: 1)


def test_a_threads_count_survives_another_thread_setting_its_own_before_its_first_torch_op():
    """torch gives a thread, at its first parallel op, the count last set by any thread; a count
    set with set_torch_threads is already past that, so a gRPC or bench thread's 1 cannot undo
    the model thread's 2."""
    import threading

    import torch

    set_here, other_set, seen = threading.Event(), threading.Event(), []

    def model_thread():
        set_torch_threads(2)
        set_here.set()
        other_set.wait(10)
        torch.ones(1 << 18).exp_()  # parallel-sized: a first op would run torch's lazy init here
        seen.append(torch.get_num_threads())

    def other_thread():
        set_here.wait(10)
        set_torch_threads(1)
        other_set.set()

    threads = [threading.Thread(target=model_thread), threading.Thread(target=other_thread)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert seen == [2]
