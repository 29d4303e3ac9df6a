"""Whom a new call waits for (CompanyForecast, on given times), and StepScheduler.close()."""

from __future__ import annotations

import threading
import time

import pytest
from test_scheduler import FakeRunner, call_in_thread, session_task, wait_queued

from specdec.core.errors import Unavailable
from specdec.models import scheduler as scheduler_module
from specdec.models.scheduler import COMPANY_WINDOW_S, CompanyForecast, SchedulerLimits, StepScheduler

WAIT = 0.002  # the default batch wait


def learned(gaps: list[float], session: str = "a", start: float = 100.0) -> tuple[CompanyForecast, float]:
    """A forecast that saw `session` come back after each gap; returns it and when its last call ended."""
    forecast, now = CompanyForecast(), start
    for gap in gaps:
        forecast.ended(session, now)
        now += gap
        forecast.arrived(session, now)
        now += 0.05  # its call runs
    forecast.ended(session, now)
    return forecast, now


def test_with_no_gap_known_an_away_session_is_expected_once():
    forecast = CompanyForecast()
    forecast.ended("a", 10.0)
    assert forecast.expected(10.001, 10.003, WAIT) == {"a"}
    forecast.missed({"a"})  # it did not come within the wait
    assert forecast.expected(10.004, 10.006, WAIT) == set()
    forecast.ended("", 10.0)  # uncached sequences are nobody's company
    assert forecast.expected(10.004, 10.006, WAIT) == set()


def test_a_session_is_expected_only_when_its_next_call_is_due_within_the_wait():
    forecast, ended = learned([0.010] * 6)
    assert forecast.expected(ended + 0.001, ended + 0.003, WAIT) == set()  # due in 10 ms: not now
    assert forecast.expected(ended + 0.009, ended + 0.011, WAIT) == {"a"}  # due within the wait
    assert forecast.expected(ended + 0.011, ended + 0.013, WAIT) == {"a"}  # a little late: still coming


def test_an_overdue_session_is_forgotten_as_a_finished_stream_is():
    forecast, ended = learned([0.010] * 6)
    assert forecast.expected(ended + 0.030, ended + 0.032, WAIT) == set()
    assert forecast.expected(ended + 0.009, ended + 0.011, WAIT) == set()  # forgotten, not merely skipped
    forecast.arrived("a", ended + 0.040)  # it was not away: this late call teaches nothing
    forecast.ended("a", ended + 0.050)
    assert forecast.expected(ended + 0.051, ended + 0.053, WAIT) == set()
    assert forecast.expected(ended + 0.059, ended + 0.061, WAIT) == {"a"}  # expected again, when due


def test_a_session_seen_once_is_expected_on_the_cadence_of_the_others():
    forecast, ended = learned([0.010] * 6)
    forecast.ended("b", ended)  # b has not come back yet: its gap is unknown
    assert forecast.expected(ended + 0.001, ended + 0.003, WAIT) == set()
    assert forecast.expected(ended + 0.009, ended + 0.011, WAIT) == {"a", "b"}


def test_jittery_gaps_widen_the_window_a_session_is_expected_in():
    steady, steady_end = learned([0.010] * 8)
    jittery, jittery_end = learned([0.004, 0.016] * 4)
    assert steady.expected(steady_end + 0.005, steady_end + 0.007, WAIT) == set()
    assert jittery.expected(jittery_end + 0.005, jittery_end + 0.007, WAIT) == {"a"}


def test_nobody_is_expected_after_the_company_window_nor_is_a_long_pause_learned():
    forecast = CompanyForecast()
    forecast.ended("a", 0.0)
    assert forecast.expected(COMPANY_WINDOW_S + 0.1, COMPANY_WINDOW_S + 0.2, WAIT) == set()
    forecast.arrived("a", COMPANY_WINDOW_S + 0.5)  # a client's pause, not a stream's cadence
    forecast.ended("a", COMPANY_WINDOW_S + 0.6)
    forecast.ended("b", COMPANY_WINDOW_S + 0.6)
    assert forecast.expected(COMPANY_WINDOW_S + 0.601, COMPANY_WINDOW_S + 0.603, WAIT) == {"a", "b"}  # no gap known


def test_cadences_kept_are_bounded(monkeypatch):
    monkeypatch.setattr(scheduler_module, "MAX_CADENCES", 3)
    forecast = CompanyForecast()
    for i in range(10):
        forecast.ended(f"s{i}", float(i))
        forecast.arrived(f"s{i}", i + 0.01)
    assert list(forecast._cadence) == ["s7", "s8", "s9"]


# ---------------------------------------------------------------- through the scheduler


def test_a_session_whose_stream_ended_is_waited_for_at_most_once():
    """ "a" ran a few rounds and stopped; "b"'s five calls that follow wait for it once at most
    (before: every call within a second of a's last one waited the whole window)."""
    runner = FakeRunner()
    s = StepScheduler(runner, SchedulerLimits(batch_wait_s=0.05))
    for _ in range(3):
        s.run([("a", session_task("a"))])
        time.sleep(0.01)
    for _ in range(5):
        s.run([("b", session_task("b"))])
    assert s.stats.company_waits <= 1 and s.stats.company_missed == s.stats.company_waits, s.stats
    assert runner.sessions()[3:] == [["b"]] * 5


def test_a_session_not_due_within_the_wait_is_not_waited_for():
    """ "a" comes back every ~150 ms; a call of "b" just after a's call ended does not wait for it."""
    runner = FakeRunner()
    s = StepScheduler(runner, SchedulerLimits(batch_wait_s=0.02))
    for _ in range(5):
        s.run([("a", session_task("a"))])
        time.sleep(0.15)
    s.run([("a", session_task("a"))])
    s.run([("b", session_task("b"))])
    assert s.stats.company_waits == 0, s.stats


def test_a_session_due_within_the_wait_is_waited_for_and_shares_the_step():
    runner = FakeRunner()
    s = StepScheduler(runner, SchedulerLimits(batch_wait_s=0.3))
    rounds, ended = 6, threading.Event()

    def stream():
        for i in range(rounds):
            s.run([("a", session_task("a"))])
            if i == rounds - 2:
                ended.set()
            time.sleep(0.1)

    thread = threading.Thread(target=stream)
    thread.start()
    assert ended.wait(10)
    time.sleep(0.05)  # a's next call is due in ~50 ms, within b's wait
    s.run([("b", session_task("b"))])
    thread.join(10)
    assert ["a", "b"] in [sorted(step) for step in runner.sessions()], runner.sessions()
    assert s.stats.company_waits >= 1


def two_streams(share: float, rounds: int = 8) -> list[list[str]]:
    """Streams "a" and "b" (5 ms between their calls) on a model whose steps take 60 ms, "b"
    starting while a's first step runs; returns the sessions of each step."""
    runner = FakeRunner()
    runner.step_s = 0.06
    s = StepScheduler(runner, SchedulerLimits(batch_wait_s=WAIT, batch_wait_share=share))

    def stream(name: str) -> None:
        for _ in range(rounds):
            s.run([(name, session_task(name))])
            time.sleep(0.005)

    threads = [threading.Thread(target=stream, args=(name,)) for name in ("a", "b")]
    threads[0].start()
    time.sleep(0.03)
    threads[1].start()
    for thread in threads:
        thread.join(10)
    return [sorted(step) for step in runner.sessions()]


def test_calls_queued_during_a_step_wait_after_it_for_the_streams_it_served():
    """Without waiting after a step, "b" (queued during a's step) starts the next step alone the
    moment it ends, just before "a" comes back, and the two alternate for good: every token of
    each stream costs two steps. Waiting up to a share of a step for the sessions it served
    merges them."""
    assert ["a", "b"] not in two_streams(share=0.0)  # the alternation
    steps = two_streams(share=0.25)  # a 15 ms wait
    assert steps[2:].count(["a", "b"]) >= len(steps[2:]) - 2, steps
    assert len(steps) <= 8 + 4, steps


def test_a_wait_ends_batch_wait_after_arrival_or_a_share_of_a_step_after_the_last_one():
    runner = FakeRunner()
    s = StepScheduler(runner, SchedulerLimits(batch_wait_s=0.002, batch_wait_share=0.25))
    assert s.wait_until(5.0) == 5.002  # no step seen yet
    runner.step_s = 0.04
    s.run([("a", session_task("a"))])
    ended = s._step_ended
    assert 0.0099 <= s.wait_until(0.0) - ended < 0.02  # a quarter of a 40 ms step after it ended
    assert s.wait_until(ended + 1.0) == ended + 1.002  # a call arriving long after: its own 2 ms
    runner.step_s = 0.0
    for _ in range(40):  # steps of ~0 ms: no wait after them beyond a call's own 2 ms
        s.run([("a", session_task("a"))])
    assert s.wait_until(s._step_ended) - s._step_ended < 0.0025
    assert StepScheduler(runner, SchedulerLimits(batch_wait_s=0.0)).wait_until(1.0) is None  # 0 = never wait
    with pytest.raises(ValueError):
        SchedulerLimits(batch_wait_share=1.5)


def test_a_call_that_fills_a_step_waits_for_nobody():
    """A session is due within the wait, but the waiting call's sequences alone fill a step's token
    budget: nobody could join the step, so it runs at once (a `num_samples` call's steps used to wait
    for the sessions they had just finished, due back only after the call)."""
    runner = FakeRunner()
    s = StepScheduler(runner, SchedulerLimits(batch_wait_s=0.3, max_batch_tokens=2))
    for _ in range(5):  # "a" comes back every ~100 ms, then its stream ends unannounced
        s.run([("a", session_task("a"))])
        time.sleep(0.1)
    started = time.monotonic()  # a's next call would be due now
    s.run([(name, session_task(name, steps=2)) for name in ("b", "c")])
    took = time.monotonic() - started
    assert s.stats.company_waits == 0, s.stats
    assert took < 0.2, took  # (waiting for "a": 0.3 s)
    assert runner.sessions()[5:] == [["b", "c"]] * 2


def test_a_calls_own_finished_sequences_are_not_waited_for():
    """A call's caller sends its next call only after the whole result, so a sequence that finished
    early (a `num_samples` call's samples of unequal work) is not due while its siblings still run:
    they step on without waiting for it."""
    runner = FakeRunner()
    runner.step_s = 0.02
    s = StepScheduler(runner, SchedulerLimits(batch_wait_s=0.2))
    started = time.monotonic()
    s.run([("a", session_task("a")), ("b", session_task("b", steps=3))])
    assert s.stats.company_waits == 0, s.stats
    assert time.monotonic() - started < 0.15
    assert runner.sessions() == [["a", "b"], ["b"], ["b"]]


# ---------------------------------------------------------------- close


def test_close_fails_admitted_calls_at_once_steps_nothing_more_and_refuses_new_ones():
    runner = FakeRunner()
    s = StepScheduler(runner, SchedulerLimits(batch_wait_s=0.0))
    release = runner.hold()
    joins = [call_in_thread(s, [(name, session_task(name, steps=3))]) for name in ("a", "b")]
    wait_queued(s, 2)
    assert s.close(wait_s=0.05) is False  # the model thread is busy: the iteration is still queued
    for join in joins:
        result, error = join()  # returned before the model thread is free
        assert isinstance(error, Unavailable) and "shutting down" in str(error) and result is None
    release.set()
    assert s.close(wait_s=5) is True
    assert runner.steps == [] and s.queued == 0
    with pytest.raises(Unavailable, match="shutting down"):
        s.run([("c", session_task("c"))])


def test_close_ends_a_wait_for_company():
    runner = FakeRunner()
    s = StepScheduler(runner, SchedulerLimits(batch_wait_s=30.0))
    s.run([("a", session_task("a"))])  # "a" is away: "b" would wait up to 30 s for it
    join = call_in_thread(s, [("b", session_task("b"))])
    wait_queued(s, 1)
    started = time.monotonic()
    assert s.close() is True
    assert isinstance(join()[1], Unavailable)
    assert time.monotonic() - started < 10


@pytest.mark.parametrize("steps_on", [True, False])
def test_a_step_that_carries_a_call_stepping_on_waits_for_nobody(steps_on):
    """Decode steps: "b"'s call of 6 steps runs while stream "a" comes back every ~45 ms. Its first
    step may wait for "a" (a call just arrived); the next ones do not (they would wait up to a
    step each time "a" is due), and "a" joins whichever step follows its arrival. A call that
    does not step on (a draft's steps) waits each time, as before."""
    runner = FakeRunner()
    runner.step_s = 0.03
    s = StepScheduler(runner, SchedulerLimits(batch_wait_s=0.002, batch_wait_share=1.0))
    stop = threading.Event()

    def stream():
        while not stop.is_set():
            s.run([("a", session_task("a"))])
            time.sleep(0.015)

    thread = threading.Thread(target=stream)
    thread.start()
    time.sleep(0.5)  # a's cadence is learned
    waits = s.stats.company_waits
    s.run([("b", session_task("b", steps=6))], steps_on=steps_on)
    waits = s.stats.company_waits - waits
    stop.set()
    thread.join(10)
    assert waits <= 1 if steps_on else waits >= 4, s.stats
    assert any(step == ["a", "b"] for step in (sorted(x) for x in runner.sessions())), runner.sessions()
