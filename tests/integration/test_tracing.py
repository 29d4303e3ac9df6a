"""One request, one trace: the coordinator's spans and both pools' server spans, joined through the
gRPC metadata of real calls (the services share this process and its in-memory exporter)."""

from __future__ import annotations

import time

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from service_stack import start_stack, stop_stack

from specdec.client import build_request
from specdec.rpc import tracing
from specdec.v1 import coordinator_pb2_grpc

PROPOSE, VERIFY = "/specdec.v1.DraftService/Propose", "/specdec.v1.TargetService/Verify"
STREAM = "/specdec.v1.Coordinator/GenerateStream"


@pytest.fixture()
def traced_stack(tiny_loaded, tiny_model_dirs, redis_url):
    """A stack of its own, built after tracing is on: interceptors are chosen when servers and
    channels are built."""
    exporter = InMemorySpanExporter()
    tracing.configure_tracing("specdec-test", "", exporter=exporter)
    stack = start_stack(tiny_loaded, tiny_model_dirs["target"], redis_url)
    try:
        yield stack, exporter
    finally:
        stop_stack(stack)
        tracing.disable_tracing()


def _finished(exporter, name: str, timeout_s: float = 5.0):
    """The spans once one named `name` has ended (a server span ends as its last message leaves)."""
    deadline = time.monotonic() + timeout_s
    while not any(s.name == name and s.kind == SpanKind.SERVER for s in exporter.get_finished_spans()):
        assert time.monotonic() < deadline, f"no {name} server span"
        time.sleep(0.05)
    return exporter.get_finished_spans()


def test_one_request_is_one_trace_across_coordinator_draft_and_target(traced_stack):
    stack, exporter = traced_stack
    request = build_request([3, 1, 4, 1, 5], max_new_tokens=6, seed=3, num_speculative_tokens=2, ignore_eos=True)
    with stack.channel() as channel:
        chunks = list(coordinator_pb2_grpc.CoordinatorStub(channel).GenerateStream(request, timeout=60))
    final = chunks[-1]
    spans = _finished(exporter, STREAM)
    (generate,) = [s for s in spans if s.name == "specdec.generate_stream"]
    trace = [s for s in spans if s.context.trace_id == generate.context.trace_id]
    by_id = {s.context.span_id: s for s in trace}

    def parent(span):
        return by_id[span.parent.span_id]

    (server,) = [s for s in trace if s.name == STREAM]
    assert server.kind == SpanKind.SERVER and parent(generate) is server
    rounds = [s for s in trace if s.name == "specdec.round"]
    assert len(rounds) == final.stats.rounds and all(parent(r) is generate for r in rounds)
    assert sum(r.attributes["specdec.accepted_tokens"] for r in rounds) == final.stats.accepted_tokens
    for method, calls in ((PROPOSE, 1), (VERIFY, final.stats.rounds)):
        clients = [s for s in trace if s.name == method and s.kind == SpanKind.CLIENT]
        served = [s for s in trace if s.name == method and s.kind == SpanKind.SERVER]
        assert len(clients) >= calls and len(served) == len(clients), method
        assert all(parent(c).name == "specdec.round" for c in clients)
        # Each pool's server span hangs under the coordinator's client span, received in metadata.
        assert {parent(s).context.span_id for s in served} == {c.context.span_id for c in clients}
        assert all(s.parent.is_remote for s in served)
    attributes = generate.attributes
    assert attributes["specdec.session_id"] == final.session_id and attributes["specdec.k_policy"] == "2"
    assert attributes["specdec.generated_tokens"] == final.stats.generated_tokens == 6
    assert attributes["specdec.accepted_tokens"] == final.stats.accepted_tokens
    assert generate.resource.attributes["service.name"] == "specdec-test"
