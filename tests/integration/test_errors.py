"""Bad input and broken dependencies get a clear gRPC status, never a hang or a stack trace,
and never change a stored session."""

from __future__ import annotations

import math
import threading
import time

import grpc
import pytest
from service_stack import start_stack, stop_stack
from tiny_models import build_tiny_model

from specdec.client import build_request
from specdec.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc, draft_pb2, draft_pb2_grpc

INVALID = grpc.StatusCode.INVALID_ARGUMENT


def _bad_requests(session_id: str):
    ok = dict(session_id=session_id, max_new_tokens=4)
    yield "empty prompt", build_request("", max_new_tokens=4), INVALID
    yield "empty token prompt", build_request([], max_new_tokens=4), INVALID
    yield "max_new_tokens 0", build_request([1], **{**ok, "max_new_tokens": 0}), INVALID
    yield "max_new_tokens -3", build_request([1], **{**ok, "max_new_tokens": -3}), INVALID
    yield "max_new_tokens above limit", build_request([1], **{**ok, "max_new_tokens": 4097}), INVALID
    yield "K -1", build_request([1], num_speculative_tokens=-1, **ok), INVALID
    yield "K above max", build_request([1], num_speculative_tokens=17, **ok), INVALID
    yield "temperature NaN", build_request([1], temperature=math.nan, **ok), INVALID
    yield "temperature negative", build_request([1], temperature=-0.5, **ok), INVALID
    yield "temperature inf", build_request([1], temperature=math.inf, **ok), INVALID
    yield "top_p 0", build_request([1], top_p=0.0, **ok), INVALID
    yield "top_p above 1", build_request([1], top_p=1.5, **ok), INVALID
    yield "top_p NaN", build_request([1], top_p=math.nan, **ok), INVALID
    yield "top_k negative", build_request([1], top_k=-2, **ok), INVALID
    yield "token id outside vocab", build_request([1, 99], **ok), INVALID
    yield "negative token id", build_request([-1], **ok), INVALID
    yield "samples with a session", build_request([1], num_samples=2, **ok), INVALID
    yield "too many samples", build_request([1], num_samples=10**6, max_new_tokens=2), INVALID
    yield "empty stop string", build_request([1], stop=[""], **ok), INVALID
    yield "malformed session id", build_request([1], session_id="a b" * 100, max_new_tokens=2), INVALID
    yield (
        "unknown session",
        build_request([1], session_id="0" * 32, max_new_tokens=2),
        grpc.StatusCode.NOT_FOUND,
    )
    both = build_request("a b", **ok)
    both.prompt_token_ids.append(1)
    yield "prompt and ids", both, INVALID
    yield "prompt too long for the context", build_request([1] * 70, max_new_tokens=2), INVALID


def test_bad_requests_get_clear_statuses_and_leave_the_session_unchanged(coordinator_stub, tiny_stack, redis_client):
    created = coordinator_stub.Generate(build_request([1, 2], max_new_tokens=3, temperature=0, ignore_eos=True))
    key = f"{tiny_stack.settings.session_key_prefix}:session:{created.session_id}"
    before = redis_client.hgetall(key)
    for name, request, code in _bad_requests(created.session_id):
        for method in ("Generate", "GenerateStream"):
            with pytest.raises(grpc.RpcError) as err:
                result = getattr(coordinator_stub, method)(request, timeout=30)
                if method == "GenerateStream":
                    list(result)
            assert err.value.code() == code, f"{name} via {method}: {err.value.code()} {err.value.details()}"
            assert "Traceback" not in err.value.details()
        assert redis_client.hgetall(key) == before, name
        assert not redis_client.exists(key + ":lock"), name
    # num_samples > 1 is a unary-only feature.
    with pytest.raises(grpc.RpcError) as err:
        list(coordinator_stub.GenerateStream(build_request([1], num_samples=2, max_new_tokens=2)))
    assert err.value.code() == INVALID
    for call, request in (
        (coordinator_stub.GetSession, coordinator_pb2.GetSessionRequest(session_id="")),
        (coordinator_stub.DeleteSession, coordinator_pb2.DeleteSessionRequest(session_id="")),
    ):
        with pytest.raises(grpc.RpcError) as err:
            call(request)
        assert err.value.code() == INVALID


def test_model_services_validate_their_own_input(tiny_stack):
    with grpc.insecure_channel(tiny_stack.draft_address) as channel:
        draft = draft_pb2_grpc.DraftServiceStub(channel)
        cases = [
            draft_pb2.ProposeRequest(),
            draft_pb2.ProposeRequest(sequences=[draft_pb2.DraftSequence(prefix_token_ids=[], num_draft_tokens=2)]),
            draft_pb2.ProposeRequest(sequences=[draft_pb2.DraftSequence(prefix_token_ids=[1], num_draft_tokens=0)]),
            draft_pb2.ProposeRequest(sequences=[draft_pb2.DraftSequence(prefix_token_ids=[50], num_draft_tokens=1)]),
            draft_pb2.ProposeRequest(
                sequences=[draft_pb2.DraftSequence(prefix_token_ids=[1], num_draft_tokens=1)],
                sampling=common_pb2.SamplingParams(temperature=-1),
            ),
            draft_pb2.ProposeRequest(
                sequences=[draft_pb2.DraftSequence(prefix_token_ids=[1] * 64, num_draft_tokens=4)]
            ),
        ]
        for request in cases:
            with pytest.raises(grpc.RpcError) as err:
                draft.Propose(request, timeout=10)
            assert err.value.code() == INVALID, request


@pytest.mark.parametrize(
    "broken, expected_in_details",
    [({"target_address": "127.0.0.1:1"}, "target"), ({"redis": "redis://127.0.0.1:1/0"}, "session store")],
    ids=["target-down", "redis-down"],
)
def test_unreachable_dependency_is_unavailable_not_a_hang(
    tiny_loaded, tiny_model_dirs, redis_url, broken, expected_in_details
):
    broken = dict(broken)
    stack = start_stack(tiny_loaded, tiny_model_dirs["target"], broken.pop("redis", redis_url), **broken)
    try:
        with stack.channel() as channel:
            stub = coordinator_pb2_grpc.CoordinatorStub(channel)
            with pytest.raises(grpc.RpcError) as err:
                stub.Generate(build_request([1, 2], max_new_tokens=3), timeout=30)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert expected_in_details in err.value.details()
            assert "127.0.0.1:1" not in err.value.details(), "clients never see internal addresses"
    finally:
        stop_stack(stack)


def test_client_deadline_is_deadline_exceeded(coordinator_stub, tiny_loaded):
    """The target's model thread is held past the deadline, so the outcome does not depend on
    how fast this host runs the tiny models (on a fast one, 62 tokens took under 0.3 s)."""
    runner = tiny_loaded["target"].runner
    busy = threading.Thread(target=runner.on_model_thread, args=(time.sleep, 1.0))
    busy.start()
    try:
        with pytest.raises(grpc.RpcError) as err:
            request = build_request([1, 2], max_new_tokens=4000, ignore_eos=True, num_speculative_tokens=1)
            coordinator_stub.Generate(request, timeout=0.3)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    finally:
        busy.join()


def test_incompatible_draft_is_refused_naming_both_models(tiny_loaded, tiny_model_dirs, redis_url, tmp_path):
    from specdec.rpc.model_service import ModelServerSettings, load_model
    from specdec.settings import load_settings

    other_vocab = ["<eos>", "x", "y", "z", "w", "v", "u", "t", "s"]
    odd_dir = build_tiny_model(tmp_path / "odd-draft", seed=3, logit_scale=5.0, vocab=other_vocab)
    odd = load_model(load_settings(ModelServerSettings, [], {}, model=str(odd_dir)), "draft")
    stack = start_stack(tiny_loaded, tiny_model_dirs["target"], redis_url, draft_loaded=odd)
    try:
        with stack.channel() as channel:
            stub = coordinator_pb2_grpc.CoordinatorStub(channel)
            with pytest.raises(grpc.RpcError) as err:
                stub.Generate(build_request([1, 2], max_new_tokens=3, num_speculative_tokens=2), timeout=30)
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert str(odd_dir) in err.value.details() and tiny_model_dirs["target"] in err.value.details()
            # Target-only decoding needs no draft and still works.
            ok = stub.Generate(build_request([1, 2], max_new_tokens=3, num_speculative_tokens=0), timeout=30)
            assert len(ok.completions[0].token_ids) >= 1
    finally:
        stop_stack(stack)
