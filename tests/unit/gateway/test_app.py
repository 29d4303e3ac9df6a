"""gateway.app with a stand-in coordinator client, under a real uvicorn: a client that leaves a
stream cancels the coordinator call; the caller's key and the request id are forwarded as gRPC
metadata, the id returned and logged."""

from __future__ import annotations

import asyncio
import json
import logging
import threading

import httpx
import pytest
from gateway_server import serve_gateway

from specdec.rpc.logs import JsonFormatter
from specdec.v1 import coordinator_pb2


class EndlessCall:
    """A GenerateStream that never ends on its own, like a long generation."""

    def __init__(self):
        self.cancelled = threading.Event()
        self.reads = 0

    async def read(self):
        self.reads += 1
        if self.reads > 1:
            await asyncio.sleep(0.01)
        return coordinator_pb2.GenerateChunk(text="a ", token_ids=[1], session_id="s")

    def cancel(self) -> bool:
        self.cancelled.set()
        return True


class StandIn:
    def __init__(self):
        self.calls: list[tuple[coordinator_pb2.GenerateRequest, tuple, EndlessCall]] = []

    def stream(self, request, metadata):
        self.calls.append((request, metadata, EndlessCall()))
        return self.calls[-1][2]

    async def serving(self) -> bool:
        return True

    async def close(self) -> None:
        pass


def test_a_client_that_leaves_a_stream_cancels_the_coordinator_call():
    stand_in = StandIn()
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    with serve_gateway("unused:1", client=stand_in, model_name="m") as url:
        headers = {"authorization": "Bearer key-1"}
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, headers=headers, timeout=10) as response:
            lines = [line for _, line in zip(range(4), response.iter_lines(), strict=False)]
            assert lines[0].startswith("data: ")
        (request, metadata, call) = stand_in.calls[0]
        assert call.cancelled.wait(5), "the coordinator call was left running"
        reads = call.reads
    assert reads < 1000 and call.reads == reads  # nothing read after the cancel
    assert dict(metadata)["authorization"] == "Bearer key-1"
    assert [(m.role, m.content) for m in request.messages] == [("user", "hi")]


def test_an_unprintable_authorization_header_is_401_not_a_crash():
    with serve_gateway("unused:1", client=StandIn(), model_name="m") as url:
        body = {"model": "m", "prompt": "a", "stream": True}
        response = httpx.post(url + "/v1/completions", json=body, headers={"authorization": "Bearer \x7f"}, timeout=10)
    assert response.status_code == 401 and response.json()["error"]["code"] == "unauthenticated"


class Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.setFormatter(JsonFormatter())
        self.lines: list[dict] = []

    def emit(self, record):
        self.lines.append(json.loads(self.format(record)))


@pytest.fixture()
def access_log():
    logger, handler = logging.getLogger("gateway.access"), Lines()
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    yield handler.lines
    logger.removeHandler(handler)
    logger.setLevel(level)


@pytest.mark.parametrize(
    ("given", "kept"),
    [("req-1.a:b_C", True), (None, False), ("has space", False), ("x" * 65, False), ("é".encode(), False)],
)
def test_the_request_id_is_the_clients_or_a_new_one_forwarded_returned_and_logged(given, kept, access_log):
    stand_in = StandIn()
    body = {"model": "m", "prompt": "a", "stream": True}
    headers = {} if given is None else {"X-Request-Id": given}
    with serve_gateway("unused:1", client=stand_in, model_name="m") as url:
        with httpx.stream("POST", url + "/v1/completions", json=body, headers=headers, timeout=10) as response:
            returned = response.headers["x-request-id"]
        assert stand_in.calls[0][2].cancelled.wait(5)
    (_, metadata, _) = stand_in.calls[0]
    assert dict(metadata)["x-request-id"] == returned
    if kept:
        assert returned == given
    else:
        assert returned != given and len(returned) == 16 and int(returned, 16) >= 0
    (line,) = [line for line in access_log if line["message"].startswith("POST /v1/completions 200")]
    assert line["request_id"] == returned and line["logger"] == "gateway.access"


def test_errors_carry_the_request_id_too(access_log):
    with serve_gateway("unused:1", client=StandIn(), model_name="m") as url:
        assert httpx.get(url + "/health", timeout=10).status_code == 200  # a probe that passes: no line
        response = httpx.post(url + "/v1/completions", json={"model": "other", "prompt": "a"}, timeout=10)
        junk = httpx.get(url + "/v1/x%0Ay", headers={"x-request-id": "r-404"}, timeout=10)
    assert response.status_code == 404 and len(response.headers["x-request-id"]) == 16
    assert junk.status_code == 404 and junk.headers["x-request-id"] == "r-404"
    # The route label, never the client's path (a newline in it would forge a text log line).
    assert [line["message"].split(" ")[:3] for line in access_log] == [
        ["POST", "/v1/completions", "404"],
        ["GET", "other", "404"],
    ]
