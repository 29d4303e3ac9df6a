"""specdec.rpc.clients: pool addresses as gRPC targets; attempts, retries and what reaches clients."""

import logging
import threading
import time

import grpc
import pytest

from specdec.core.errors import DeadlineExceeded, ServiceError, Unavailable
from specdec.core.protocols import NO_DEADLINE, Deadline
from specdec.rpc.clients import TargetClient, channel_target, scrubbed
from specdec.rpc.errors import REASON_KEY
from specdec.rpc.metrics import AT_CAPACITY
from specdec.rpc.server import build_grpc_server


def test_channel_targets():
    assert channel_target("draft:50052") == "draft:50052"
    assert channel_target("dns:///draft.ns.svc:50052") == "dns:///draft.ns.svc:50052"
    assert channel_target("10.0.0.1:1, 10.0.0.2:1") == "ipv4:10.0.0.1:1,10.0.0.2:1"
    assert channel_target("localhost:1,localhost:2") == "ipv4:127.0.0.1:1,127.0.0.1:2"


# ---------------------------------------------------------------- attempts, retries, messages
# Real gRPC servers on loopback; the pool clients call them with raw bytes (a generic method).


class CountingServer:
    """A gRPC server of specdec.v1.TargetService/Verify that answers with `handle(request, context)`
    and counts its calls; behind the project's admission control when `max_concurrent` is set."""

    def __init__(self, handle, max_concurrent: int = 0, max_send_mb: int = 4):
        self.calls = 0
        self._lock = threading.Lock()

        def verify(request: bytes, context) -> bytes:
            with self._lock:
                self.calls += 1
            return handle(request, context)

        handler = grpc.method_handlers_generic_handler(
            "specdec.v1.TargetService", {"Verify": grpc.unary_unary_rpc_method_handler(verify)}
        )
        self.server = build_grpc_server(
            "127.0.0.1",
            0,
            max_workers=8,
            max_message_mb=max_send_mb,
            register=lambda s: s.add_generic_rpc_handlers((handler,)),
            service_names=["specdec.v1.TargetService"],
            metrics_label="test",
            max_concurrent_requests=max_concurrent,
        )
        self.server.server.start()
        self.address = f"127.0.0.1:{self.server.port}"

    def stop(self):
        self.server.server.stop(0).wait(5)


def _client(address: str, timeout_s: float = 5.0, attempts: int = 3, max_message_mb: int = 4) -> TargetClient:
    return TargetClient(address, timeout_s, timeout_s, max_message_mb, attempts=attempts)


def _verify(client: TargetClient, deadline=NO_DEADLINE) -> bytes:
    return client.call(client.channel.unary_unary("/specdec.v1.TargetService/Verify"), b"x", deadline)


@pytest.fixture()
def servers():
    started = []
    yield lambda *args, **kwargs: started.append(CountingServer(*args, **kwargs)) or started[-1]
    for server in started:
        server.stop()


@pytest.mark.parametrize("over", ["server send limit", "client receive limit"])
def test_a_response_over_the_message_limit_is_computed_once(servers, over):
    """RESOURCE_EXHAUSTED for size would be the same on any pod: it fails at once, with a clear
    message. (With the service config's retryPolicy the server's case was computed 3 times.)"""
    big = b"x" * (2 << 20)
    server = servers(lambda r, c: big, max_send_mb=1 if over == "server send limit" else 4)
    client = _client(server.address, max_message_mb=1 if over == "client receive limit" else 4)
    with pytest.raises(ServiceError, match="target service: .*larger than max") as failure:
        _verify(client)
    assert failure.value.code == "RESOURCE_EXHAUSTED"
    assert server.calls == 1
    client.close()


def test_a_pod_at_capacity_says_so_and_the_call_is_retried_with_back_off(servers):
    entered, release = threading.Event(), threading.Event()

    def handle(request, context):
        if not entered.is_set():
            entered.set()
            release.wait(5)
        return b"ok"

    server = servers(handle, max_concurrent=1)
    client = _client(server.address)
    first = threading.Thread(target=_verify, args=(client,))
    first.start()
    assert entered.wait(5)
    # The refusal carries its reason.
    with pytest.raises(grpc.RpcError) as refused:
        client.channel.unary_unary("/specdec.v1.TargetService/Verify")(b"x", timeout=5)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert (REASON_KEY, AT_CAPACITY) in tuple(refused.value.trailing_metadata())
    # A call through the client waits its back-off and is admitted once the first call is done.
    threading.Timer(0.05, release.set).start()
    started = time.perf_counter()
    assert _verify(client) == b"ok"
    assert time.perf_counter() - started < 2.0
    first.join(5)
    client.close()


def test_at_capacity_retries_are_bounded_by_attempts_and_then_fail_clearly(servers):
    release = threading.Event()
    server = servers(lambda r, c: release.wait(5) and b"ok", max_concurrent=1)
    client = _client(server.address, attempts=2)
    first = threading.Thread(target=_verify, args=(client,))
    first.start()
    try:
        deadline = time.monotonic() + 5
        while server.calls == 0:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        with pytest.raises(ServiceError, match="target service: test is at capacity") as failure:
            _verify(client)
        assert failure.value.code == "RESOURCE_EXHAUSTED"
    finally:
        release.set()
        first.join(5)
        client.close()


def test_a_hung_replica_costs_one_attempt_timeout_then_is_ejected(servers):
    """Two pods, one hung (every call blocks): every call succeeds (a timed-out attempt is retried
    on the other pod), and outlier detection stops choosing the hung pod within a few seconds."""
    hang = threading.Event()
    healthy = servers(lambda r, c: b"ok")
    hung = servers(lambda r, c: hang.wait(30) and b"late")
    client = _client(f"{healthy.address},{hung.address}", timeout_s=0.3)
    try:
        took = []
        for _ in range(30):
            started = time.perf_counter()
            assert _verify(client) == b"ok"
            took.append(time.perf_counter() - started)
        assert max(took) < 0.3 * 2 + 0.5  # at most one timed-out attempt (and a back-off) per call
        assert hung.calls >= 1
        calls_before = hung.calls
        for _ in range(20):  # ejected now: no call waits on the hung pod
            started = time.perf_counter()
            assert _verify(client) == b"ok"
            assert time.perf_counter() - started < 0.2
        assert hung.calls == calls_before
        print(f"hung replica: {hung.calls} timed-out attempts, slowest call {max(took):.2f}s, ejected")
    finally:
        hang.set()
        client.close()


def test_a_dead_replica_is_skipped_and_messages_carry_no_address(servers, caplog):
    healthy = servers(lambda r, c: b"ok")
    dead = servers(lambda r, c: b"ok")
    dead.stop()
    client = _client(f"{healthy.address},{dead.address}")
    assert all(_verify(client) == b"ok" for _ in range(6))
    client.close()

    lone = _client(dead.address, attempts=2)
    with caplog.at_level(logging.WARNING, logger="specdec.rpc.clients"), pytest.raises(Unavailable) as failure:
        _verify(lone)
    message = str(failure.value)
    assert message.startswith("target service: ") and "(2 attempts)" in message
    assert "127.0.0.1" not in message and str(dead.server.port) not in message
    assert dead.address in caplog.text  # the operator still sees which pod
    lone.close()


def test_per_attempt_timeouts_past_which_every_pod_hangs_are_unavailable_not_the_requests_deadline(servers):
    hang = threading.Event()
    hung = servers(lambda r, c: hang.wait(30) and b"late")
    client = _client(hung.address, timeout_s=0.1, attempts=2)
    try:
        with pytest.raises(Unavailable, match="no answer within the per-call deadline"):
            _verify(client)
        # With the request's own deadline nearer than the attempt's: that deadline, not retried.
        started = time.perf_counter()
        with pytest.raises(DeadlineExceeded):
            client.call_timeout_s = 5.0
            _verify(client, Deadline(time.monotonic() + 0.2))
        assert time.perf_counter() - started < 1.0
    finally:
        hang.set()
        client.close()


def test_scrubbed_removes_addresses():
    text = "failed to connect to all addresses; last error: ipv4:10.1.2.3:50052: refused; draft-0.draft.ns:50052"
    assert scrubbed(text) == "failed to connect to all addresses; last error: <address>: refused; <address>"
    assert scrubbed("localhost:1 and [::1]:2") == "<address> and <address>"
    assert scrubbed("K=3: 4 tokens") == "K=3: 4 tokens"
