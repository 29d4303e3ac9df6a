"""A model or coordinator server never shares its port with another one (no SO_REUSEPORT)."""

from __future__ import annotations

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
