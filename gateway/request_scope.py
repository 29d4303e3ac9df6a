"""ASGI middleware: each HTTP request's id, log context, SERVER span and access log line.

The request id is the client's `X-Request-Id` when it is a short token, else a new one. It is
returned in the response's `x-request-id` header, forwarded to the coordinator as its
`x-request-id` metadata (which keeps it), and carried by every line logged for the request.

With tracing on, each request is a SERVER span (a child of the caller's `traceparent`, if any),
current while the handler runs: the coordinator call's client span, and through it the
coordinator's and the pools' spans, join its trace. Pure ASGI, like `HttpMetrics`: a stream is
one span to its last byte.
"""

from __future__ import annotations

import logging
import time
from contextlib import AbstractContextManager, nullcontext

from opentelemetry import propagate
from opentelemetry.trace import SpanKind, Status, StatusCode

from gateway.http_metrics import route_of
from specdec.rpc import tracing
from specdec.rpc.logs import REQUEST_ID_KEY, log_context, request_id_or_new

log = logging.getLogger("gateway.access")

REQUEST_ID_HEADER = REQUEST_ID_KEY
# Probes and scrapes every few seconds would drown the traces and logs of requests (as health
# and reflection are untraced on the gRPC side): no span, and an access line only when they fail.
PROBE_ROUTES = frozenset({"/health", "/metrics"})


def request_id_of(headers: list[tuple[bytes, bytes]]) -> str:
    """The client's X-Request-Id when it is a short token, else a new random one."""
    given = next((value for key, value in headers if key == REQUEST_ID_HEADER.encode()), b"")
    return request_id_or_new(given.decode("latin-1"))


def _server_span(scope, route: str) -> AbstractContextManager:
    tracer = tracing.tracer("specdec.gateway")
    if tracer is None or route in PROBE_ROUTES:
        return nullcontext()
    carrier = {key.decode("latin-1"): value.decode("latin-1") for key, value in scope["headers"]}
    attributes = {"http.request.method": scope["method"], "http.route": route, "url.scheme": scope["scheme"]}
    return tracer.start_as_current_span(
        f"{scope['method']} {route}", context=propagate.extract(carrier), kind=SpanKind.SERVER, attributes=attributes
    )


class RequestScope:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        request_id, route = request_id_of(scope["headers"]), route_of(scope["path"])
        scope.setdefault("state", {})["request_id"] = request_id  # request.state.request_id
        started, status = time.perf_counter(), 500

        async def send_with_id(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message["headers"] = [*message.get("headers", []), (b"x-request-id", request_id.encode())]
            await send(message)

        with log_context(request_id), _server_span(scope, route) as span:
            try:
                await self.app(scope, receive, send_with_id)
            finally:
                if span is not None:
                    span.set_attribute("http.response.status_code", status)
                    if status >= 500:
                        span.set_status(Status(StatusCode.ERROR))
                level = logging.DEBUG if route in PROBE_ROUTES and status < 400 else logging.INFO
                # The route, not the path: a client's path may hold anything, newlines included.
                log.log(level, "%s %s %d %.3fs", scope["method"], route, status, time.perf_counter() - started)
