"""Admission control and call metrics on a real gRPC server."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.rpc.server import build_grpc_server


def test_calls_beyond_the_limit_get_resource_exhausted_and_health_still_answers():
    release = threading.Event()
    entered = threading.Event()

    def block(request: bytes, context) -> bytes:
        entered.set()
        release.wait(10)
        return request

    handler = grpc.method_handlers_generic_handler("test.Slow", {"Block": grpc.unary_unary_rpc_method_handler(block)})
    server = build_grpc_server(
        "127.0.0.1",
        0,
        max_workers=4,
        max_message_mb=4,
        register=lambda s: s.add_generic_rpc_handlers((handler,)),
        service_names=["test.Slow"],
        metrics_label="test",
        max_concurrent_requests=1,
    )
    server.server.start()
    server.set_serving(True)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            call = channel.unary_unary("/test.Slow/Block")
            first = threading.Thread(target=lambda: call(b"one", timeout=10))
            first.start()
            assert entered.wait(5)
            with pytest.raises(grpc.RpcError) as err:
                call(b"two", timeout=5)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            release.set()
            first.join(10)
            assert call(b"three", timeout=5) == b"three"  # admitted again once the first finished
        calls = {"name": "specdec_requests_total", "service": "test", "method": "Block"}
        assert server.registry.value(**calls, code="RESOURCE_EXHAUSTED") == 1
        assert server.registry.value(**calls, code="OK") == 2
        deadline = time.monotonic() + 5
        while server.registry.value("specdec_inflight_requests", service="test") != 0:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        release.set()
        server.server.stop(0)
