"""Tracing: nothing installed while off; when on, a span's context crosses a real gRPC hop in metadata."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from specdec.rpc import tracing
from specdec.rpc.clients import open_channel
from specdec.rpc.server import build_grpc_server


def test_off_by_default_nothing_is_installed():
    tracing.configure_tracing("specdec-test", "")  # no endpoint: stays off
    assert not tracing.tracing_enabled()
    assert tracing.server_interceptors() == [] and tracing.client_interceptors() == []
    assert tracing.aio_client_interceptors() == []
    with tracing.span("specdec.round") as span:
        assert span is None
    assert tracing.current_trace_id() == ""


@pytest.fixture()
def exporter():
    exporter = InMemorySpanExporter()
    tracing.configure_tracing("specdec-test", "", exporter=exporter)
    yield exporter
    tracing.disable_tracing()


def _server():
    def echo(request: bytes, context) -> bytes:
        if request == b"fail":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "bad")
        return request

    handler = grpc.method_handlers_generic_handler("test.Echo", {"Echo": grpc.unary_unary_rpc_method_handler(echo)})
    server = build_grpc_server(
        "127.0.0.1", 0, 4, 4, lambda s: s.add_generic_rpc_handlers((handler,)), ["test.Echo"], metrics_label="test"
    )
    server.server.start()
    server.set_serving(True)
    return server


def test_a_client_span_is_the_remote_parent_of_the_server_span(exporter):
    server = _server()
    channel = open_channel(f"127.0.0.1:{server.port}", 4)
    try:
        with tracing.span("specdec.round") as parent:
            assert channel.unary_unary("/test.Echo/Echo")(b"hi", timeout=5) == b"hi"
            trace_id = tracing.current_trace_id()
        with pytest.raises(grpc.RpcError):
            channel.unary_unary("/test.Echo/Echo")(b"fail", timeout=5)
        health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    finally:
        channel.close()
        server.server.stop(0).wait(5)
    spans = exporter.get_finished_spans()
    assert {s.name for s in spans} == {"specdec.round", "/test.Echo/Echo"}  # health checks are not traced
    client, failed = [s for s in spans if s.kind == SpanKind.CLIENT]
    servers = [s for s in spans if s.kind == SpanKind.SERVER]
    assert client.parent.span_id == parent.get_span_context().span_id
    first = next(s for s in servers if s.context.trace_id == client.context.trace_id)
    # Parented across the hop: only the metadata can have carried the client span's context.
    assert first.parent.span_id == client.context.span_id and first.parent.is_remote
    assert format(first.context.trace_id, "032x") == trace_id
    assert failed.status.status_code == StatusCode.ERROR and failed.parent is None  # outside the round
