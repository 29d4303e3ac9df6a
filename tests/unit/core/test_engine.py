"""SpeculativeEngine against in-process models (the tiny pair) and deliberate fakes."""

from __future__ import annotations

import logging
import time
from dataclasses import replace

import numpy as np
import pytest

from draft_service.proposer import LocalDrafter
from specdec.core.draft_health import DraftHealth
from specdec.core.engine import (
    FINISH_LENGTH,
    FINISH_STOP,
    GenerationSpec,
    SpeculativeEngine,
    Stats,
    _lookup_rounds,
    check_laws,
    new_samples,
)
from specdec.core.errors import DeadlineExceeded, ServiceError, Unavailable
from specdec.core.kpolicy import AdaptiveK, FixedK
from specdec.core.protocols import NO_DEADLINE, Deadline, DraftProposal, VerifyRequest, VerifyResult
from specdec.core.sampling import Sampling
from target_service.verifier import LocalVerifier

V = 8  # the tiny models' vocabulary


def _decode(ids) -> str:
    return "".join("abcdefgh"[i] for i in ids)


def _run(drafter, verifier, health=None, deadline=NO_DEADLINE, **overrides):
    fields = dict(
        context_token_ids=[1, 2, 3], max_new_tokens=12, sampling=Sampling(1.0), seed=5, num_speculative_tokens=3
    )
    spec = GenerationSpec(**{**fields, **overrides})
    engine = SpeculativeEngine(drafter, verifier, _decode, health=health)
    samples, stats = new_samples(spec), Stats()
    events = list(engine.run(spec, samples, stats, deadline))
    return samples, stats, events


@pytest.fixture(scope="module")
def local_pair(tiny_loaded):
    return LocalDrafter(tiny_loaded["draft"].runner), LocalVerifier(tiny_loaded["target"].runner)


def _one_hot(token: int) -> np.ndarray:
    row = np.zeros(V, np.float32)
    row[token] = 1.0
    return row


class FakeDrafter:
    """Proposes what `make(request)` returns: (tokens, probs)."""

    def __init__(self, make):
        self.make = make

    def propose(self, requests, sampling, deadline):
        return [DraftProposal(*self.make(r)) for r in requests]


class PointMassDrafter:
    """A model-free drafter: `make(request)` -> token ids, sent as point masses (no laws)."""

    def __init__(self, make):
        self.make = make

    def propose(self, requests, sampling, deadline):
        return [DraftProposal(self.make(r), None, point_mass=True) for r in requests]


class FakeVerifier:
    def __init__(self, make):
        self.make = make

    def verify(self, requests, sampling, deadline):
        return [VerifyResult(self.make(r)) for r in requests]


def _uniform_target(request):
    return np.full((len(request.draft_token_ids) + 1, V), 1 / V, np.float32)


# ------------------------------------------------------------------ with the tiny models


def test_greedy_speculation_emits_what_the_target_alone_emits(local_pair):
    drafter, verifier = local_pair
    alone, _, _ = _run(drafter, verifier, sampling=Sampling(0.0), num_speculative_tokens=0)
    for k in (1, 3):
        speculated, stats, _ = _run(drafter, verifier, sampling=Sampling(0.0), num_speculative_tokens=k)
        assert speculated[0].generated == alone[0].generated
        assert stats.drafted_tokens > 0


def test_greedy_output_with_auto_k_is_the_target_alone(local_pair):
    drafter, verifier = local_pair
    alone, _, _ = _run(drafter, verifier, sampling=Sampling(0.0), num_speculative_tokens=0, max_new_tokens=40)
    auto, stats, _ = _run(
        drafter, verifier, sampling=Sampling(0.0), num_speculative_tokens=4, auto_k=True, max_new_tokens=40
    )
    assert auto[0].generated == alone[0].generated
    # Round 0 drafts (start K = 2), round 1 measures a 1-row Verify: more than one K was used.
    assert stats.drafted_tokens >= 2 and stats.rounds > 2 and stats.drafted_tokens <= 4 * stats.rounds


def test_auto_k_rounds_follow_the_policy_and_a_sampled_run_is_lossless_per_round():
    """The K of each round is the policy's choice: start K, then 0, then the model's (<= K max)."""
    asked = []
    drafter = FakeDrafter(
        lambda r: (
            asked.append(r.num_draft_tokens) or [1] * r.num_draft_tokens,
            np.stack([_one_hot(1)] * r.num_draft_tokens),
        )
    )
    verifier = FakeVerifier(lambda r: np.stack([_one_hot(1)] * (len(r.draft_token_ids) + 1)))
    samples, stats, _ = _run(drafter, verifier, num_speculative_tokens=5, auto_k=True, max_new_tokens=60)
    assert samples[0].generated == [1] * 60
    assert asked[0] == 2 and max(asked) <= 5
    assert stats.rounds < 60 and stats.drafted_tokens > 2  # every draft accepted: it keeps drafting


def test_a_seeded_run_repeats_exactly(local_pair):
    first, _, _ = _run(*local_pair, seed=11)
    second, _, _ = _run(*local_pair, seed=11)
    assert first[0].generated == second[0].generated and len(first[0].generated) == 12


def test_stats_count_a_round_once_however_many_samples_run(local_pair):
    samples, stats, events = _run(*local_pair, num_samples=3)
    assert stats.rounds == len(events)
    assert stats.sample_rounds == sum(len(e.new_tokens) for e in events) > stats.rounds
    assert stats.emitted_tokens >= sum(len(s.generated) for s in samples)
    assert all(s.finish_reason == FINISH_LENGTH for s in samples)


def test_samples_run_on_their_own_cache_entries_and_sample_as_uncached_ones(tiny_loaded):
    """Each of several samples has its own KV-cache entry, so a round runs only its new tokens
    (no prefix recomputed); the tokens are those of the same seeded run without a cache."""
    drafter = LocalDrafter(tiny_loaded["draft"].runner)
    verifier = LocalVerifier(tiny_loaded["target"].runner)
    target_cache = tiny_loaded["target"].runner.cache
    keys: set[str] = set()

    class Recording:
        def verify(self, requests, sampling, deadline):
            keys.update(r.cache_key for r in requests)
            return verifier.verify(requests, sampling, deadline)

    hits, misses = target_cache.hits, target_cache.misses
    cached, stats, _ = _run(drafter, Recording(), num_samples=3, cache_key="req", seed=9)
    assert keys == {"req/0", "req/1", "req/2"}
    # One miss per sample (its first round); every later Verify of a sample reuses its entry.
    assert (target_cache.misses - misses, target_cache.hits - hits) == (3, stats.sample_rounds - 3)
    for key in keys:
        assert target_cache.token_ids(key) is not None
        target_cache.drop(key)
    uncached, _, _ = _run(drafter, verifier, num_samples=3, cache_key="", seed=9)
    assert [s.generated for s in cached] == [s.generated for s in uncached]


def test_a_passed_deadline_stops_an_in_process_call(local_pair):
    spec = GenerationSpec([1, 2, 3], 8, Sampling(1.0), seed=1, num_speculative_tokens=2)
    engine = SpeculativeEngine(*local_pair, _decode)
    with pytest.raises(DeadlineExceeded):
        list(engine.run(spec, new_samples(spec), Stats(), Deadline(time.monotonic() - 1)))


def test_a_drafter_may_propose_fewer_tokens_than_asked(local_pair):
    """Shorter proposals (none included) keep greedy output equal to the target's."""
    _, verifier = local_pair
    alone, _, _ = _run(*local_pair, sampling=Sampling(0.0), num_speculative_tokens=0)
    lengths = iter([0, 1, 2] * 20)

    def shorter(request):
        n = next(lengths)  # 0, 1 or 2 of the 3 asked for
        return [4] * n, np.stack([_one_hot(4)] * n) if n else np.empty((0, V), np.float32)

    short = FakeDrafter(shorter)
    speculated, stats, _ = _run(short, verifier, sampling=Sampling(0.0), num_speculative_tokens=3)
    assert speculated[0].generated == alone[0].generated
    assert stats.drafted_tokens < 3 * stats.rounds


def test_a_stop_string_cuts_the_sample_and_its_context():
    verifier = FakeVerifier(lambda r: np.stack([_one_hot(2)] * (len(r.draft_token_ids) + 1)))  # always "c"
    drafter = FakeDrafter(lambda r: ([2, 2], np.stack([_one_hot(2)] * 2)))
    samples, _, _ = _run(drafter, verifier, context_token_ids=[1], stop=("cc",), max_new_tokens=10)
    (sample,) = samples
    assert sample.finish_reason == FINISH_STOP and sample.stopped_text == ""
    assert sample.generated == [2, 2] and sample.context == [1, 2, 2]


# ------------------------------------------------------------------ pools that misbehave


def _assert_round_runs_at_k0(drafter, message, caplog):
    """A bad proposal is logged and dropped: the run is the K = 0 run, token for token (the
    fake target's law is the same whatever the rows, so even a draft dropped after its Verify
    gives round 0's K = 0 token), and the draft backs off after it."""
    verifier = FakeVerifier(_uniform_target)
    alone, _, _ = _run(drafter, verifier, num_speculative_tokens=0)
    health = DraftHealth(backoff_s=60)
    samples, stats, events = _run(drafter, verifier, health=health)
    assert samples[0].generated == alone[0].generated
    # Every round but the last, which has no room to draft (max_new_tokens) and so falls back from nothing.
    assert stats.draft_fallback_rounds == len(events) - 1 and stats.drafted_tokens == 0
    assert not health.healthy
    assert message in caplog.text


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda r: ([1] * (r.num_draft_tokens + 1), np.stack([_one_hot(1)] * (r.num_draft_tokens + 1))), "tokens"),
        (lambda r: ([1], np.stack([_one_hot(1)] * 2)), "tokens"),
        (lambda r: ([1], np.full((1, V), np.nan, np.float32)), "NaN"),
        (lambda r: ([1], np.full((1, V), -0.125, np.float32)), "negative"),
        (lambda r: ([1], np.full((1, V), 0.5, np.float32)), "sum to 1"),
        (lambda r: ([1], np.full((1, V + 1), 1 / (V + 1), np.float32)), "vocabulary size"),
        (lambda r: ([1], _one_hot(2)[None]), "with q = 0"),  # q(x) = 0 for its own token
        (lambda r: ([V], _one_hot(0)[None]), "outside the target's vocabulary"),
    ],
)
def test_a_bad_proposal_makes_the_round_target_only(make, message, caplog):
    _assert_round_runs_at_k0(FakeDrafter(make), message, caplog)


class FailingDrafter:
    """Raises `error` on its first `failures` calls, then drafts with `then` (if any)."""

    def __init__(self, error, failures=10**9, then=None):
        self.error, self.failures, self.then = error, failures, then
        self.calls = 0

    def propose(self, requests, sampling, deadline):
        self.calls += 1
        if self.calls <= self.failures:
            raise self.error
        return self.then.propose(requests, sampling, deadline)


@pytest.mark.parametrize(
    "error",
    [
        Unavailable("draft service: connection refused"),
        DeadlineExceeded("draft service: attempt timed out"),
        ServiceError("draft service: at capacity", "RESOURCE_EXHAUSTED"),
        ServiceError("draft service: bad proposal"),
    ],
    ids=["unavailable", "timeout", "exhausted", "internal"],
)
@pytest.mark.parametrize("sampling", [Sampling(0.0), Sampling(1.0)], ids=["T0", "T1"])
def test_a_failing_draft_gives_the_k0_output_exactly(local_pair, error, sampling):
    """Greedy and the seeded stream: a K = 0 round draws from the same accept stream."""
    _, verifier = local_pair
    alone, _, _ = _run(*local_pair, sampling=sampling, num_speculative_tokens=0, max_new_tokens=16)
    drafter, health = FailingDrafter(error), DraftHealth(backoff_s=60)
    samples, stats, events = _run(drafter, verifier, health=health, sampling=sampling, max_new_tokens=16)
    assert samples[0].generated == alone[0].generated and len(alone[0].generated) == 16
    assert stats.rounds == len(events) == 16
    assert stats.draft_fallback_rounds == health.fallback_rounds == 15  # the last round has no room to draft
    assert drafter.calls == 1  # then it backs off: no Propose per round


def test_speculation_resumes_when_the_draft_answers_after_its_back_off(local_pair):
    draft, verifier = local_pair
    now = [0.0]

    class Ticking:  # each Verify is one second
        def verify(self, requests, sampling, deadline):
            now[0] += 1.0
            return verifier.verify(requests, sampling, deadline)

    drafter = FailingDrafter(Unavailable("draft down"), failures=1, then=draft)
    health = DraftHealth(backoff_s=2.5, clock=lambda: now[0])
    alone, _, _ = _run(*local_pair, sampling=Sampling(0.0), num_speculative_tokens=0, max_new_tokens=24)
    samples, stats, _ = _run(drafter, Ticking(), health=health, sampling=Sampling(0.0), max_new_tokens=24)
    # Round 0 fails at t=0; rounds at t=1, 2 skip the draft; the round at t=3 probes and succeeds.
    assert stats.draft_fallback_rounds == 3 and drafter.calls > 2
    assert health.healthy and stats.drafted_tokens > 0
    assert samples[0].generated == alone[0].generated


def test_a_request_whose_own_deadline_passed_fails_and_does_not_blame_the_draft(local_pair):
    _, verifier = local_pair

    class Slow:
        def propose(self, requests, sampling, deadline):
            time.sleep(0.2)
            raise DeadlineExceeded("draft service: deadline exceeded")

    health = DraftHealth()
    with pytest.raises(DeadlineExceeded, match="the request's deadline passed"):
        _run(Slow(), verifier, health=health, deadline=Deadline(time.monotonic() + 0.1))
    assert health.healthy and health.fallback_rounds == 0


def test_the_hidden_state_relay_falls_back_too():
    """A draft that reads the target's hidden states: its Propose fails in round 1 (round 0 has no
    rows yet), and the run is the K = 0 run."""

    class HiddenVerifier(FakeVerifier):
        def verify(self, requests, sampling, deadline):
            results = super().verify(requests, sampling, deadline)
            rows = [len(r.prefix_token_ids) + len(r.draft_token_ids) - (r.hidden_from or 0) for r in requests]
            return [
                VerifyResult(v.target_probs, 0, np.zeros((n, 4), np.float16))
                for v, n in zip(results, rows, strict=True)
            ]

    verifier = HiddenVerifier(_uniform_target)
    alone, _, _ = _run(None, verifier, num_speculative_tokens=0)
    drafter = FailingDrafter(Unavailable("draft down"))
    samples, stats, events = _run(drafter, verifier, health=DraftHealth(), draft_needs_hidden=True)
    assert drafter.calls == 1
    assert samples[0].generated == alone[0].generated
    assert stats.draft_fallback_rounds == len(events) - 2  # not round 0 (no rows yet) nor the last (no room)


def test_auto_k_never_calls_a_draft_as_dear_as_the_target_nor_asks_for_hidden_states():
    """Curves (target, draft) by which no draft could pay: every round is K = 0 (the output is the
    K = 0 run's), the draft is never called and no Verify asks for hidden states."""
    asked_hidden = []

    class RecordingVerifier(FakeVerifier):
        def verify(self, requests, sampling, deadline):
            asked_hidden.extend(r.hidden_from for r in requests)
            return super().verify(requests, sampling, deadline)

    drafter = FailingDrafter(AssertionError("the draft was called"))
    alone, _, _ = _run(None, FakeVerifier(_uniform_target), num_speculative_tokens=0)
    curves = {"verify_costs": (5.5, 5.9, 6.0, 7.1), "draft_costs": (5.0, 7.0, 9.3)}
    samples, stats, _ = _run(
        drafter, RecordingVerifier(_uniform_target), auto_k=True, draft_needs_hidden=True, **curves
    )
    assert drafter.calls == 0 and stats.drafted_tokens == 0 and stats.draft_fallback_rounds == 0
    assert samples[0].generated == alone[0].generated
    assert asked_hidden and set(asked_hidden) == {None}


def test_auto_k_stops_calling_a_model_draft_the_engines_earlier_requests_showed_cannot_pay():
    """Cheap by its curve, but accepted 1/8 of the time (a one-hot q against a uniform target) and
    its calls as dear as a Verify: once the engine's record holds enough positions, an auto-K request
    never calls it, and its output is still the K = 0 run's."""
    from specdec.core.kpolicy import MIN_RECORDED_POSITIONS

    calls = []

    def draft(request):
        calls.append(request.num_draft_tokens)
        time.sleep(0.002)
        return [1] * request.num_draft_tokens, np.stack([_one_hot(1)] * request.num_draft_tokens)

    class SlowVerifier(FakeVerifier):
        def verify(self, requests, sampling, deadline):
            time.sleep(0.002)
            return super().verify(requests, sampling, deadline)

    engine = SpeculativeEngine(FakeDrafter(draft), SlowVerifier(_uniform_target), _decode)
    fields = dict(context_token_ids=[1, 2, 3], max_new_tokens=12, sampling=Sampling(1.0), seed=5)
    curves = {"verify_costs": (2.0, 2.2, 2.4, 2.6), "draft_costs": (0.1, 0.2, 0.3)}
    fixed = GenerationSpec(**fields, num_speculative_tokens=3, **curves)  # explicit K: drafts, recorded
    for _ in range(MIN_RECORDED_POSITIONS):  # each request examines 3 positions or more
        samples = new_samples(fixed)
        events = engine.run(fixed, samples, Stats(), NO_DEADLINE)
        while any(s.running for s in samples):  # as the coordinator: nothing asked past the last round
            next(events)
    assert engine.records[False].offered[1] >= MIN_RECORDED_POSITIONS
    auto = GenerationSpec(**fields, num_speculative_tokens=3, auto_k=True, **curves)
    calls.clear()
    samples, stats = new_samples(auto), Stats()
    list(engine.run(auto, samples, stats, NO_DEADLINE))
    alone, _, _ = _run(None, SlowVerifier(_uniform_target), **fields, num_speculative_tokens=0)
    assert calls == [] and stats.drafted_tokens == 0 and samples[0].generated == alone[0].generated
    fresh = SpeculativeEngine(FakeDrafter(draft), SlowVerifier(_uniform_target), _decode)
    list(fresh.run(auto, new_samples(auto), Stats(), NO_DEADLINE))
    assert calls  # without a record, the same request drafts


@pytest.mark.parametrize("draft_costs, lookup_only", [((5.0, 7.0, 9.3), True), ((), False)], ids=["dear", "no-curve"])
def test_auto_k_drafts_a_hybrid_by_its_lookup_alone_where_its_model_cannot_pay(draft_costs, lookup_only):
    """A hybrid draft (a lookup before its model) whose model is as dear as the target: auto K still
    drafts (the lookup costs nothing) but asks for the lookup alone, and no Verify asks for the
    hidden states only the model reads. Without a curve the model may serve, fed hidden states."""
    asked_hidden, asked_lookup_only = [], []

    class RecordingVerifier(FakeVerifier):
        def verify(self, requests, sampling, deadline):
            asked_hidden.extend(r.hidden_from for r in requests)
            results = super().verify(requests, sampling, deadline)
            rows = [len(r.prefix_token_ids) + len(r.draft_token_ids) - (r.hidden_from or 0) for r in requests]
            hidden = [np.zeros((n, 4), np.float16) for n in rows]
            return [VerifyResult(v.target_probs, 0, h) for v, h in zip(results, hidden, strict=True)]

    def lookup(request):
        asked_lookup_only.append(request.lookup_only)
        return [1, 2]

    curves = {"verify_costs": (5.5, 5.9, 6.0, 7.1), "draft_costs": draft_costs}
    flags = {"auto_k": True, "draft_needs_hidden": True, "draft_lookup": True}
    _, stats, _ = _run(PointMassDrafter(lookup), RecordingVerifier(_uniform_target), **flags, **curves)
    assert stats.drafted_tokens > 0 and set(asked_lookup_only) == {lookup_only}
    assert (set(asked_hidden) == {None}) == lookup_only


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda r: np.full((len(r.draft_token_ids), V), 1 / V, np.float32), "laws for K"),
        (lambda r: np.full((len(r.draft_token_ids) + 1, V), np.nan, np.float32), "NaN"),
        (lambda r: np.full((len(r.draft_token_ids) + 1, V), 1.0, np.float32), "sum to 1"),
    ],
)
def test_a_bad_verification_is_a_clear_error(make, message):
    drafter = FakeDrafter(lambda r: ([1], _one_hot(1)[None]))
    with pytest.raises(ServiceError, match=message):
        _run(drafter, FakeVerifier(make))


def test_a_pool_that_answers_for_the_wrong_number_of_sequences_is_an_error():
    class Dropping(FakeVerifier):
        def verify(self, requests, sampling, deadline):
            return super().verify(requests, sampling, deadline)[:-1]

    with pytest.raises(ServiceError, match="results for"):
        _run(FakeDrafter(lambda r: ([1], _one_hot(1)[None])), Dropping(_uniform_target))


# ------------------------------------------------------------------ point-mass (model-free) drafts


def test_point_mass_proposals_keep_greedy_output_equal_to_the_target_alone(local_pair):
    from specdec.core.ngram import ngram_proposal

    _, verifier = local_pair
    alone, _, _ = _run(*local_pair, sampling=Sampling(0.0), num_speculative_tokens=0, context_token_ids=[1, 2, 3, 1, 2])
    lookup = PointMassDrafter(lambda r: ngram_proposal(r.prefix_token_ids, r.num_draft_tokens, 1, 4))
    for k in (1, 3):
        speculated, stats, _ = _run(
            lookup, verifier, sampling=Sampling(0.0), num_speculative_tokens=k, context_token_ids=[1, 2, 3, 1, 2]
        )
        assert speculated[0].generated == alone[0].generated
        assert stats.drafted_tokens > 0


def test_a_point_mass_draft_is_accepted_with_probability_p_and_recovers_from_p_without_it():
    # The target always puts 1/2 on "c" (2) and 1/2 on "d" (3); the draft always proposes "c".
    law = np.zeros(V, np.float32)
    law[[2, 3]] = 0.5
    verifier = FakeVerifier(lambda r: np.stack([law] * (len(r.draft_token_ids) + 1)))
    samples, stats, _ = _run(PointMassDrafter(lambda r: [2] * r.num_draft_tokens), verifier, max_new_tokens=400)
    assert set(samples[0].generated) == {2, 3}
    # Of the drafts examined (those after a rejection never are), about half are accepted.
    examined = stats.accepted_tokens + stats.recovered_tokens
    assert stats.recovered_tokens > 50 and 0.4 < stats.accepted_tokens / examined < 0.6


@pytest.mark.parametrize(
    "tokens, message",
    [([V], "outside the target's vocabulary"), ([-1], "outside"), ([1] * 4, "point-mass tokens for K=3")],
)
def test_a_bad_point_mass_proposal_makes_the_round_target_only(tokens, message, caplog):
    _assert_round_runs_at_k0(PointMassDrafter(lambda r: tokens), message, caplog)


def test_a_verify_reports_its_step_to_the_k_policy_with_this_requests_rows_apart():
    from specdec.core.engine import _step_share
    from specdec.core.protocols import VerifyRequest

    requests = [VerifyRequest("a", [1, 2, 3, 4], [5, 6]), VerifyRequest("b", [1, 2, 3, 4], [5])]
    laws = np.full((3, V), 1 / V, dtype=np.float32)
    results = [VerifyResult(laws, 3, None, 9, 20), VerifyResult(laws[:2], 3, None, 9, 20)]
    # 9 sequences in the step, 2 of them ours; ours ran (6 - 3) + (5 - 3) new rows of its 20.
    assert _step_share(requests, results) == (7, 20, 5)
    alone = [VerifyResult(laws, 3), VerifyResult(laws[:2], 3)]  # a target that reports no step
    assert _step_share(requests, alone) == (0, 0, 0)


def test_the_k_policy_prices_a_verify_with_the_accept_reject_work_on_its_laws(monkeypatch):
    """Auto K weighs what a round's rows cost: the Verify call and the work on its laws, which grows
    with the drafted rows too; the stats keep reporting the call alone."""
    from specdec.core import engine as engine_module

    seen = []

    class Spy(engine_module.AdaptiveK):
        def observe(self, outcome):
            seen.append(outcome)
            super().observe(outcome)

    real = engine_module.speculative_round

    def slow(*args):
        time.sleep(0.02)
        return real(*args)

    monkeypatch.setattr(engine_module, "AdaptiveK", Spy)
    monkeypatch.setattr(engine_module, "speculative_round", slow)
    _, stats, _ = _run(PointMassDrafter(lambda r: [1] * r.num_draft_tokens), FakeVerifier(_uniform_target), auto_k=True)
    assert seen and all(outcome.verify_s >= 0.02 for outcome in seen)
    assert stats.verify_time_s < 0.01 * len(seen)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf, -1e-3])
def test_check_laws_refuses_nan_infinite_and_negative_entries(bad):
    laws = np.zeros((3, 64), np.float32)
    laws[:, 5] = 1.0
    check_laws("target", laws)  # one-hot rows pass
    laws[2, 9] = bad
    with pytest.raises(ServiceError, match="NaN, infinite or negative"):
        check_laws("target", laws)


def test_check_laws_refuses_rows_that_do_not_sum_to_one():
    laws = np.full((2, 64), 1 / 64, np.float32)
    check_laws("draft", laws)
    laws[1, 0] += 2e-4
    with pytest.raises(ServiceError, match="do not sum to 1"):
        check_laws("draft", laws)


# ------------------------------------------------------------------ decode steps (K = 0 stretches in one call)


class CountingVerifier:
    """The tiny target's LocalVerifier, recording per call `seen` of each sequence's request (by
    default its decode steps), and every result."""

    def __init__(self, verifier, seen=lambda request: len(request.decode_uniforms)):
        self.verifier, self.seen, self.calls, self.results = verifier, seen, [], []

    def verify(self, requests, sampling, deadline):
        self.calls.append([self.seen(r) for r in requests])
        self.results += (results := self.verifier.verify(requests, sampling, deadline))
        return results


@pytest.mark.parametrize(
    "sampling", [Sampling(1.0), Sampling(0.8, top_k=3, top_p=0.9), Sampling(0.0)], ids=["T1", "topk-topp", "greedy"]
)
@pytest.mark.parametrize("num_samples", [1, 3])
def test_decode_steps_give_the_tokens_of_one_call_a_round(local_pair, sampling, num_samples):
    """The target draws each step's token at the uniform the coordinator's own K = 0 round would
    draw: the same tokens, EOS and stop strings cutting where they cut, in fewer calls."""
    drafter, verifier = local_pair
    ended, calls, rounds, longest = set(), 0, 0, 0
    for seed in range(6):
        spec = dict(
            num_speculative_tokens=0, seed=seed, sampling=sampling, num_samples=num_samples, max_new_tokens=23
        )
        stops = dict(eos_token_ids=frozenset({3}), stop=("ca",)) if seed % 2 else {}
        one, one_stats, _ = _run(drafter, verifier, **spec, **stops)
        counted = CountingVerifier(verifier)
        steps, stats, events = _run(drafter, counted, **spec, **stops, decode_steps=4)
        assert [s.generated for s in steps] == [s.generated for s in one]
        assert [s.finish_reason for s in steps] == [s.finish_reason for s in one]
        assert stats.rounds == one_stats.rounds and stats.emitted_tokens == one_stats.emitted_tokens
        assert counted.calls[0] == [0] * num_samples  # the prompt's round: its first token alone
        calls, rounds = calls + len(counted.calls), rounds + one_stats.rounds
        longest = max(longest, *(max(c) for c in counted.calls))
        ended |= {s.finish_reason for s in one}
    assert longest == 4 and calls < rounds / 2.5
    if not sampling.greedy:
        assert ended > {FINISH_LENGTH}, ended  # EOS or a stop string came inside some stretch


def test_decode_steps_keep_the_seeded_stream_of_rounds_for_a_resumed_generation(local_pair):
    drafter, verifier = local_pair
    whole, _, _ = _run(drafter, verifier, num_speculative_tokens=0, max_new_tokens=14, decode_steps=4)
    spec = GenerationSpec([1, 2, 3], 14, Sampling(1.0), 5, 0, decode_steps=4)
    engine = SpeculativeEngine(drafter, verifier, _decode)
    samples, stats = new_samples(spec), Stats()
    events = engine.run(spec, samples, stats, NO_DEADLINE)
    first, second = next(events), next(events)  # the prompt's round, then rounds 1..4 in one call
    assert (first.round_index, second.round_index) == (0, 4)
    events.close()
    resumed = [replace(samples[0], context=list(samples[0].context), generated=list(samples[0].generated))]
    list(engine.run(spec, resumed, Stats(), NO_DEADLINE, first_round=second.round_index + 1))
    assert resumed[0].generated == whole[0].generated


def test_auto_k_plays_its_k0_rounds_until_the_next_probe_in_one_call(local_pair):
    """A drafter that never proposes: auto K settles at K = 0 and plays each stretch up to its next
    probe in one call, the probes still asking the draft; greedy output stays the target's."""
    _, verifier = local_pair
    asked = []
    drafter = PointMassDrafter(lambda r: asked.append(r.num_draft_tokens) or [])
    alone, _, _ = _run(drafter, verifier, sampling=Sampling(0.0), num_speculative_tokens=0, max_new_tokens=60)
    counted = CountingVerifier(verifier)
    auto, stats, _ = _run(
        drafter, counted, sampling=Sampling(0.0), num_speculative_tokens=4, auto_k=True, max_new_tokens=60,
        decode_steps=8,
    )
    assert auto[0].generated == alone[0].generated and stats.rounds == 60
    assert len(asked) >= 3  # round 0, then the probes
    # (How soon it settles depends on measured timings; that it does, and plays 8 rounds a call.)
    assert max(c[0] for c in counted.calls) == 8 and len(counted.calls) < 40


@pytest.mark.parametrize(
    "decoded, message",
    [((), "0 decoded tokens for 4"), ((1, 1, 1, 1, 1), "5 decoded tokens for 4"), ((1, 2), "2 decoded tokens for 4")],
)
def test_a_target_that_decodes_other_steps_than_asked_is_a_clear_error(decoded, message):
    def make(request):
        if request.decode_uniforms:
            return VerifyResult(np.empty((0, 0), np.float32), decoded_token_ids=decoded)
        return VerifyResult(np.stack([_one_hot(1)]))

    class Decoding(FakeVerifier):
        def verify(self, requests, sampling, deadline):
            return [make(r) for r in requests]

    with pytest.raises(ServiceError, match=message):
        _run(FakeDrafter(lambda r: ([], None)), Decoding(None), num_speculative_tokens=0, decode_steps=4)


def test_an_auto_k_request_leaves_what_its_decode_steps_cost_to_the_next(local_pair):
    _, verifier = local_pair
    drafter = PointMassDrafter(lambda r: [])
    engine = SpeculativeEngine(drafter, verifier, _decode)
    spec = GenerationSpec([1, 2, 3], 40, Sampling(0.0), 5, 4, auto_k=True, decode_steps=4)
    list(engine.run(spec, new_samples(spec), Stats(), NO_DEADLINE))
    assert engine.decode_record.ratio is not None and 0 < engine.decode_record.ratio <= 1


def test_only_decode_steps_step_on_without_waiting_for_company(monkeypatch):
    """The target's scheduler lets a call's later steps skip the wait for company only for decode
    steps (`StepScheduler.run(steps_on=...)`); a one-step Verify is unchanged."""
    import target_service.verifier as verifier_module
    from specdec.core.protocols import VerifyRequest

    asked = []

    class Recording:
        def run(self, tasks, deadline, prepare, steps_on=False):
            asked.append(steps_on)
            return [None] * len(tasks)

    monkeypatch.setattr(verifier_module, "scheduler_for", lambda runner: Recording())
    one, steps = VerifyRequest("a", [1, 2], []), VerifyRequest("b", [1, 2], [], decode_uniforms=(0.5, 0.5))
    verifier_module.verify_scheduled(None, [one], Sampling(1.0), NO_DEADLINE)
    verifier_module.verify_scheduled(None, [one, steps], Sampling(1.0), NO_DEADLINE)
    assert asked == [False, True]


def test_a_replica_without_decode_steps_answers_one_step_drawn_as_the_target_would():
    """Mid-rollout an older target replica ignores decode uniforms and returns the first step's law:
    the engine draws its token at the first uniform and goes on from the next round, so the
    tokens are still those of one call a round."""

    def law(request):  # a law that depends on the position, one row per verified token
        weights = np.arange(1, V + 1, dtype=np.float32)
        shifts = range(len(request.prefix_token_ids), len(request.prefix_token_ids) + len(request.draft_token_ids) + 1)
        return np.stack([np.roll(weights, shift) / weights.sum() for shift in shifts])

    one, _, _ = _run(None, FakeVerifier(law), num_speculative_tokens=0, max_new_tokens=10)
    older, stats, events = _run(None, FakeVerifier(law), num_speculative_tokens=0, max_new_tokens=10, decode_steps=4)
    assert older[0].generated == one[0].generated and stats.rounds == 10
    assert [e.round_index for e in events] == list(range(10))


# ------------------------------------------------------------------ a lookup without a match: decode steps until one


def _ngram_drafter():
    from specdec.core.lookup import NgramDrafter

    return NgramDrafter(2, 4)  # proposes exactly where the last 2 tokens occurred before


@pytest.mark.parametrize("sampling", [Sampling(1.0), Sampling(0.0)], ids=["T1", "greedy"])
def test_a_round_without_a_proposal_decodes_until_a_lookup_matches_with_the_same_tokens(local_pair, sampling):
    """A round whose lookup found nothing runs as decode steps that end where a lookup of 2 tokens
    matches; with an n-gram draft of 2..4 tokens that is exactly where it proposes again, so the
    tokens are those of a call a round, in fewer calls."""
    _, verifier = local_pair
    calls = rounds = stretched = 0
    for seed in range(6):
        spec = dict(
            context_token_ids=[1, 2, 3, 1, 2, 3, 1, 2], seed=seed, sampling=sampling, num_speculative_tokens=3,
            max_new_tokens=30, eos_token_ids=frozenset({3}) if seed % 2 else frozenset(),
        )
        one, one_stats, _ = _run(_ngram_drafter(), verifier, **spec)
        counted = CountingVerifier(verifier)
        steps, stats, events = _run(_ngram_drafter(), counted, **spec, decode_steps=4, stop_ngram=2)
        assert [s.generated for s in steps] == [s.generated for s in one]
        assert stats.rounds == one_stats.rounds and stats.drafted_tokens == one_stats.drafted_tokens
        calls, rounds = calls + len(counted.calls), rounds + one_stats.rounds
        stretched += sum(1 for c in counted.calls if c[0] > 1)
    assert stretched
    if not sampling.greedy:  # (greedy, the tiny target repeats itself: each stretch ends at once)
        assert calls < rounds


def test_without_stop_ngram_a_round_without_a_proposal_is_a_verify_of_its_own(local_pair):
    _, verifier = local_pair
    counted = CountingVerifier(verifier)
    _run(PointMassDrafter(lambda r: []), counted, num_speculative_tokens=3, max_new_tokens=12, decode_steps=4)
    assert all(c == [0] for c in counted.calls) and len(counted.calls) == 12


def test_the_policy_sees_an_empty_ask_then_decode_steps(local_pair, monkeypatch):
    _, verifier = local_pair
    seen = []
    real = FixedK.observe
    monkeypatch.setattr(FixedK, "observe", lambda self, outcome: seen.append(outcome) or real(self, outcome))
    _run(PointMassDrafter(lambda r: []), verifier, num_speculative_tokens=3, max_new_tokens=9, decode_steps=4,
         stop_ngram=5)  # (5 tokens never recur here: every stretch runs its 4 steps)
    assert [(o.k, o.decoded) for o in seen] == [(3, False)] + [(3, True), (0, True), (0, True), (0, True)] * 2
    assert all(o.draft_s == 0 for o in seen if o.k == 0)


@pytest.mark.parametrize(
    "decoded, accepted", [((4, 5), True), ((4, 6), False), ((4, 3), True)], ids=["match", "none", "eos"]
)
def test_a_stretch_may_end_early_only_at_a_lookup_match_or_a_stop_token(decoded, accepted):
    """Context 1 2 4 5: after 4 5 the last 2 tokens occurred before (a match); 4 6 is no match."""

    class Decoding(FakeVerifier):
        def verify(self, requests, sampling, deadline):
            return [
                VerifyResult(np.empty((0, 0), np.float32), decoded_token_ids=decoded[: len(r.decode_uniforms)])
                if r.decode_uniforms
                else VerifyResult(np.stack([_one_hot(4)] * (len(r.draft_token_ids) + 1)))
                for r in requests
            ]

    run = lambda: _run(  # noqa: E731
        PointMassDrafter(lambda r: []), Decoding(None), context_token_ids=[1, 4, 5, 2], num_speculative_tokens=2,
        max_new_tokens=4, decode_steps=4, stop_ngram=2, eos_token_ids=frozenset({3}),
    )
    if accepted:
        samples, _, _ = run()
        assert samples[0].generated[1:3] == list(decoded)
    else:
        with pytest.raises(ServiceError, match="2 decoded tokens for 3 decode steps"):
            run()


@pytest.mark.parametrize("stop_ngram, decode_steps, stretches", [(2, 4, True), (0, 4, False), (2, 1, False)])
def test_auto_k_knows_when_an_empty_ask_is_played_as_decode_steps(monkeypatch, stop_ngram, decode_steps, stretches):
    import specdec.core.engine as engine_module

    made = []
    monkeypatch.setattr(engine_module, "AdaptiveK", lambda *a, **kw: made.append(AdaptiveK(*a, **kw)) or made[-1])
    _run(PointMassDrafter(lambda r: []), FakeVerifier(_uniform_target), auto_k=True, max_new_tokens=2,
         decode_steps=decode_steps, stop_ngram=stop_ngram)
    assert made[0].stretches is stretches


# ------------------------------------------------------------------ rounds the target drafts by its own lookup


@pytest.mark.parametrize(
    "sampling", [Sampling(1.0), Sampling(0.8, top_k=3, top_p=0.9), Sampling(0.0)], ids=["T1", "topk-topp", "greedy"]
)
@pytest.mark.parametrize("num_samples", [1, 3])
def test_rounds_the_target_drafts_itself_give_the_tokens_of_the_engines_own_rounds(
    tiny_loaded, sampling, num_samples
):
    """The target drafts each round by the same n-gram lookup and plays it at the first K + 1
    uniforms of that round's stream, as this engine plays a round of point masses: the same tokens,
    rounds and counts (EOS and stop strings cutting where they cut), in fewer calls."""
    runner = tiny_loaded["target"].runner
    plain, own = LocalVerifier(runner), CountingVerifier(LocalVerifier(runner, _ngram_drafter()), lambda r: r.rounds)
    ended, calls, rounds, drafted = set(), 0, 0, 0
    for seed in range(6):
        spec = dict(
            context_token_ids=[1, 2, 3, 1, 2, 3, 1, 2], seed=seed, sampling=sampling, num_samples=num_samples,
            num_speculative_tokens=3, max_new_tokens=23,
        )
        stops = dict(eos_token_ids=frozenset({3}), stop=("ca",)) if seed % 2 else {}
        one, one_stats, _ = _run(_ngram_drafter(), plain, **spec, **stops)
        own.calls.clear()
        there, stats, events = _run(None, own, **spec, **stops, decode_steps=4, target_lookup=True)
        assert [s.generated for s in there] == [s.generated for s in one]
        assert [s.finish_reason for s in there] == [s.finish_reason for s in one]
        for field in ("rounds", "drafted_tokens", "accepted_tokens", "recovered_tokens", "bonus_tokens"):
            assert getattr(stats, field) == getattr(one_stats, field), field
        assert own.calls[0] == [1] * num_samples  # the prompt's round: its tokens go out at once
        calls, rounds, drafted = calls + len(own.calls), rounds + one_stats.rounds, drafted + stats.drafted_tokens
        ended |= {s.finish_reason for s in one}
    assert drafted and calls < rounds / 2
    if not sampling.greedy:
        assert ended > {FINISH_LENGTH}, ended  # EOS or a stop string came inside some call


@pytest.mark.parametrize("auto_k", [False, True])
@pytest.mark.parametrize("num_samples", [1, 3])
def test_a_target_without_a_lookup_refuses_its_rounds_and_the_request_goes_on_at_k0(
    tiny_loaded, caplog, auto_k, num_samples
):
    """A replica without SPECDEC_TARGET_LOOKUP (a pool mid-rollout) refuses the first call of rounds
    (NoTargetLookup, nothing run): that round is played again at K = 0 and so is the rest of the
    request, with the tokens a K = 0 request of the same seed gets (T = 1: the same uniforms)."""
    runner = tiny_loaded["target"].runner
    spec = dict(seed=7, num_samples=num_samples, max_new_tokens=20, decode_steps=4)
    alone, _, _ = _run(None, LocalVerifier(runner), **spec, num_speculative_tokens=0)
    counted = CountingVerifier(LocalVerifier(runner), lambda r: r.lookup_k)
    with caplog.at_level(logging.WARNING, logger="specdec.core.engine"):
        refused, stats, _ = _run(None, counted, **spec, target_lookup=True, auto_k=auto_k)
    assert [s.generated for s in refused] == [s.generated for s in alone]
    first, later = counted.calls[0], counted.calls[1:]
    assert first == [2 if auto_k else 3] * num_samples and later and all(k == 0 for call in later for k in call)
    assert stats.drafted_tokens == 0 and "runs at K = 0" in caplog.text


@pytest.mark.parametrize("auto_k", [False, True])
def test_auto_k_sends_its_acceptance_and_reads_the_rounds_a_shared_step_cut(tiny_loaded, monkeypatch, auto_k):
    """Auto K's calls of rounds carry c_1..c_K (`AdaptiveK.draft_acceptance`), an explicit K's none.
    A step that verifies none of a round's drafts (every cut taken here) leaves no drafted token in
    the stats, and the policy reads what the lookup proposed: reached, never examined."""
    import specdec.core.engine as engine_module
    from specdec.models import draft_rows

    made = []
    monkeypatch.setattr(engine_module, "AdaptiveK", lambda *a, **kw: made.append(AdaptiveK(*a, **kw)) or made[-1])
    monkeypatch.setattr(draft_rows.DraftRows, "trim", lambda self, items, rows: (
        [draft_rows._cut(item, len(item.gains)) for item in items], rows - sum(len(i.gains) for i in items)))
    lookup_target = LocalVerifier(tiny_loaded["target"].runner, _ngram_drafter())
    recorder = CountingVerifier(lookup_target, lambda r: (r.lookup_k, r.lookup_acceptance))
    spec = dict(context_token_ids=[1, 2, 3, 1, 2, 3, 1, 2], seed=3, max_new_tokens=40, decode_steps=4)
    _, stats, _ = _run(None, recorder, **spec, target_lookup=True, auto_k=auto_k)
    sent = [acceptance for call in recorder.calls for k, acceptance in call if k]
    proposed = sum(sum(r.round_proposed) for r in recorder.results)
    if not auto_k:
        assert sent and all(a == () for a in sent) and stats.drafted_tokens > 0 and proposed == 0
        return
    assert sent and all(len(a) > 0 and all(0 < c < 1 for c in a) for a in sent)
    assert stats.drafted_tokens == 0 and proposed > 0
    policy = made[0]
    assert policy.reached[1] > 0 and policy.accepted[1] == 0


def _lookup_target(rounds, tokens, seconds=()):
    """A target that answers lookup calls with `rounds` and `tokens` (and `seconds`: their
    round_seconds), the prompt's (one round) with a decode step of token 1."""

    class Rounds(FakeVerifier):
        def verify(self, requests, sampling, deadline):
            no_laws = np.empty((0, 0), np.float32)
            return [
                VerifyResult(no_laws, decoded_token_ids=(1,), round_drafts=((0, 0),))
                if r.rounds == 1
                else VerifyResult(no_laws, decoded_token_ids=tokens, round_drafts=rounds, round_seconds=seconds)
                for r in requests
            ]

    return Rounds(None)


@pytest.mark.parametrize(
    "rounds, tokens, ok",
    [
        (((2, 2), (0, 0)), (4, 4, 4, 5), True),  # all accepted + bonus, then a decode step
        (((3, 1),), (4, 5), False),  # a round stopped short without a stop token
        (((3, 1), (0, 0)), (4, 6), False),  # 2 + 1 tokens, not 2
        (((4, 1),), (4, 5), False),  # more drafts than K
        (((2, 3),), (4, 5, 6, 7), False),  # more accepted than drafted
        (((3, 1),), (4, 3), True),  # a stop token: an early end
        (((3, 3), (3, 3)), (4,) * 8, False),  # past max_tokens
    ],
)
def test_a_target_whose_lookup_rounds_do_not_add_up_is_a_clear_error(rounds, tokens, ok):
    run = lambda: _run(  # noqa: E731
        None, _lookup_target(rounds, tokens), num_speculative_tokens=3, max_new_tokens=5, decode_steps=2,
        target_lookup=True, eos_token_ids=frozenset({3}), sampling=Sampling(0.0),
    )
    if not ok:
        with pytest.raises(ServiceError, match="target (returned rounds|played)"):
            run()
        return
    samples, stats, _ = run()
    assert samples[0].generated[1 : 1 + len(tokens)] == list(tokens)
    assert stats.drafted_tokens == sum(d for d, _ in rounds) and stats.accepted_tokens == sum(a for _, a in rounds)


@pytest.mark.parametrize(
    "proposed, acceptance, seconds, ok",
    [
        ((3, 0), (0.5,) * 3, (), True),  # the first round's 3 proposed, 2 verified
        ((3, 0), (), (), False),  # an explicit K's rounds are never cut
        ((1, 0), (0.5,) * 3, (), False),  # fewer proposed than verified
        ((4, 0), (0.5,) * 3, (), False),  # more than K
        ((3,), (0.5,) * 3, (), False),  # not one a round
        ((), (), (0.004, 0.001), True),  # each round's seconds in the target
        ((), (), (0.0, 0.0), True),
        ((), (), (0.004,), False),  # not one a round
        ((), (), (0.004, -0.001), False),
        ((), (), (0.004, float("inf")), False),
        ((), (), (0.004, float("nan")), False),
    ],
)
def test_what_a_lookup_call_reports_of_its_rounds_is_checked(proposed, acceptance, seconds, ok):
    """What a shared step cut (`round_proposed`: only under auto K, within K) and each round's
    seconds (`round_seconds`: finite, one a round)."""
    spec = GenerationSpec([1, 2, 3], 12, Sampling(0.0), 5, 3)
    request = VerifyRequest("k", [1, 2, 3], [], decode_uniforms=(0.5,) * 8, lookup_k=3, lookup_acceptance=acceptance)
    rounds = dict(decoded_token_ids=(4, 4, 4, 5), round_drafts=((2, 2), (0, 0)))
    result = VerifyResult(np.empty((0, 0), np.float32), **rounds, round_proposed=proposed, round_seconds=seconds)
    if ok:
        assert [drafted for drafted, _ in _lookup_rounds(spec, result, request)] == [2, 0]
    else:
        with pytest.raises(ServiceError, match="target returned rounds"):
            _lookup_rounds(spec, result, request)


@pytest.mark.parametrize(
    "seconds, ratio",
    [
        ((), 2.0),  # by the start-up curve: 3 rows against 1
        ((0.006, 0.002, 0.006), 3.0),  # by each round's seconds in the target (`round_seconds`)
    ],
)
def test_the_policy_sees_each_lookup_round_with_its_rows_and_a_share_of_the_call(monkeypatch, seconds, ratio):
    seen = []
    real = FixedK.observe
    monkeypatch.setattr(FixedK, "observe", lambda self, outcome: seen.append(outcome) or real(self, outcome))
    rounds, tokens = ((2, 2), (0, 0), (2, 0)), (4, 4, 4, 5, 6)
    _run(None, _lookup_target(rounds, tokens, seconds), num_speculative_tokens=3, max_new_tokens=6, decode_steps=3,
         target_lookup=True, sampling=Sampling(0.0), verify_costs=(1.0, 1.5, 2.0, 2.5))
    lookup = seen[1:4]  # (round 0: the prompt's call, one round)
    assert [(o.k, o.rows, list(o.drafts), o.draft_s, o.decoded) for o in lookup] == [
        (3, 3, [(2, 2)], 0.0, False), (3, 1, [(0, 0)], 0.0, False), (3, 3, [(2, 0)], 0.0, False)
    ]
    assert lookup[0].verify_s / lookup[1].verify_s == pytest.approx(ratio)
    assert lookup[2].verify_s == pytest.approx(lookup[0].verify_s)


def test_rounds_the_target_drafted_leave_the_engines_decode_record_alone(tiny_loaded):
    """Their one-row rounds are shares of a call, not Verifies of their own: what the DecodeRecord
    compares decode steps against."""
    engine = SpeculativeEngine(None, LocalVerifier(tiny_loaded["target"].runner, _ngram_drafter()), _decode)
    spec = GenerationSpec(
        [1, 2, 3, 1, 2, 3, 1, 2], 60, Sampling(1.0), 5, 4, auto_k=True, decode_steps=4, target_lookup=True
    )
    stats = Stats()
    list(engine.run(spec, new_samples(spec), stats, NO_DEADLINE))
    assert stats.drafted_tokens and engine.decode_record.ratio is None


def test_the_target_times_each_round_it_drafts_and_no_decode_step(tiny_loaded):
    verifier = LocalVerifier(tiny_loaded["target"].runner, _ngram_drafter())
    drafting = VerifyRequest("timed", [1, 2, 3, 1, 2, 3, 1, 2], [], decode_uniforms=(0.5,) * 16, lookup_k=3)
    decoding = VerifyRequest("untimed", [1, 2, 3], [], decode_uniforms=(0.5,) * 4)
    started = time.perf_counter()
    timed, untimed = verifier.verify([drafting, decoding], Sampling(0.0), NO_DEADLINE)
    assert len(timed.round_seconds) == len(timed.round_drafts) == 4 and min(timed.round_seconds) > 0
    assert sum(timed.round_seconds) <= time.perf_counter() - started  # each round's own time, in turn
    assert untimed.round_seconds == ()


def test_the_target_indexes_a_drafting_prefix_on_the_calling_thread_before_its_rounds(tiny_loaded):
    """A suffix draft's indexing of a new prompt (~40 us a token) stays off the model thread."""
    import threading

    from specdec.core.protocols import VerifyRequest

    class Recording:
        def __init__(self):
            self.lookup, self.calls = _ngram_drafter(), []

        def propose(self, requests, sampling, deadline):
            thread = threading.current_thread().name
            self.calls += [(thread, r.num_draft_tokens, len(r.prefix_token_ids)) for r in requests]
            return self.lookup.propose(requests, sampling, deadline)

    lookup = Recording()
    request = VerifyRequest("indexed", [1, 2, 3, 1, 2], [], decode_uniforms=(0.5,) * 8, lookup_k=3)
    LocalVerifier(tiny_loaded["target"].runner, lookup).verify([request], Sampling(0.0), NO_DEADLINE)
    assert lookup.calls[0] == (threading.current_thread().name, 0, 5)
    assert all(name != threading.current_thread().name for name, k, _ in lookup.calls[1:] if k)
