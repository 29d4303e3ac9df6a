"""coordinator/pools.py: draft/target compatibility, and the coordinator's cached view of its pools."""

from __future__ import annotations

import threading
import time

import pytest

from coordinator.pools import Pools, check_compatible
from specdec.core.draft_health import DraftHealth
from specdec.core.errors import FailedPrecondition, Unavailable
from specdec.core.protocols import NO_DEADLINE
from specdec.v1 import common_pb2

FINGERPRINT = "f" * 64


def _info(**fields) -> common_pb2.ModelInfo:
    defaults = {
        "model_id": "target-model",
        "vocab_size": 100,
        "tokenizer_fingerprint": FINGERPRINT,
        "eos_token_ids": [0],
        "hidden_size": 64,
        "max_position_embeddings": 2048,
        "role": "target",
    }
    return common_pb2.ModelInfo(**{**defaults, **fields})


def _draft_info(**fields) -> common_pb2.ModelInfo:
    return _info(**{"model_id": "draft-model", "role": "draft", "hidden_size": 32, **fields})


class FakeClient:
    """A pool client: `info(deadline)` answers the next reply (a ModelInfo, or an exception to raise)."""

    def __init__(self, *replies):
        self.replies = list(replies)
        self.calls = 0

    def info(self, deadline):
        reply = self.replies[min(self.calls, len(self.replies) - 1)]
        self.calls += 1
        if isinstance(reply, Exception):
            raise reply
        return reply


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture()
def clock(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(time, "monotonic", clock)
    return clock


# ---------------------------------------------------------------- check_compatible


def test_equal_infos_are_compatible():
    check_compatible(_draft_info(), _info())


def test_hidden_width_matters_only_for_a_draft_that_reads_hidden_states():
    check_compatible(_draft_info(hidden_size=32, needs_target_hidden_states=False), _info(hidden_size=64))
    check_compatible(_draft_info(hidden_size=64, needs_target_hidden_states=True), _info(hidden_size=64))
    with pytest.raises(FailedPrecondition, match="the draft reads hidden states of width 32, the target's are 64"):
        check_compatible(_draft_info(hidden_size=32, needs_target_hidden_states=True), _info(hidden_size=64))


@pytest.mark.parametrize(
    ("draft", "problem"),
    [
        (_draft_info(vocab_size=99), "vocab size 99 vs 100"),
        (_draft_info(tokenizer_fingerprint="0" * 64), "tokenizer fingerprints differ"),
    ],
)
def test_each_problem_is_named(draft, problem):
    with pytest.raises(FailedPrecondition) as info:
        check_compatible(draft, _info())
    message = str(info.value)
    assert problem in message
    assert "'draft-model'" in message and "'target-model'" in message
    assert "num_speculative_tokens=0" in message
    assert info.value.code == "FAILED_PRECONDITION"


def test_all_problems_are_named_together():
    draft = _draft_info(vocab_size=50, tokenizer_fingerprint="0" * 64, needs_target_hidden_states=True, hidden_size=8)
    with pytest.raises(FailedPrecondition) as info:
        check_compatible(draft, _info())
    assert "(vocab size 50 vs 100; tokenizer fingerprints differ; the draft reads hidden states of width 8" in str(
        info.value
    )


# ---------------------------------------------------------------- Pools.info


def test_target_only_info_does_not_ask_the_draft(clock):
    draft, target = FakeClient(_draft_info()), FakeClient(_info())
    info = Pools(draft, target, "tok", FINGERPRINT).info(NO_DEADLINE, need_draft=False)
    assert info.target == _info()
    assert info.draft is None and info.compatible_error is None
    assert (draft.calls, target.calls) == (0, 1)


def test_info_is_cached_then_refreshed_in_the_background(clock):
    draft, target = FakeClient(_draft_info()), FakeClient(_info(), _info(model_id="target-v2"))
    pools = Pools(draft, target, "tok", FINGERPRINT, refresh_s=60.0)

    first = pools.info(NO_DEADLINE, need_draft=True)
    clock.now += 59.0
    assert pools.info(NO_DEADLINE, need_draft=True) is first
    assert pools.info(NO_DEADLINE, need_draft=False) is first  # a cached draft is fine when none is needed
    assert (draft.calls, target.calls) == (1, 1) and pools.refresher is None

    clock.now += 1.5
    assert pools.info(NO_DEADLINE, need_draft=True) is first  # stale: answered at once, refreshed behind
    pools.refresher.join(5)
    refreshed = pools.info(NO_DEADLINE, need_draft=True)
    assert refreshed.target.model_id == "target-v2" and refreshed.draft == _draft_info()
    assert (draft.calls, target.calls) == (2, 2)


def test_the_draft_is_fetched_once_it_is_needed(clock):
    draft, target = FakeClient(_draft_info()), FakeClient(_info())
    pools = Pools(draft, target, "tok", FINGERPRINT)

    assert pools.info(NO_DEADLINE, need_draft=False).draft is None
    info = pools.info(NO_DEADLINE, need_draft=True)
    assert info.draft == _draft_info() and info.compatible_error is None
    assert draft.calls == 1
    assert pools.info(NO_DEADLINE, need_draft=True) is info
    assert draft.calls == 1


def test_a_target_with_another_tokenizer_is_refused(clock):
    target = FakeClient(_info(tokenizer_fingerprint="0" * 64, model_id="other-model"))
    draft = FakeClient(_draft_info())
    pools = Pools(draft, target, "my/tokenizer", FINGERPRINT)
    for _ in range(2):  # nothing is cached: every call asks again
        with pytest.raises(FailedPrecondition, match="'my/tokenizer'.*'other-model'"):
            pools.info(NO_DEADLINE, need_draft=True)
    assert (draft.calls, target.calls) == (0, 2)


def test_an_incompatible_draft_is_recorded_not_raised(clock):
    draft, target = FakeClient(_draft_info(vocab_size=7)), FakeClient(_info())
    pools = Pools(draft, target, "tok", FINGERPRINT)
    info = pools.info(NO_DEADLINE, need_draft=True)
    assert info.draft.vocab_size == 7
    assert "vocab size 7 vs 100" in info.compatible_error
    # Target-only requests still work, from the same cached info.
    assert pools.info(NO_DEADLINE, need_draft=False) is info


def test_an_unreachable_target_is_an_error_and_is_not_cached(clock):
    draft, target = FakeClient(_draft_info()), FakeClient(Unavailable("target down"), _info())
    pools = Pools(draft, target, "tok", FINGERPRINT)
    with pytest.raises(Unavailable):
        pools.info(NO_DEADLINE, need_draft=True)
    assert pools.info(NO_DEADLINE, need_draft=True).target == _info()
    assert target.calls == 2


def test_an_unreachable_draft_is_down_for_its_back_off_not_an_error(clock):
    draft, target = FakeClient(Unavailable("draft down"), _draft_info()), FakeClient(_info())
    health = DraftHealth(backoff_s=30, clock=clock)
    pools = Pools(draft, target, "tok", FINGERPRINT, health=health)
    info = pools.info(NO_DEADLINE, need_draft=True)
    assert info.draft is None and info.compatible_error is None  # the request runs at K = 0
    assert not health.healthy
    clock.now += 10
    assert pools.info(NO_DEADLINE, need_draft=True).draft is None
    assert draft.calls == 1  # not asked again while it backs off
    clock.now += 25
    assert pools.info(NO_DEADLINE, need_draft=True).draft == _draft_info()  # one request asks again
    assert draft.calls == 2 and health.healthy


class HangingClient(FakeClient):
    """A pool whose Info blocks until `release` is set, then answers."""

    def __init__(self, reply):
        super().__init__(reply)
        self.release, self.entered = threading.Event(), threading.Event()

    def info(self, deadline):
        self.entered.set()
        self.release.wait(10)
        return super().info(deadline)


def test_requests_never_wait_behind_a_hanging_draft_info_once_the_target_is_known():
    """Before the fix every request waited under one lock while a draft Info call ran."""
    draft, target = HangingClient(_draft_info()), FakeClient(_info())
    pools = Pools(draft, target, "tok", FINGERPRINT)
    pools.info(NO_DEADLINE, need_draft=False)  # the target is known
    first = threading.Thread(target=pools.info, args=(NO_DEADLINE, True))
    first.start()
    try:
        assert draft.entered.wait(5)  # the first K > 0 request is waiting for the draft's first Info
        started = time.perf_counter()
        for _ in range(20):
            assert pools.info(NO_DEADLINE, need_draft=False).draft is None
        assert time.perf_counter() - started < 0.5
    finally:
        draft.release.set()
        first.join(5)
    assert pools.info(NO_DEADLINE, need_draft=True).draft == _draft_info()


def test_a_refresh_of_a_hanging_pool_delays_no_request(clock):
    draft, target = HangingClient(_draft_info()), FakeClient(_info())
    draft.release.set()
    pools = Pools(draft, target, "tok", FINGERPRINT, refresh_s=60.0)
    known = pools.info(NO_DEADLINE, need_draft=True)
    draft.release.clear()
    draft.entered.clear()
    clock.now += 61
    try:
        pools.info(NO_DEADLINE, need_draft=True)  # starts the refresh
        assert draft.entered.wait(5)  # the refresh is waiting on the draft
        started = time.perf_counter()
        for need_draft in (True, False) * 10:
            assert pools.info(NO_DEADLINE, need_draft=need_draft) is known
        assert time.perf_counter() - started < 0.5
    finally:
        draft.release.set()
        pools.refresher.join(5)


def test_a_draft_that_does_not_answer_its_first_info_delays_only_the_request_that_asked():
    draft, target = HangingClient(Unavailable("timed out")), FakeClient(_info())
    pools = Pools(draft, target, "tok", FINGERPRINT)
    pools.info(NO_DEADLINE, need_draft=False)
    first = threading.Thread(target=pools.info, args=(NO_DEADLINE, True))
    first.start()
    assert draft.entered.wait(5)
    draft.release.set()
    first.join(5)
    # The draft is down now: K > 0 requests neither wait nor ask it again.
    draft.release.clear()
    started = time.perf_counter()
    for _ in range(10):
        assert pools.info(NO_DEADLINE, need_draft=True).draft is None
    assert time.perf_counter() - started < 0.5 and draft.calls == 1
