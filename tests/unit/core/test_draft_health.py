"""DraftHealth: the draft pool's back-off, shared by a coordinator's requests (fake clock)."""

from __future__ import annotations

import threading

from specdec.core.draft_health import DraftHealth


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_healthy_until_a_failure_then_nobody_proposes_during_the_back_off():
    clock = Clock()
    health = DraftHealth(backoff_s=30, clock=clock)
    assert health.healthy and health.may_propose() and health.may_propose()
    health.failed()
    assert not health.healthy and health.failures == 1
    clock.now += 29.9
    assert not health.may_propose()


def test_after_the_back_off_one_caller_probes_and_its_success_ends_it():
    clock = Clock()
    health = DraftHealth(backoff_s=30, clock=clock)
    health.failed()
    clock.now += 30
    assert health.may_propose()  # the probe
    assert not health.may_propose() and not health.may_propose()  # the others keep waiting
    health.succeeded()
    assert health.healthy and health.may_propose() and health.may_propose()


def test_a_failed_probe_starts_a_new_back_off():
    clock = Clock()
    health = DraftHealth(backoff_s=30, clock=clock)
    health.failed()
    clock.now += 31
    assert health.may_propose()
    clock.now += 1
    health.failed()
    clock.now += 29.5
    assert not health.may_propose()
    clock.now += 1
    assert health.may_propose()


def test_a_probe_that_never_reports_lets_another_caller_probe_one_back_off_later():
    clock = Clock()
    health = DraftHealth(backoff_s=10, clock=clock)
    health.failed()
    clock.now += 10
    assert health.may_propose()  # this caller's request ends without a Propose (cancelled, say)
    clock.now += 9
    assert not health.may_propose()
    clock.now += 1
    assert health.may_propose()


def test_concurrent_callers_after_a_back_off_grant_exactly_one_probe():
    clock = Clock()
    health = DraftHealth(backoff_s=5, clock=clock)
    health.failed()
    clock.now += 5
    granted = []
    barrier = threading.Barrier(16)

    def ask():
        barrier.wait()
        granted.append(health.may_propose())

    threads = [threading.Thread(target=ask) for _ in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(granted) == [False] * 15 + [True]


def test_fallback_rounds_add_up_across_requests():
    health = DraftHealth()
    health.count_fallback()
    health.count_fallback(3)
    assert health.fallback_rounds == 4
