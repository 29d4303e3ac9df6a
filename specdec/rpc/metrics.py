"""Prometheus metrics without a dependency: counters, gauges, an HTTP /metrics endpoint,
and a gRPC interceptor that counts calls, their status and the calls in flight.

`specdec_inflight_requests` is the per-pod load signal the model pools autoscale on.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc

from specdec.core.errors import AtCapacity
from specdec.rpc.errors import REASON_KEY

# `REASON_KEY` of an admission refusal: the pod is at max_concurrent_requests.
AT_CAPACITY = AtCapacity.reason


def _labels(names: tuple[str, ...], values: tuple[str, ...]) -> str:
    if not names:
        return ""
    escaped = (str(v).replace("\\", "\\\\").replace('"', '\\"') for v in values)
    inner = ",".join(f'{n}="{v}"' for n, v in zip(names, escaped, strict=True))
    return "{" + inner + "}"


class _Metric:
    kind = "untyped"

    def __init__(self, name: str, help_text: str, labels: tuple[str, ...] = ()):
        self.name = name
        self.help = help_text
        self.label_names = labels
        self._values: dict[tuple[str, ...], float] = defaultdict(float)
        self._lock = threading.Lock()

    def _key(self, labels: dict[str, str]) -> tuple[str, ...]:
        return tuple(str(labels.get(n, "")) for n in self.label_names)

    def value(self, **labels: str) -> float:
        with self._lock:
            return self._values.get(self._key(labels), 0.0)

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]
        with self._lock:
            items = sorted(self._values.items())
        lines += [f"{self.name}{_labels(self.label_names, key)} {value:.17g}" for key, value in items]
        return lines


class Counter(_Metric):
    kind = "counter"

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        with self._lock:
            self._values[self._key(labels)] += amount


class Gauge(_Metric):
    kind = "gauge"

    def add(self, amount: float, **labels: str) -> None:
        with self._lock:
            self._values[self._key(labels)] += amount

    def set(self, value: float, **labels: str) -> None:
        with self._lock:
            self._values[self._key(labels)] = value


class Observed(_Metric):
    """A counter or gauge read at scrape time from state another object owns (a KV cache)."""

    def __init__(self, name: str, help_text: str, kind: str, labels: dict[str, str], read: Callable[[], float]):
        super().__init__(name, help_text, tuple(labels))
        self.kind = kind
        self._label_values = tuple(labels.values())
        self._read = read

    def render(self) -> list[str]:
        with self._lock:
            self._values[self._label_values] = float(self._read())
        return super().render()


class Registry:
    def __init__(self):
        self._metrics: dict[str, _Metric] = {}
        self._lock = threading.Lock()

    def observe(self, name: str, help_text: str, kind: str, labels: dict[str, str], read: Callable[[], float]) -> None:
        """Expose `read()` as a `kind` ("counter" / "gauge") metric with fixed labels."""
        with self._lock:
            self._metrics[name] = Observed(name, help_text, kind, labels, read)

    def _get(self, cls, name: str, help_text: str, labels: tuple[str, ...]):
        with self._lock:
            if name not in self._metrics:
                self._metrics[name] = cls(name, help_text, labels)
            return self._metrics[name]

    def counter(self, name: str, help_text: str, labels: tuple[str, ...] = ()) -> Counter:
        return self._get(Counter, name, help_text, labels)

    def gauge(self, name: str, help_text: str, labels: tuple[str, ...] = ()) -> Gauge:
        return self._get(Gauge, name, help_text, labels)

    def render(self) -> str:
        with self._lock:
            metrics = list(self._metrics.values())
        return "\n".join(line for m in metrics for line in m.render()) + "\n"


class MetricsInterceptor(grpc.ServerInterceptor):
    """Counts every unary/stream call by method and status; tracks calls in flight.

    With `max_concurrent` > 0 it is also the admission control: a call beyond that many in
    flight gets RESOURCE_EXHAUSTED at once instead of queueing for a worker thread, which
    keeps threads free for health probes (they are never counted or refused).
    """

    def __init__(self, registry: Registry, service: str, max_concurrent: int = 0):
        self.service = service
        self.max_concurrent = max_concurrent
        self._admitted = 0
        self._admission_lock = threading.Lock()
        self.inflight = registry.gauge("specdec_inflight_requests", "gRPC calls being served", ("service",))
        self.calls = registry.counter("specdec_requests_total", "gRPC calls served", ("service", "method", "code"))
        self.seconds = registry.counter(
            "specdec_request_seconds_total", "seconds spent serving gRPC calls", ("service", "method")
        )
        self.inflight.set(0, service=service)

    def _admit(self) -> bool:
        with self._admission_lock:
            if self.max_concurrent and self._admitted >= self.max_concurrent:
                return False
            self._admitted += 1
            return True

    @contextmanager
    def _observe(self, method: str, context) -> Iterator[None]:
        if not self._admit():
            self.calls.inc(service=self.service, method=method, code="RESOURCE_EXHAUSTED")
            # The reason tells a client this RESOURCE_EXHAUSTED may succeed on another pod or a
            # little later (a message over the size limit would not).
            context.set_trailing_metadata(((REASON_KEY, AT_CAPACITY),))
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{self.service} is at capacity ({self.max_concurrent} calls in flight); retry shortly",
            )
        self.inflight.add(1, service=self.service)
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
            self.inflight.add(-1, service=self.service)
            self.calls.inc(service=self.service, method=method, code=code)
            self.seconds.inc(time.perf_counter() - started, service=self.service, method=method)

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


def serve_metrics(registry: Registry, host: str, port: int) -> ThreadingHTTPServer:
    """GET /metrics in Prometheus text format on a daemon thread. Returns the server (port via server_port)."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server API
            if self.path.split("?")[0] != "/metrics":
                self.send_error(404)
                return
            body = registry.render().encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):  # quiet
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
    return server
