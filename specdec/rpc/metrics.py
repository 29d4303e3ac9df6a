"""Prometheus metrics (prometheus_client): one registry per service, served on /metrics, and a
gRPC interceptor that counts calls, their status, their duration and the calls in flight.

`specdec_inflight_requests` is the per-pod load signal the pools and coordinators autoscale on (the HPAs and
k8s/monitoring/prometheus-adapter-values.yaml name it). Every name a dashboard may use is a
constant or a literal in this module; README "Metrics and tracing" lists them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import grpc
import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from specdec.core.errors import AtCapacity
from specdec.core.kpolicy import RECORD_EXPLORE_EVERY
from specdec.rpc.errors import REASON_KEY

# `REASON_KEY` of an admission refusal: the pod is at max_concurrent_requests.
AT_CAPACITY = AtCapacity.reason
INFLIGHT_METRIC = "specdec_inflight_requests"

# The *_created series prometheus_client adds to every counter and histogram double the series
# count for a timestamp no dashboard here reads.
prometheus_client.disable_created_metrics()

# Seconds, 1-2.5-5 per decade from 0.1 ms to 60 s: one ladder fits both ends of what is served.
# On a GPU a step, a Propose or a Verify takes well under a millisecond to a few ms; on a CPU the
# default target's step takes 100-700 ms and a request tens of seconds. Buckets 2.5x apart put a
# percentile within that factor anywhere on that range, for 18 series per histogram.
LATENCY_BUCKETS = (
    0.0001, 0.00025, 0.0005,
    0.001, 0.0025, 0.005,
    0.01, 0.025, 0.05,
    0.1, 0.25, 0.5,
    1.0, 2.5, 5.0,
    10.0, 25.0, 60.0,
)  # fmt: skip
# A whole call may stream for minutes (4096 tokens at CPU speed).
REQUEST_BUCKETS = (*LATENCY_BUCKETS, 120.0, 300.0, 600.0)
# Tokens one sequence gains in a round: 1..K+1, K up to the model services' 32 (exact below 10).
TOKENS_PER_ROUND_BUCKETS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 11, 13, 17, 25, 33)
# Sequences in one batched model step: powers of two up to the 8192 one call may carry.
STEP_SEQUENCES_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


class _Observed(Collector):
    """A counter or gauge read at scrape time from state another object owns (a KV cache)."""

    def __init__(self, name: str, help_text: str, kind: str, labels: dict[str, str], read: Callable[[], float]):
        family = {"counter": CounterMetricFamily, "gauge": GaugeMetricFamily}[kind]
        self._family = lambda: family(name, help_text, labels=list(labels))
        self._values = list(labels.values())
        self._read = read

    def describe(self):
        return [self._family()]  # names only: registering must not read the state yet

    def collect(self):
        family = self._family()
        family.add_metric(self._values, float(self._read()))
        return [family]


class _DraftRecords(Collector):
    """auto K's records of the model draft (`kpolicy.DraftRecord`, greedy and sampled requests
    apart) as read at scrape time: an operator's answer to "why does auto K not draft?"."""

    SAMPLING = {True: "greedy", False: "sampled"}

    def __init__(self, records: Mapping[bool, Any]):
        self._records = records

    @staticmethod
    def _families() -> list[GaugeMetricFamily]:
        return [
            GaugeMetricFamily(
                "specdec_draft_record_verdict",
                "auto K's verdict on the draft model from finished requests: 1 it drafts, 0 it is not called "
                f"(but by one request in {RECORD_EXPLORE_EVERY}, which explores), -1 too few positions recorded yet",
                labels=["sampling"],
            ),
            GaugeMetricFamily(
                "specdec_draft_record_positions",
                "model-drawn drafts the record weighs at the first position (counts halve past its half-life)",
                labels=["sampling"],
            ),
            GaugeMetricFamily(
                "specdec_draft_record_acceptance",
                "the record's acceptance of model-drawn drafts at the first position",
                labels=["sampling"],
            ),
        ]

    def describe(self):
        return self._families()  # names only: registering must not read the records yet

    def collect(self):
        verdict, positions, acceptance = families = self._families()
        for greedy, record in self._records.items():
            offered, accepted, pays = record.summary()
            label = [self.SAMPLING[greedy]]
            verdict.add_metric(label, -1.0 if pays is None else float(pays))
            positions.add_metric(label, offered)
            if accepted is not None:
                acceptance.add_metric(label, accepted)
        return families


class Registry:
    """One service's metrics: its own CollectorRegistry, so several services in one process
    (tests) never share or collide on a series."""

    def __init__(self):
        self.collectors = CollectorRegistry()
        self._observed: dict[str, _Observed] = {}
        self._lock = threading.Lock()

    def counter(self, name: str, help_text: str, labels: Sequence[str] = ()) -> Counter:
        return _named(Counter(name, help_text, labels, registry=self.collectors), name)

    def gauge(self, name: str, help_text: str, labels: Sequence[str] = ()) -> Gauge:
        return _named(Gauge(name, help_text, labels, registry=self.collectors), name)

    def histogram(self, name: str, help_text: str, labels: Sequence[str] = (), buckets=LATENCY_BUCKETS) -> Histogram:
        return _named(Histogram(name, help_text, labels, registry=self.collectors, buckets=buckets), name)

    def observe(self, name: str, help_text: str, kind: str, labels: dict[str, str], read: Callable[[], float]) -> None:
        """Expose `read()` as a `kind` ("counter" / "gauge") metric with fixed labels; observing
        the same name again replaces it (a model re-attached)."""
        collector = _Observed(name, help_text, kind, labels, read)
        with self._lock:
            old = self._observed.pop(name, None)
            if old is not None:
                self.collectors.unregister(old)
            self.collectors.register(collector)
            self._observed[name] = collector

    def render(self) -> str:
        """The Prometheus text format, as /metrics serves it."""
        return prometheus_client.generate_latest(self.collectors).decode()

    def value(self, name: str, **labels: str) -> float | None:
        """A sample's current value (e.g. "specdec_requests_total", service=..., method=..., code=...)."""
        return self.collectors.get_sample_value(name, labels)


def sample_value(text: str, name: str, **labels: str) -> float | None:
    """A sample's value in a /metrics body (labels compared as a set, whatever their order), None
    when absent."""
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return sample.value
    return None


def _named(metric, name: str):
    # prometheus_client keeps a counter's name without "_total": `name` is the exposed one.
    metric.name = name
    return metric


class MetricsInterceptor(grpc.ServerInterceptor):
    """Counts every unary/stream call by method and status, times it, tracks calls in flight.

    With `max_concurrent` > 0 it is also the admission control: a call beyond that many in
    flight gets RESOURCE_EXHAUSTED at once instead of queueing for a worker thread, which
    keeps threads free for health probes (they are never counted or refused).
    """

    def __init__(self, registry: Registry, service: str, max_concurrent: int = 0):
        self.service = service
        self.max_concurrent = max_concurrent
        self._admitted = 0
        self._admission_lock = threading.Lock()
        self.inflight = registry.gauge(INFLIGHT_METRIC, "gRPC calls being served", ("service",))
        self.calls = registry.counter("specdec_requests_total", "gRPC calls served", ("service", "method", "code"))
        self.duration = registry.histogram(
            "specdec_request_duration_seconds",
            "seconds from a gRPC call's start to its end (a stream: its last message)",
            ("service", "method"),
            REQUEST_BUCKETS,
        )
        self.inflight.labels(service=service).set(0)

    def _admit(self) -> bool:
        with self._admission_lock:
            if self.max_concurrent and self._admitted >= self.max_concurrent:
                return False
            self._admitted += 1
            return True

    @contextmanager
    def _observe(self, method: str, context) -> Iterator[None]:
        if not self._admit():
            self.calls.labels(service=self.service, method=method, code="RESOURCE_EXHAUSTED").inc()
            # The reason tells a client this RESOURCE_EXHAUSTED may succeed on another pod or a
            # little later (a message over the size limit would not).
            context.set_trailing_metadata(((REASON_KEY, AT_CAPACITY),))
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{self.service} is at capacity ({self.max_concurrent} calls in flight); retry shortly",
            )
        inflight = self.inflight.labels(service=self.service)
        inflight.inc()
        started = time.perf_counter()
        code = "UNKNOWN"
        try:
            yield
            code = _code_of(context)
        except Exception:
            code = _code_of(context)
            code = "INTERNAL" if code == "OK" else code
            raise
        finally:
            with self._admission_lock:
                self._admitted -= 1
            inflight.dec()
            self.calls.labels(service=self.service, method=method, code=code).inc()
            self.duration.labels(service=self.service, method=method).observe(time.perf_counter() - started)

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        method = handler_call_details.method.rsplit("/", 1)[-1]
        if handler is None or method in ("Check", "Watch") or "Reflection" in handler_call_details.method:
            return handler
        if handler.unary_unary:
            inner = handler.unary_unary

            def unary(request, context):
                with self._observe(method, context):
                    return inner(request, context)

            return grpc.unary_unary_rpc_method_handler(unary, handler.request_deserializer, handler.response_serializer)
        if handler.unary_stream:
            inner_stream = handler.unary_stream

            def stream(request, context):
                with self._observe(method, context):
                    yield from inner_stream(request, context)

            return grpc.unary_stream_rpc_method_handler(
                stream, handler.request_deserializer, handler.response_serializer
            )
        return handler


def _code_of(context) -> str:
    code = context.code() if hasattr(context, "code") else None
    return code.name if isinstance(code, grpc.StatusCode) else "OK"


class GenerationMetrics:
    """The coordinator's view of generation: latencies, rounds and the spec-decode counters.

    The spec-decode counters mean what vLLM's do, counted per sequence per round: a draft is a
    round in which a sequence was proposed at least one token; `accepted_per_pos[i]` counts drafts
    whose token at position i was accepted (so position 0 / num_drafts is the first token's
    acceptance rate, and the sum over positions is num_accepted_tokens).
    """

    def __init__(self, registry: Registry, positions: int = 0):
        """`positions`: the per-position series exported from the start, at 0 (the largest K),
        so that a rate over them starts from a sample instead of from the first acceptance."""
        self.tokens = registry.counter(
            "specdec_tokens_total", "tokens by kind: prompt, generated, drafted, accepted", ("kind",)
        )
        self.rounds = registry.counter("specdec_rounds_total", "speculative rounds run")
        self.ttft = registry.histogram(
            "specdec_time_to_first_token_seconds",
            "seconds from a request's arrival to its first token",
            (),
            REQUEST_BUCKETS,
        )
        self.inter_token = registry.histogram(
            "specdec_inter_token_latency_seconds",
            "seconds between a request's consecutive chunks of tokens (a round's, or a call's decode steps')",
        )
        self.draft_s = registry.histogram("specdec_round_draft_seconds", "seconds of a round's Propose call")
        self.verify_s = registry.histogram(
            "specdec_round_verify_seconds", "seconds of a round's Verify call (of all its decode steps)"
        )
        self.tokens_per_round = registry.histogram(
            "specdec_tokens_per_round", "tokens one sequence gained in one round", (), TOKENS_PER_ROUND_BUCKETS
        )
        prefix = "specdec_spec_decode_"
        self.num_drafts = registry.counter(f"{prefix}num_drafts_total", "sequence-rounds that drafted >= 1 token")
        self.num_draft_tokens = registry.counter(f"{prefix}num_draft_tokens_total", "draft tokens proposed")
        self.num_accepted = registry.counter(f"{prefix}num_accepted_tokens_total", "draft tokens accepted")
        self.accepted_per_pos = registry.counter(
            f"{prefix}num_accepted_tokens_per_pos_total",
            "drafts whose token at this position was accepted",
            ("position",),
        )
        for position in range(positions):
            self.accepted_per_pos.labels(position=str(position))

    def round(self, draft_s: float | None, verify_s: float, sequences: Iterable[tuple[int, int, int]]) -> None:
        """One round: its Propose seconds (None: no Propose), its Verify seconds, and per sequence
        (drafted, accepted, tokens gained)."""
        if draft_s is not None:
            self.draft_s.observe(draft_s)
        self.verify_s.observe(verify_s)
        for drafted, accepted, gained in sequences:
            self.tokens_per_round.observe(gained)
            if drafted:
                self.num_drafts.inc()
                self.num_draft_tokens.inc(drafted)
                self.num_accepted.inc(accepted)
            for position in range(accepted):
                self.accepted_per_pos.labels(position=str(position)).inc()

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def next_tokens(self, seconds: float) -> None:
        self.inter_token.observe(seconds)

    def finished(self, prompt: int, generated: int, drafted: int, accepted: int, rounds: int) -> None:
        for kind, value in (("prompt", prompt), ("generated", generated), ("drafted", drafted), ("accepted", accepted)):
            self.tokens.labels(kind=kind).inc(value)
        self.rounds.inc(rounds)


def observe_draft_records(registry: Registry, records: Mapping[bool, Any]) -> None:
    """The engine's `records` (greedy -> `kpolicy.DraftRecord`) as gauges read at each scrape."""
    registry.collectors.register(_DraftRecords(records))


def observe_call_batching(registry: Registry, stats) -> None:
    """The coordinator's Verify calls and the calls they went to the target pool as
    (`specdec.core.call_batching.BatchStats`), read at each scrape."""
    for name, help_text, read in (
        ("specdec_verify_calls_total", "requests' Verify calls (each one round of one request)", lambda: stats.calls),
        ("specdec_verify_batches_total", "calls to the target pool that carried them", lambda: stats.batches),
        (
            "specdec_verify_retried_alone_total",
            "requests' Verify calls sent again alone after the batch they were in failed",
            lambda: stats.retried_alone,
        ),
    ):
        registry.observe(name, help_text, "counter", {}, read)


def observe_suffix_cache(registry: Registry, service: str, read: Callable[[], float]) -> None:
    """The suffix draft's cache size, where it runs (the draft service, a coordinator's LOCAL_DRAFT or a
    target's LOOKUP)."""
    registry.observe(
        "specdec_suffix_cache_tokens",
        "tokens the suffix draft keeps indexed across sessions",
        "gauge",
        {"service": service},
        read,
    )


def observe_draft_health(registry: Registry, health) -> None:
    """The draft pool's health (`specdec.core.draft_health.DraftHealth`) as read at each scrape."""
    registry.observe(
        "specdec_draft_fallback_rounds_total",
        "rounds run at K=0 because the draft pool failed or was backing off",
        "counter",
        {},
        lambda: health.fallback_rounds,
    )
    registry.observe(
        "specdec_draft_failures_total",
        "Propose / Info calls to the draft pool that failed",
        "counter",
        {},
        lambda: health.failures,
    )
    registry.observe(
        "specdec_draft_healthy",
        "1 while the draft pool is used, 0 while it backs off",
        "gauge",
        {},
        lambda: float(health.healthy),
    )


def serve_metrics(registry: Registry, host: str, port: int):
    """GET /metrics in Prometheus text format on a daemon thread. Returns the HTTP server (port
    via server_port)."""
    server, _ = prometheus_client.start_http_server(port, host, registry.collectors)
    return server
