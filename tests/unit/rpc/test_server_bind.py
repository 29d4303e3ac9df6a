"""A model or coordinator server never shares its port with another one (no SO_REUSEPORT)."""

from __future__ import annotations

import grpc
import pytest


def test_second_server_on_a_taken_port_fails_to_bind():
    from specdec.rpc.server import build_grpc_server

    first = build_grpc_server("127.0.0.1", 0, 2, 4, lambda server: None, [], "test")
    first.server.start()
    try:
        with pytest.raises(RuntimeError):
            build_grpc_server("127.0.0.1", first.port, 2, 4, lambda server: None, [], "test")
    finally:
        first.server.stop(0).wait(5)


def test_the_server_accepts_keepalive_pings_between_calls():
    """Pool channels ping every KEEPALIVE_S whether or not a call is in flight; a server that took
    those pings as abuse would close the connection (GOAWAY too_many_pings) and the channel would
    drop to IDLE while idle."""
    import time

    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from specdec.rpc.server import MIN_KEEPALIVE_S, build_grpc_server

    server = build_grpc_server("127.0.0.1", 0, 4, 4, lambda s: None, ["t.S"], "t")
    server.server.start()
    server.set_serving(True)
    options = [
        ("grpc.keepalive_time_ms", int(MIN_KEEPALIVE_S * 1000)),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]
    states = []
    with grpc.insecure_channel(f"127.0.0.1:{server.port}", options=options) as channel:
        channel.subscribe(lambda state: states.append(state), try_to_connect=True)
        health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        time.sleep(5 * MIN_KEEPALIVE_S)  # several pings, no call
        assert states[-1] == grpc.ChannelConnectivity.READY, states
    server.server.stop(0)
