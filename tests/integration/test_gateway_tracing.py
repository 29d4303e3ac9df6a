"""One HTTP request, one trace: the gateway's SERVER span (under the caller's traceparent), its
client span of the coordinator call, the coordinator's spans and both pools' server spans, all
joined through real HTTP headers and gRPC metadata (every service shares this process and its
in-memory exporter). The request id the client sent reaches the coordinator's span."""

from __future__ import annotations

import secrets
import time

import httpx
import pytest
from gateway_server import serve_gateway
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from service_stack import start_stack, stop_stack

from specdec.rpc import tracing

MODEL = "smollm2-135m-instruct"
PROPOSE, VERIFY = "/specdec.v1.DraftService/Propose", "/specdec.v1.TargetService/Verify"
REQUEST = {"model": MODEL, "prompt": "a b", "max_tokens": 5, "num_speculative_tokens": 2, "ignore_eos": True}


@pytest.fixture(scope="module")
def traced_gateway(tiny_loaded, tiny_model_dirs, redis_url):
    """A stack and gateway of their own, built after tracing is on (interceptors are chosen when
    servers and channels are built)."""
    exporter = InMemorySpanExporter()
    tracing.configure_tracing("specdec-test", "", exporter=exporter)
    stack = start_stack(tiny_loaded, tiny_model_dirs["target"], redis_url)
    try:
        with serve_gateway(stack.coordinator_address) as url:
            yield url, exporter
    finally:
        stop_stack(stack)
        tracing.disable_tracing()


def _trace(exporter, trace_id: int, route: str, timeout_s: float = 10.0) -> list:
    """The spans of `trace_id` once the gateway's span of `route` has ended (after the last byte)."""
    deadline = time.monotonic() + timeout_s
    while True:
        spans = [s for s in exporter.get_finished_spans() if s.context.trace_id == trace_id]
        if any(s.name == f"POST {route}" for s in spans):
            return spans
        assert time.monotonic() < deadline, f"no gateway span for {route}"
        time.sleep(0.05)


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_one_http_request_is_one_trace_from_the_gateway_to_both_pools(traced_gateway, stream):
    url, exporter = traced_gateway
    trace_id, caller_span = secrets.randbits(128), secrets.randbits(64)
    headers = {"traceparent": f"00-{trace_id:032x}-{caller_span:016x}-01", "x-request-id": f"trace-test-{stream}"}
    response = httpx.post(url + "/v1/completions", json={**REQUEST, "stream": stream}, headers=headers, timeout=60)
    assert response.status_code == 200 and response.headers["x-request-id"] == f"trace-test-{stream}"
    spans = _trace(exporter, trace_id, "/v1/completions")
    by_id = {s.context.span_id: s for s in spans}

    def parent(span):
        return by_id[span.parent.span_id]

    (gateway,) = [s for s in spans if s.name == "POST /v1/completions"]
    assert gateway.kind == SpanKind.SERVER and gateway.parent.span_id == caller_span and gateway.parent.is_remote
    assert gateway.attributes["http.route"] == "/v1/completions" and gateway.attributes["http.request.method"] == "POST"
    assert gateway.attributes["http.response.status_code"] == 200
    method = "/specdec.v1.Coordinator/" + ("GenerateStream" if stream else "Generate")
    (client,) = [s for s in spans if s.name == method and s.kind == SpanKind.CLIENT]
    (server,) = [s for s in spans if s.name == method and s.kind == SpanKind.SERVER]
    assert parent(client) is gateway and parent(server) is client
    (generate,) = [s for s in spans if s.name.startswith("specdec.generate")]
    assert parent(generate) is server and generate.attributes["specdec.request_id"] == f"trace-test-{stream}"
    assert generate.attributes["specdec.generated_tokens"] == 5
    for pool_method in (PROPOSE, VERIFY):
        served = [s for s in spans if s.name == pool_method and s.kind == SpanKind.SERVER]
        assert served and all(parent(parent(s)).name == "specdec.round" for s in served), pool_method
    # The gateway's span holds the whole call: a stream's too, to its last byte.
    assert gateway.start_time <= client.start_time and client.end_time <= gateway.end_time


def test_without_a_traceparent_the_gateway_starts_the_trace_and_probes_make_none(traced_gateway):
    url, exporter = traced_gateway
    for probe in ("/health", "/metrics"):
        assert httpx.get(url + probe, timeout=30).status_code == 200
    assert httpx.post(url + "/v1/completions", json=REQUEST, timeout=60).status_code == 200
    deadline = time.monotonic() + 10
    while not (
        roots := [s for s in exporter.get_finished_spans() if s.name == "POST /v1/completions" and s.parent is None]
    ):
        assert time.monotonic() < deadline, "no root gateway span"
        time.sleep(0.05)
    names = {s.name for s in exporter.get_finished_spans() if s.context.trace_id == roots[0].context.trace_id}
    assert {"/specdec.v1.Coordinator/Generate", PROPOSE, VERIFY} <= names
    assert not [s for s in exporter.get_finished_spans() if s.name.startswith("GET ")]
