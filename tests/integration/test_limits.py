"""Bounded work per request, through the real gRPC services: the coordinator's limits, key
lengths at the model services, model calls whose caller has gone, and laws a pool returns."""

from __future__ import annotations

import threading
import time
from concurrent import futures

import grpc
import numpy as np
import pytest
from service_stack import start_stack, stop_stack

from specdec.client import build_request
from specdec.core.errors import NoTargetLookup
from specdec.core.protocols import NO_DEADLINE, VerifyRequest
from specdec.core.sampling import Sampling
from specdec.core.ngram import lookup_matches
from specdec.rpc.clients import TargetClient
from specdec.rpc.errors import REASON_KEY
from specdec.rpc.wire import decode_probs, encode_probs
from specdec.v1 import (
    common_pb2,
    coordinator_pb2,
    coordinator_pb2_grpc,
    draft_pb2,
    draft_pb2_grpc,
    target_pb2,
    target_pb2_grpc,
)

INVALID = grpc.StatusCode.INVALID_ARGUMENT


def _refused(stub, request, *named: str) -> None:
    """Generate and GenerateStream both answer INVALID_ARGUMENT, naming each of `named`."""
    for call in (stub.Generate, lambda r, timeout: list(stub.GenerateStream(r, timeout=timeout))):
        with pytest.raises(grpc.RpcError) as err:
            call(request, timeout=60)
        assert err.value.code() == INVALID, err.value.details()
        for name in named:
            assert name in err.value.details(), err.value.details()


# ---------------------------------------------------------------- coordinator limits


def test_an_8_mb_prompt_is_refused_naming_the_limit_and_its_setting(coordinator_stub):
    _refused(
        coordinator_stub,
        build_request("a " * (4 << 20), max_new_tokens=2),
        "max_prompt_bytes",
        "SPECDEC_COORDINATOR_MAX_PROMPT_BYTES",
        str(8 << 20),
    )
    # Token ids count 4 bytes each against the same limit: 1 MiB / 4 + 1 of them is over it.
    _refused(coordinator_stub, build_request([1] * ((1 << 18) + 1), max_new_tokens=2), "max_prompt_bytes")


def test_stop_strings_are_limited_in_number_and_length(coordinator_stub):
    _refused(coordinator_stub, build_request([1], stop=["x"] * 17, max_new_tokens=2), "max_stop_strings")
    _refused(coordinator_stub, build_request([1], stop=["é" * 129], max_new_tokens=2), "max_stop_bytes", "258")
    ok = coordinator_stub.Generate(build_request([1], stop=["x" * 256] * 16, max_new_tokens=2), timeout=60)
    assert ok.completions


def test_the_work_of_samples_times_context_and_new_tokens_is_limited(coordinator_stub):
    # 300 x (1 + 1000) = 300,300 tokens, over the default 262,144 (this stack allows 20,000 samples).
    request = build_request([1], num_samples=300, max_new_tokens=1000)
    with pytest.raises(grpc.RpcError) as err:
        coordinator_stub.Generate(request, timeout=60)
    assert err.value.code() == INVALID
    assert (
        "max_request_tokens" in err.value.details() and "SPECDEC_COORDINATOR_MAX_REQUEST_TOKENS" in err.value.details()
    )


def test_a_text_prompt_counts_its_tokens_once_tokenised(tiny_loaded, tiny_model_dirs, redis_url):
    stack = start_stack(tiny_loaded, tiny_model_dirs["target"], redis_url, max_request_tokens=10)
    try:
        with stack.channel() as channel:
            stub = coordinator_pb2_grpc.CoordinatorStub(channel)
            assert stub.Generate(build_request("a b c", max_new_tokens=7), timeout=60).completions  # 3 + 7
            with pytest.raises(grpc.RpcError) as err:
                stub.Generate(build_request("a b c d", max_new_tokens=7), timeout=60)  # 4 + 7
            assert err.value.code() == INVALID and "max_request_tokens" in err.value.details()
    finally:
        stop_stack(stack)


def test_only_session_ids_the_coordinator_issues_are_accepted(coordinator_stub, tiny_stack, redis_client):
    created = coordinator_stub.Generate(build_request([1, 2], max_new_tokens=3, temperature=0, ignore_eos=True))
    session_id = created.session_id
    key = f"{tiny_stack.settings.session_key_prefix}:session:{session_id}"
    before = redis_client.hgetall(key)
    for bad in (session_id + ":lock", session_id.upper(), session_id[:-1], "x" * (20 << 20)):
        for call, request in (
            (coordinator_stub.DeleteSession, coordinator_pb2.DeleteSessionRequest(session_id=bad)),
            (coordinator_stub.GetSession, coordinator_pb2.GetSessionRequest(session_id=bad)),
            (coordinator_stub.Generate, build_request([1], session_id=bad, max_new_tokens=2)),
        ):
            with pytest.raises(grpc.RpcError) as err:
                call(request, timeout=60)
            assert err.value.code() == INVALID, err.value.details()
            assert len(err.value.details()) < 300  # the id is not echoed
    assert redis_client.hgetall(key) == before
    assert coordinator_stub.DeleteSession(coordinator_pb2.DeleteSessionRequest(session_id=session_id)).deleted


# ---------------------------------------------------------------- key lengths at the model services


def _propose(**fields) -> draft_pb2.ProposeRequest:
    return draft_pb2.ProposeRequest(
        sequences=[draft_pb2.DraftSequence(prefix_token_ids=[1, 2], num_draft_tokens=2, seed=1, **fields)]
    )


def _verify(**fields) -> target_pb2.VerifyRequest:
    return target_pb2.VerifyRequest(sequences=[target_pb2.VerifySequence(prefix_token_ids=[1, 2], **fields)])


def test_model_services_refuse_cache_keys_over_128_bytes(tiny_stack):
    with grpc.insecure_channel(tiny_stack.draft_address) as d, grpc.insecure_channel(tiny_stack.target_address) as t:
        draft, target = draft_pb2_grpc.DraftServiceStub(d), target_pb2_grpc.TargetServiceStub(t)
        assert draft.Propose(_propose(cache_key="k" * 128, hidden_states_key="h" * 128), timeout=30).proposals
        assert target.Verify(_verify(cache_key="k" * 128), timeout=30).verifications
        cases = [
            (draft.Propose, _propose(cache_key="k" * 129), "cache_key"),
            (draft.Propose, _propose(cache_key="é" * 65), "cache_key"),  # 130 bytes
            (draft.Propose, _propose(hidden_states_key="h" * 129), "hidden_states_key"),
            (draft.Propose, _propose(cache_key="k" * (20 << 20)), "cache_key"),
            (target.Verify, _verify(cache_key="k" * 129), "cache_key"),
            (target.Verify, _verify(cache_key="k" * (20 << 20)), "cache_key"),
        ]
        for call, request, field in cases:
            with pytest.raises(grpc.RpcError) as err:
                call(request, timeout=30)
            assert err.value.code() == INVALID and field in err.value.details() and "128" in err.value.details()


def test_the_target_runs_decode_steps_and_refuses_those_it_cannot_run_storing_nothing(tiny_stack, tiny_loaded):
    cache = tiny_loaded["target"].runner.cache
    with grpc.insecure_channel(tiny_stack.target_address) as channel:
        target = target_pb2_grpc.TargetServiceStub(channel)
        (done,) = target.Verify(_verify(cache_key="steps-ok", decode_uniforms=[0.5] * 5), timeout=30).verifications
        assert len(done.decoded_token_ids) == 5 and not done.HasField("target_probs")
        assert cache.token_ids("steps-ok")[:2] == [1, 2]
        # With stop_ngram the steps end after the first token whose last n tokens occurred before.
        prefix, uniforms = [5, 6, 7, 5, 6], [0.1, 0.9, 0.3, 0.7, 0.5, 0.2, 0.8, 0.4, 0.6, 0.05, 0.95, 0.35]
        stopped = []
        for n in (1, 2):
            sequence = target_pb2.VerifySequence(
                cache_key=f"steps-ngram-{n}", prefix_token_ids=prefix, decode_uniforms=uniforms, stop_ngram=n
            )
            request = target_pb2.VerifyRequest(sequences=[sequence])
            tokens = list(target.Verify(request, timeout=30).verifications[0].decoded_token_ids)
            ends = [lookup_matches(prefix + tokens[: i + 1], n) for i in range(len(tokens))]
            assert not any(ends[:-1]) and (ends[-1] or len(tokens) == len(uniforms)), (n, tokens)
            stopped.append(len(tokens) < len(uniforms))
        assert any(stopped)  # (1-grams recur within a few tokens of the tiny model's vocabulary)
        cases = [
            (dict(draft_token_ids=[3]), "without draft tokens"),
            (dict(hidden_states_from=0), "hidden states"),
            (dict(decode_uniforms=[0.5] * 65), "at most 64 rounds"),
            (dict(decode_uniforms=[0.2, 1.0]), "[0, 1)"),
            (dict(decode_uniforms=[-0.1]), "[0, 1)"),
            (dict(decode_uniforms=[float("nan")]), "[0, 1)"),
            (dict(decode_uniforms=[0.5], stop_token_ids=[8]), "stop_token_ids"),
            (dict(decode_uniforms=[0.5] * 64), "positions"),  # 2 + 63 > the tiny model's 64
            (dict(stop_ngram=65), "stop_ngram must be in [0, 64]"),
            (dict(decode_uniforms=[], stop_ngram=2), "go with decode_uniforms"),
            (dict(decode_uniforms=[], max_tokens=2), "go with decode_uniforms"),
            (dict(decode_uniforms=[], lookup_acceptance=[0.5]), "go with decode_uniforms"),
            (dict(decode_uniforms=[0.5] * 6, lookup_k=3), "lookup_k + 1 = 4 a round"),  # (bad for any target)
        ]
        for fields, named in cases:
            with pytest.raises(grpc.RpcError) as err:
                target.Verify(_verify(cache_key="steps-bad", **({"decode_uniforms": [0.5]} | fields)), timeout=30)
            assert err.value.code() == INVALID and named in err.value.details(), (fields, err.value.details())
        # Rounds this target cannot draft (it has no lookup): a valid call for another replica.
        with pytest.raises(grpc.RpcError) as err:
            target.Verify(_verify(cache_key="steps-bad", decode_uniforms=[0.5] * 4, lookup_k=3), timeout=30)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "SPECDEC_TARGET_LOOKUP" in err.value.details()
        assert (REASON_KEY, NoTargetLookup.reason) in err.value.trailing_metadata()
        client = TargetClient(tiny_stack.target_address, 30, 10, 64)  # (what the coordinator's engine catches)
        try:
            with pytest.raises(NoTargetLookup):
                request = VerifyRequest("steps-bad", [1, 2], [], decode_uniforms=(0.5,) * 4, lookup_k=3)
                client.verify([request], Sampling(), NO_DEADLINE)
        finally:
            client.close()
        assert cache.token_ids("steps-bad") is None


def test_a_target_with_a_lookup_plays_drafted_rounds_and_refuses_those_it_cannot_run(tiny_loaded):
    """SPECDEC_TARGET_LOOKUP=ngram: Info names it; a call of rounds at lookup_k drafts from the
    sequence itself (5 6 recurs: 7 5 6 ... proposed), its counts add up to its tokens, within
    max_tokens; bad rounds are INVALID_ARGUMENT and store nothing."""
    from specdec.settings import load_settings
    from target_service.server import create_server
    from target_service.settings import TargetSettings

    settings = load_settings(TargetSettings, [], {}, host="127.0.0.1", port=0, metrics_port=-1, lookup="ngram")
    server, port = create_server(settings, tiny_loaded["target"])
    cache = tiny_loaded["target"].runner.cache
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            target = target_pb2_grpc.TargetServiceStub(channel)
            assert target.Info(common_pb2.InfoRequest(), timeout=30).lookup == "ngram"
            assert tiny_loaded["target"].info.lookup == ""  # (its own copy: the shared model's is unchanged)
            uniforms = [0.1, 0.9, 0.3, 0.7, 0.5, 0.2, 0.8, 0.4, 0.6, 0.05, 0.95, 0.35, 0.15, 0.45, 0.75, 0.25]
            for max_tokens in (0, 5):
                sequence = target_pb2.VerifySequence(
                    cache_key=f"lookup-{max_tokens}", prefix_token_ids=[5, 6, 7, 5, 6], decode_uniforms=uniforms,
                    lookup_k=3, max_tokens=max_tokens,
                )
                (done,) = target.Verify(target_pb2.VerifyRequest(sequences=[sequence]), timeout=30).verifications
                rounds = list(zip(done.round_drafted, done.round_accepted))
                assert 1 <= len(rounds) <= 4 and rounds[0][0] == 3 and all(0 <= a <= d <= 3 for d, a in rounds)
                assert sum(a + 1 for _, a in rounds) == len(done.decoded_token_ids) <= (max_tokens or 16)
                assert not done.HasField("target_probs")
            cases = [
                (dict(decode_uniforms=[0.5] * 6, lookup_k=3), "lookup_k + 1 = 4 a round"),
                (dict(decode_uniforms=[0.5] * 34, lookup_k=33), "lookup_k must be in [0, 32]"),
                (dict(decode_uniforms=[0.5] * 65 * 2, lookup_k=1), "at most 64 rounds"),
                (dict(decode_uniforms=[0.5] * 64, lookup_k=1), "positions"),  # 2 + 64 tokens > 64
                (dict(decode_uniforms=[0.5] * 64, lookup_k=1, max_tokens=70), "positions"),
                (dict(decode_uniforms=[0.5] * 8, lookup_k=3, lookup_acceptance=[0.5] * 2), "lookup_acceptance"),
                (dict(decode_uniforms=[0.5] * 8, lookup_k=3, lookup_acceptance=[0.5, 1.5, 0.5]), "lookup_acceptance"),
                (dict(decode_uniforms=[0.5] * 4, lookup_k=3, lookup_acceptance=[float("nan")] * 3), "[0, 1]"),
            ]
            for fields, named in cases:
                with pytest.raises(grpc.RpcError) as err:
                    target.Verify(_verify(cache_key="lookup-bad", **fields), timeout=30)
                assert err.value.code() == INVALID and named in err.value.details(), (fields, err.value.details())
            assert cache.token_ids("lookup-bad") is None
            small = _verify(cache_key="lookup-small", decode_uniforms=[0.5] * 64, lookup_k=1, max_tokens=8)
            assert len(target.Verify(small, timeout=30).verifications[0].decoded_token_ids) <= 8
            auto = dict(decode_uniforms=[0.5] * 8, lookup_k=3, lookup_acceptance=[0.5] * 3)
            weighed = _verify(cache_key="lookup-auto", **auto)
            (done,) = target.Verify(weighed, timeout=30).verifications
            assert done.decoded_token_ids and len(done.round_proposed) in (0, len(done.round_drafted))
            assert len(done.round_seconds) == len(done.round_drafted) and min(done.round_seconds) > 0
    finally:
        server.server.stop(0).wait(10)


# ---------------------------------------------------------------- work whose caller has gone


def _counting(monkeypatch, runner, delay_s: float = 0.0) -> list[int]:
    """Count (and optionally slow down) the runner's forwards: one entry per call."""
    calls: list[int] = []
    for name in ("last_logits", "batch_forward"):
        real = getattr(runner, name)

        def counted(*args, _real=real, **kwargs):
            calls.append(1)
            time.sleep(delay_s)
            return _real(*args, **kwargs)

        monkeypatch.setattr(runner, name, counted)
    return calls


def _model_thread_idle(runner) -> None:
    runner.on_model_thread(lambda: None)  # FIFO: everything queued before has run


def test_a_verify_whose_deadline_passes_in_the_queue_runs_no_forward(tiny_stack, tiny_loaded, monkeypatch):
    runner = tiny_loaded["target"].runner
    forwards = _counting(monkeypatch, runner)
    with grpc.insecure_channel(tiny_stack.target_address) as channel:
        target = target_pb2_grpc.TargetServiceStub(channel)
        slow = threading.Thread(target=runner.on_model_thread, args=(time.sleep, 1.5))
        slow.start()
        time.sleep(0.1)  # the slow call holds the model thread
        with pytest.raises(grpc.RpcError) as err:
            target.Verify(_verify(cache_key="q" * 32, draft_token_ids=[3]), timeout=0.3)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        waiting = target.Verify.future(_verify(cache_key="w" * 32, draft_token_ids=[3]), timeout=30)
        slow.join()
        _model_thread_idle(runner)
        assert waiting.result().verifications  # the call with time left ran after the slow one
    assert len(forwards) == 1  # its forward only: the expired call ran none


def test_a_cancelled_propose_stops_between_draft_steps(tiny_stack, tiny_loaded, monkeypatch):
    runner = tiny_loaded["draft"].runner
    steps = _counting(monkeypatch, runner, delay_s=0.1)
    with grpc.insecure_channel(tiny_stack.draft_address) as channel:
        draft = draft_pb2_grpc.DraftServiceStub(channel)
        request = draft_pb2.ProposeRequest(
            sequences=[draft_pb2.DraftSequence(cache_key="c" * 32, prefix_token_ids=[1, 2], num_draft_tokens=30)]
        )
        call = draft.Propose.future(request, timeout=60)
        time.sleep(0.5)
        call.cancel()
        _model_thread_idle(runner)
        assert call.cancelled()
    assert 1 <= len(steps) < 15, len(steps)  # 30 steps of 0.1 s uncancelled


def test_a_propose_past_its_deadline_stops_between_draft_steps(tiny_stack, tiny_loaded, monkeypatch):
    runner = tiny_loaded["draft"].runner
    steps = _counting(monkeypatch, runner, delay_s=0.1)
    with grpc.insecure_channel(tiny_stack.draft_address) as channel:
        draft = draft_pb2_grpc.DraftServiceStub(channel)
        sequences = [draft_pb2.DraftSequence(prefix_token_ids=[1, 2], num_draft_tokens=30, seed=s) for s in (1, 2)]
        with pytest.raises(grpc.RpcError) as err:
            draft.Propose(draft_pb2.ProposeRequest(sequences=sequences), timeout=0.5)  # the batched path
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        _model_thread_idle(runner)
    assert 1 <= len(steps) < 15, len(steps)


# ---------------------------------------------------------------- laws a pool returns


class _CorruptingTarget(target_pb2_grpc.TargetServiceServicer):
    """A real target whose laws can be corrupted on the way out (a broken replica)."""

    def __init__(self, real):
        self.real = real
        self.corrupt = None  # [rows, V] float32 -> what is sent instead

    def Info(self, request, context):
        return self.real.Info(request, context)

    def Verify(self, request, context):
        response = self.real.Verify(request, context)
        if self.corrupt is not None:
            for verification in response.verifications:
                laws = self.corrupt(np.array(decode_probs(verification.target_probs)))
                verification.target_probs.CopyFrom(encode_probs(laws, allow_sparse=False))
        return response


@pytest.fixture()
def corrupting_stack(tiny_loaded, tiny_model_dirs, redis_url):
    from specdec.settings import load_settings
    from target_service.server import TargetServicer
    from target_service.settings import TargetSettings

    real = TargetServicer(load_settings(TargetSettings, [], {}))
    real.attach(tiny_loaded["target"])
    fake = _CorruptingTarget(real)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    target_pb2_grpc.add_TargetServiceServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    stack = start_stack(tiny_loaded, tiny_model_dirs["target"], redis_url, target_address=f"127.0.0.1:{port}")
    yield stack, fake
    stop_stack(stack)
    server.stop(0).wait(10)


def _nan(laws):
    laws[:, 0] = np.nan
    return laws


@pytest.mark.parametrize(
    "corrupt, named",
    [
        (_nan, "NaN"),
        (lambda laws: laws * np.float32(0.5), "sum to 1"),
        (lambda laws: -laws, "negative"),
        (lambda laws: laws.reshape(-1), "target_probs has shape"),
    ],
    ids=["nan", "half", "negative", "flat"],
)
def test_bad_laws_from_the_target_fail_the_call_and_store_nothing(corrupting_stack, redis_client, corrupt, named):
    stack, fake = corrupting_stack
    with stack.channel() as channel:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        request = build_request([1, 2], max_new_tokens=3, num_speculative_tokens=2, ignore_eos=True, seed=1)
        created = stub.Generate(request, timeout=60)
        key = f"{stack.settings.session_key_prefix}:session:{created.session_id}"
        before = redis_client.hgetall(key)
        fake.corrupt = corrupt
        for call in (stub.Generate, lambda r, timeout: list(stub.GenerateStream(r, timeout=timeout))):
            with pytest.raises(grpc.RpcError) as err:
                call(build_request([3], session_id=created.session_id, max_new_tokens=4, seed=2), timeout=60)
            assert err.value.code() == grpc.StatusCode.INTERNAL
            assert "target" in err.value.details() and named in err.value.details(), err.value.details()
            assert "Traceback" not in err.value.details()
        assert redis_client.hgetall(key) == before
        assert not redis_client.exists(key + ":lock")
