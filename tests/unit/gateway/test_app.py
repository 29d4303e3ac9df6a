"""gateway.app with a stand-in coordinator client, under a real uvicorn: a client that leaves a
stream cancels the coordinator call, and the caller's key is forwarded as gRPC metadata."""

from __future__ import annotations

import asyncio
import threading

import httpx
from gateway_server import serve_gateway

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
    assert metadata == (("authorization", "Bearer key-1"),)
    assert [(m.role, m.content) for m in request.messages] == [("user", "hi")]


def test_an_unprintable_authorization_header_is_401_not_a_crash():
    with serve_gateway("unused:1", client=StandIn(), model_name="m") as url:
        body = {"model": "m", "prompt": "a", "stream": True}
        response = httpx.post(url + "/v1/completions", json=body, headers={"authorization": "Bearer \x7f"}, timeout=10)
    assert response.status_code == 401 and response.json()["error"]["code"] == "unauthenticated"
