"""`BatchingVerifier`: concurrent callers' Verify calls as one call, each caller its own results and
errors, samplings (and decode steps) apart, waits bounded."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import numpy as np
import pytest

from specdec.core.call_batching import BatchingVerifier
from specdec.core.errors import DeadlineExceeded, InvalidArgument
from specdec.core.protocols import NO_DEADLINE, Deadline, VerifyRequest, VerifyResult
from specdec.core.sampling import Sampling


class FakePool:
    """Answers each request with a law tagged by its cache key; refuses a call holding one with an
    empty prefix (a bad request). Answers at the end of the current `step_s` period, as a pool's
    batched step answers every call it carried at once."""

    def __init__(self, step_s: float = 0.02):
        self.calls: list[tuple[list[str], Sampling]] = []
        self.step_s = step_s
        self.lock = threading.Lock()

    def verify(self, requests, sampling, deadline):
        with self.lock:
            self.calls.append(([r.cache_key for r in requests], sampling))
        if self.step_s:
            time.sleep(self.step_s - time.monotonic() % self.step_s)
        if any(not r.prefix_token_ids for r in requests):
            raise InvalidArgument("a bad request")
        deadline.check()
        return [VerifyResult(np.full((1, 2), float(len(r.cache_key))), len(r.prefix_token_ids)) for r in requests]


def _request(key: str, prefix: int = 3) -> VerifyRequest:
    return VerifyRequest(key, list(range(prefix)), [])


def _together(batcher, keys, bad=(), rounds=3):
    """Every key's `rounds` calls from its own thread, the first ones released at once (callers
    batch with those of a batch that came back: from the second round on); the last call's results
    or error per key, whose prefix is as long as the key, or empty on its last call when in `bad`."""
    start = threading.Barrier(len(keys))

    def one(key):
        start.wait()
        for round_ in range(rounds):
            prefix = 0 if key in bad and round_ == rounds - 1 else len(key)
            try:
                got = batcher.verify([_request(key, prefix)], Sampling(1.0), NO_DEADLINE)
            except Exception as exc:  # noqa: BLE001 - what the caller got
                got = exc
        return got

    with ThreadPoolExecutor(len(keys)) as pool:
        return dict(zip(keys, pool.map(one, keys), strict=True))


def test_concurrent_callers_share_calls_and_each_gets_its_own_results():
    pool = FakePool()
    batcher = BatchingVerifier(pool, wait_s=0.05)
    keys = [f"s{i}" + "x" * i for i in range(8)]
    got = _together(batcher, keys)
    for key, results in got.items():
        (result,) = results
        assert result.cached_tokens == len(key) and result.target_probs[0, 0] == len(key)
    assert len(pool.calls) < 3 * len(keys) and sorted(k for call, _ in pool.calls for k in call) == sorted(3 * keys)
    assert batcher.stats.calls == 24 and batcher.stats.batches == len(pool.calls)


def test_the_callers_of_a_batch_come_back_into_one_batch():
    """Rounds: after the first batch, each caller's next call waits for the others that were in it."""
    pool = FakePool(step_s=0.01)
    batcher = BatchingVerifier(pool, wait_s=0.5)
    keys = [f"s{i}" for i in range(4)]
    start = threading.Barrier(len(keys))

    def stream(key):
        start.wait()
        for _ in range(5):
            batcher.verify([_request(key)], Sampling(1.0), NO_DEADLINE)
            time.sleep(0.001 * int(key[1:]))  # the coordinator's work between rounds, unequal

    with ThreadPoolExecutor(len(keys)) as threads:
        list(threads.map(stream, keys))
    later = [sorted(call) for call, _ in pool.calls[-4:]]  # the first round may split
    assert sum(len(c) for c in later) >= 12 and max(len(c) for c in later) == 4, pool.calls


def _four_callers(call) -> FakePool:
    """Four callers at once, caller i sending `call(i)` = (its request, its sampling); the pool's calls."""
    pool = FakePool()
    batcher = BatchingVerifier(pool, wait_s=0.05)
    start = threading.Barrier(4)

    def one(i):
        start.wait()
        return batcher.verify([call(i)[0]], call(i)[1], NO_DEADLINE)

    with ThreadPoolExecutor(4) as threads:
        assert all(len(r) == 1 for r in threads.map(one, range(4)))
    return pool


def test_samplings_never_share_a_call():
    pool = _four_callers(lambda i: (_request(f"k{i}"), Sampling(0.5 + i % 2)))
    for keys, sampling in pool.calls:
        assert {int(k[1:]) % 2 for k in keys} == {int(sampling.temperature - 0.5)}


def test_calls_of_other_decode_steps_never_share_a_call():
    """A one-step caller merged with a decode-steps one would wait out all its steps."""

    def call(i):  # callers 1 and 3 ask for 4 steps, 0 and 2 for one
        return replace(_request(f"k{i}"), decode_uniforms=(0.5,) * (1 + 3 * (i % 2))), Sampling(1.0)

    pool = _four_callers(call)
    assert len(pool.calls) >= 2
    for keys, _ in pool.calls:
        assert len({int(k[1:]) % 2 for k in keys}) == 1, pool.calls


def test_an_error_stays_with_the_request_it_concerns():
    pool = FakePool()
    batcher = BatchingVerifier(pool, wait_s=0.05)
    got = _together(batcher, ["good-a", "bad", "good-b", "good-c"], bad={"bad"})
    assert isinstance(got["bad"], InvalidArgument)
    for key in ("good-a", "good-b", "good-c"):
        assert got[key][0].cached_tokens == len(key)
    assert batcher.stats.retried_alone >= 2 and ["bad"] in [call for call, _ in pool.calls]


def test_a_lone_callers_error_is_raised_without_a_second_call():
    pool = FakePool(step_s=0)
    batcher = BatchingVerifier(pool, wait_s=0.05)
    with pytest.raises(InvalidArgument):
        batcher.verify([_request("bad", 0)], Sampling(1.0), NO_DEADLINE)
    assert len(pool.calls) == 1 and batcher.stats.retried_alone == 0


def test_each_caller_keeps_its_own_deadline():
    """The batch's call runs to the latest deadline; a caller whose own passed gets DeadlineExceeded."""
    pool = FakePool(step_s=0.05)
    batcher = BatchingVerifier(pool, wait_s=0.2)
    start = threading.Barrier(2)

    def calls(key, left_s):
        start.wait()
        got = []
        for _ in range(3):
            deadline = NO_DEADLINE if left_s is None else Deadline(time.monotonic() + left_s)
            try:
                got.append(batcher.verify([_request(key)], Sampling(1.0), deadline))
            except DeadlineExceeded as exc:
                got.append(exc)
        return got

    with ThreadPoolExecutor(2) as threads:
        short, long = threads.map(calls, ["short", "long"], [0.005, None])
    assert sorted(["short", "long"]) in [sorted(keys) for keys, _ in pool.calls], pool.calls
    assert all(isinstance(g, DeadlineExceeded) for g in short) and all(g[0].cached_tokens == 3 for g in long)


def test_a_long_call_in_flight_is_waited_for_once():
    """A prompt's call takes many steps: the other callers' rounds wait for it once, not each."""
    pool = FakePool(step_s=0)
    sent, slow = threading.Event(), threading.Event()
    verify = pool.verify

    def slow_prompt(requests, sampling, deadline):
        if requests[0].cache_key == "prompt":
            sent.set()
            slow.wait(5)
        return verify(requests, sampling, deadline)

    def prompt_call() -> threading.Thread:
        sent.clear()
        slow.clear()
        thread = threading.Thread(target=batcher.verify, args=([_request("prompt")], Sampling(1.0), NO_DEADLINE))
        thread.start()
        assert sent.wait(5)
        return thread

    pool.verify = slow_prompt
    batcher = BatchingVerifier(pool, wait_s=0.1)
    prompt = prompt_call()
    started = time.monotonic()
    for _ in range(6):
        batcher.verify([_request("decode")], Sampling(1.0), NO_DEADLINE)
    took = time.monotonic() - started
    slow.set()
    prompt.join()
    assert 0.09 < took < 0.3, took
    # Back, it is company again: its next call in flight is waited for (once more).
    prompt = prompt_call()
    started = time.monotonic()
    batcher.verify([_request("decode")], Sampling(1.0), NO_DEADLINE)
    took = time.monotonic() - started
    slow.set()
    prompt.join()
    assert took > 0.09, took


def test_a_caller_that_never_comes_back_delays_the_next_batch_once_by_at_most_the_wait():
    pool = FakePool(step_s=0)
    batcher = BatchingVerifier(pool, wait_s=0.2)
    batcher.verify([_request("ended")], Sampling(1.0), NO_DEADLINE)  # its request then ends
    started = time.monotonic()
    batcher.verify([_request("next")], Sampling(1.0), NO_DEADLINE)
    waited = time.monotonic() - started
    started = time.monotonic()
    batcher.verify([_request("next")], Sampling(1.0), NO_DEADLINE)  # "ended" is forgotten; "next" is back
    assert 0.15 < waited < 1.0 and time.monotonic() - started < 0.1


def test_no_wait_is_a_plain_call():
    pool = FakePool(step_s=0)
    batcher = BatchingVerifier(pool, wait_s=0)
    assert batcher.verify([_request("a")], Sampling(1.0), NO_DEADLINE)[0].cached_tokens == 3
    assert pool.calls == [(["a"], Sampling(1.0))] and batcher.stats.calls == batcher.stats.batches == 1


def test_a_batch_carries_at_most_max_sequences():
    pool = FakePool()
    batcher = BatchingVerifier(pool, wait_s=0.05, max_sequences=4)
    start = threading.Barrier(3)

    def samples(i):
        start.wait()
        for _ in range(3):
            got = batcher.verify([_request(f"c{i}/{j}") for j in range(2)], Sampling(1.0), NO_DEADLINE)
        return [r.cached_tokens for r in got]

    with ThreadPoolExecutor(3) as threads:
        assert list(threads.map(samples, range(3))) == [[3, 3]] * 3
    assert max(len(keys) for keys, _ in pool.calls) == 4 and len(pool.calls) < 9
