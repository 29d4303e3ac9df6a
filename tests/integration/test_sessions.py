"""Sessions in a real Redis: continuation, a second coordinator replica, deletion, concurrency."""

from __future__ import annotations

import threading

import grpc
import pytest
from service_stack import start_stack, stop_stack

from specdec.client import build_request
from specdec.v1 import coordinator_pb2, coordinator_pb2_grpc

GREEDY = dict(temperature=0, num_speculative_tokens=3, ignore_eos=True)


def _session_key(stack, session_id):
    return f"{stack.settings.session_key_prefix}:session:{session_id}"


def test_two_calls_on_a_session_equal_one_call_on_the_concatenation(coordinator_stub):
    first = coordinator_stub.Generate(build_request([1, 2, 3], max_new_tokens=7, **GREEDY))
    assert first.session_id
    second = coordinator_stub.Generate(build_request([4, 5], session_id=first.session_id, max_new_tokens=9, **GREEDY))
    assert second.session_id == first.session_id
    concatenated = [1, 2, 3, *first.completions[0].token_ids, 4, 5]
    single = coordinator_stub.Generate(build_request(concatenated, max_new_tokens=9, **GREEDY))
    assert list(second.completions[0].token_ids) == list(single.completions[0].token_ids)
    stored = coordinator_stub.GetSession(coordinator_pb2.GetSessionRequest(session_id=first.session_id))
    assert list(stored.token_ids) == concatenated + list(second.completions[0].token_ids)
    assert 0 < stored.ttl_seconds <= 86400 and stored.updated_at >= stored.created_at > 0


def test_sampled_continuation_with_seed_is_reproducible_on_another_replica(
    tiny_stack, tiny_loaded, tiny_model_dirs, coordinator_stub
):
    # A fixed K: with auto K the rounds follow measured timings, and only the law repeats.
    fixed = {"num_speculative_tokens": 1, "ignore_eos": True}
    first = coordinator_stub.Generate(build_request([2, 2, 2], max_new_tokens=6, seed=5, **fixed))
    replica = start_stack(tiny_loaded, tiny_model_dirs["target"], tiny_stack.redis_url)
    try:
        with replica.channel() as channel:
            other = coordinator_pb2_grpc.CoordinatorStub(channel)
            # The second replica knows the session only through Redis.
            continued = other.Generate(
                build_request([3], session_id=first.session_id, max_new_tokens=6, seed=9, **fixed)
            )
            stored = other.GetSession(coordinator_pb2.GetSessionRequest(session_id=first.session_id))
    finally:
        stop_stack(replica)
    assert list(stored.token_ids) == [2, 2, 2, *first.completions[0].token_ids, 3, *continued.completions[0].token_ids]
    # Same seed and inputs on the first replica -> the same tokens.
    reference = coordinator_stub.Generate(
        build_request([2, 2, 2, *first.completions[0].token_ids, 3], max_new_tokens=6, seed=9, **fixed)
    )
    assert reference.completions[0].token_ids == continued.completions[0].token_ids


def test_delete_session(coordinator_stub):
    created = coordinator_stub.Generate(build_request([1, 1], max_new_tokens=3, **GREEDY))
    deleted = coordinator_stub.DeleteSession(coordinator_pb2.DeleteSessionRequest(session_id=created.session_id))
    assert deleted.deleted
    with pytest.raises(grpc.RpcError) as err:
        coordinator_stub.GetSession(coordinator_pb2.GetSessionRequest(session_id=created.session_id))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as err:
        coordinator_stub.Generate(build_request([1], session_id=created.session_id, max_new_tokens=2))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    again = coordinator_stub.DeleteSession(coordinator_pb2.DeleteSessionRequest(session_id=created.session_id))
    assert not again.deleted


def test_busy_session_is_rejected_and_left_unchanged(coordinator_stub, tiny_stack, redis_client):
    created = coordinator_stub.Generate(build_request([1, 2], max_new_tokens=3, **GREEDY))
    key = _session_key(tiny_stack, created.session_id)
    before = redis_client.hgetall(key)
    # Another replica holds the session's lease.
    redis_client.set(key + ":lock", "someone-else", ex=30)
    try:
        for call in (coordinator_stub.Generate, coordinator_stub.GenerateStream):
            with pytest.raises(grpc.RpcError) as err:
                result = call(build_request([3], session_id=created.session_id, max_new_tokens=3))
                list(result) if call is coordinator_stub.GenerateStream else None
            assert err.value.code() == grpc.StatusCode.ABORTED
            assert "busy" in err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            coordinator_stub.DeleteSession(coordinator_pb2.DeleteSessionRequest(session_id=created.session_id))
        assert err.value.code() == grpc.StatusCode.ABORTED
    finally:
        redis_client.delete(key + ":lock")
    assert redis_client.hgetall(key) == before


def test_concurrent_calls_on_one_session_never_interleave(coordinator_stub):
    created = coordinator_stub.Generate(build_request([1, 2, 3], max_new_tokens=2, **GREEDY))
    base = list(coordinator_stub.GetSession(coordinator_pb2.GetSessionRequest(session_id=created.session_id)).token_ids)
    results: list = []

    def call(marker: int) -> None:
        try:
            response = coordinator_stub.Generate(
                build_request([marker], session_id=created.session_id, max_new_tokens=40, seed=marker, ignore_eos=True)
            )
            results.append((marker, list(response.completions[0].token_ids)))
        except grpc.RpcError as exc:
            results.append((marker, exc.code()))

    threads = [threading.Thread(target=call, args=(m,)) for m in (4, 5, 6, 7)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    succeeded = [(m, toks) for m, toks in results if isinstance(toks, list)]
    rejected = [code for _, code in results if not isinstance(code, list)]
    assert succeeded and all(code == grpc.StatusCode.ABORTED for code in rejected)
    stored = list(
        coordinator_stub.GetSession(coordinator_pb2.GetSessionRequest(session_id=created.session_id)).token_ids
    )
    # The history is the base followed by whole turns, one after another, never mixed.
    rest = stored[len(base) :]
    assert stored[: len(base)] == base
    turns = {m: [m, *toks] for m, toks in succeeded}
    position = 0
    while position < len(rest):
        turn = turns.pop(rest[position])
        assert rest[position : position + len(turn)] == turn
        position += len(turn)
    assert not turns
