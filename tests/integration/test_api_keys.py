"""API keys at the real coordinator: every Coordinator call needs a known bearer key, health and
reflection stay open, the keys file is re-read when it changes, and sessions belong to their tenant."""

from __future__ import annotations

import os

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from service_stack import start_stack, stop_stack

from specdec.cli import main
from specdec.client import SpecdecClient, build_request
from specdec.v1 import coordinator_pb2, coordinator_pb2_grpc

GREEDY = {"temperature": 0, "num_speculative_tokens": 2, "ignore_eos": True}
KEYS = "# tenants\nkey-of-a tenant-a\n\nkey-of-b tenant-b   # a comment\nkey-a-second tenant-a\n"


def bearer(key: str) -> tuple:
    return (("authorization", f"Bearer {key}"),)


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "api-keys"
    path.write_text(KEYS)
    return path


@pytest.fixture(scope="module")
def auth_stack(tiny_loaded, tiny_model_dirs, redis_url, keys_file):
    stack = start_stack(tiny_loaded, tiny_model_dirs["target"], redis_url, api_keys_file=str(keys_file))
    yield stack
    stop_stack(stack)


@pytest.fixture()
def stub(auth_stack):
    with auth_stack.channel() as channel:
        yield coordinator_pb2_grpc.CoordinatorStub(channel)


def calls(stub, session_id: str = "") -> dict:
    get = coordinator_pb2.GetSessionRequest(session_id=session_id or "0" * 32)
    delete = coordinator_pb2.DeleteSessionRequest(session_id=session_id or "0" * 32)
    generate = build_request([1, 2], session_id=session_id, max_new_tokens=2, **GREEDY)
    resume = coordinator_pb2.GenerateRequest(session_id=session_id or "0" * 32, resume=True)
    return {
        "Generate": lambda metadata: stub.Generate(generate, metadata=metadata, timeout=30),
        "GenerateStream resume": lambda metadata: list(stub.GenerateStream(resume, metadata=metadata, timeout=30)),
        "GenerateStream": lambda metadata: list(stub.GenerateStream(generate, metadata=metadata, timeout=30)),
        "GetSession": lambda metadata: stub.GetSession(get, metadata=metadata, timeout=30),
        "DeleteSession": lambda metadata: stub.DeleteSession(delete, metadata=metadata, timeout=30),
    }


@pytest.mark.parametrize(
    ("metadata", "message"),
    [
        ((), "missing API key"),
        ((("authorization", "key-of-a"),), "missing API key"),  # no Bearer scheme
        ((("authorization", "Basic a2V5LW9mLWE="),), "missing API key"),
        ((("authorization", "Bearer "),), "missing API key"),
        (bearer("key-of-nobody"), "unknown API key"),
    ],
)
def test_every_coordinator_call_needs_a_known_key(stub, metadata, message):
    for name, call in calls(stub).items():
        with pytest.raises(grpc.RpcError) as error:
            call(metadata)
        assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED, name
        assert message in error.value.details(), name
        assert "key-of" not in error.value.details()  # the key is never echoed


def test_health_and_reflection_stay_open_without_a_key(auth_stack):
    with auth_stack.channel() as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        (answer,) = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(iter([request]), timeout=5)
    assert "specdec.v1.Coordinator" in {s.name for s in answer.list_services_response.service}


def test_a_known_key_is_served_in_any_scheme_case(stub):
    response = stub.Generate(build_request([1, 2], max_new_tokens=3, **GREEDY), metadata=bearer("key-of-a"))
    assert len(response.completions[0].token_ids) == 3
    lower = (("authorization", "bearer key-of-b"),)
    assert stub.Generate(build_request([1, 2], max_new_tokens=3, **GREEDY), metadata=lower, timeout=30)


def test_sessions_belong_to_their_tenant(stub):
    created = stub.Generate(build_request([1, 2, 3], max_new_tokens=4, **GREEDY), metadata=bearer("key-of-a"))
    session_id = created.session_id
    stored = stub.GetSession(coordinator_pb2.GetSessionRequest(session_id=session_id), metadata=bearer("key-of-a"))
    for name, call in calls(stub, session_id).items():
        if name == "DeleteSession":  # to tenant B the session does not exist: nothing to delete
            assert call(bearer("key-of-b")).deleted is False
            continue
        with pytest.raises(grpc.RpcError) as error:
            call(bearer("key-of-b"))
        assert error.value.code() == grpc.StatusCode.NOT_FOUND, name
    # Intact for A, under either of A's keys, and A can still continue it.
    again = stub.GetSession(coordinator_pb2.GetSessionRequest(session_id=session_id), metadata=bearer("key-a-second"))
    assert list(again.token_ids) == list(stored.token_ids) == [1, 2, 3, *created.completions[0].token_ids]
    continued = stub.Generate(
        build_request([5], session_id=session_id, max_new_tokens=2, **GREEDY), metadata=bearer("key-of-a")
    )
    assert continued.session_id == session_id
    deleted = stub.DeleteSession(
        coordinator_pb2.DeleteSessionRequest(session_id=session_id), metadata=bearer("key-of-a")
    )
    assert deleted.deleted


def test_the_keys_file_is_reloaded_when_it_changes(stub, keys_file):
    request = build_request([1, 2], max_new_tokens=2, **GREEDY)
    try:
        new = keys_file.with_suffix(".new")
        new.write_text("key-of-a tenant-a\nkey-of-c\n")  # b revoked, c added (its own tenant)
        os.replace(new, keys_file)  # as a Secret update swaps the file
        assert stub.Generate(request, metadata=bearer("key-of-c"), timeout=30)
        with pytest.raises(grpc.RpcError) as error:
            stub.Generate(request, metadata=bearer("key-of-b"), timeout=30)
        assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
        created = stub.Generate(request, metadata=bearer("key-of-c"), timeout=30)  # c is not tenant a
        with pytest.raises(grpc.RpcError) as error:
            stub.GetSession(
                coordinator_pb2.GetSessionRequest(session_id=created.session_id), metadata=bearer("key-of-a")
            )
        assert error.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        keys_file.write_text(KEYS)


def test_client_and_cli_send_the_key(auth_stack, capsys, monkeypatch):
    with SpecdecClient(auth_stack.coordinator_address, api_key="key-of-a") as client:
        session_id = client.generate([1, 2], max_new_tokens=2, **GREEDY).session_id
        assert client.get_session(session_id).session_id == session_id
    address = ["--address", auth_stack.coordinator_address]
    assert main(["session", "show", session_id, *address]) == 1
    assert "UNAUTHENTICATED: missing API key" in capsys.readouterr().err
    assert main(["session", "show", session_id, *address, "--api-key", "key-of-b"]) == 1
    assert "NOT_FOUND" in capsys.readouterr().err
    monkeypatch.setenv("SPECDEC_API_KEY", "key-a-second")
    assert main(["session", "delete", session_id, *address]) == 0
    assert "deleted" in capsys.readouterr().out
