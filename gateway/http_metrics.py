"""ASGI middleware: Prometheus counts and durations of HTTP requests.

Pure ASGI rather than FastAPI's `http` middleware: a streamed response is timed to its last
byte, not to its headers.
"""

from __future__ import annotations

import time

from prometheus_client import Counter, Histogram

ROUTES = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics"})
# Module level: the default registry takes each name once per process, however many apps.
REQUESTS = Counter("specdec_http_requests_total", "HTTP requests by route and status code", ("route", "code"))
DURATION = Histogram(
    "specdec_http_request_duration_seconds",
    "HTTP request duration, to the last byte of the response (a whole stream)",
    ("route",),
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600),
)


def route_of(path: str) -> str:
    """The route label: a served path, or "other" (any path a client invents must not grow the series)."""
    if path.startswith("/v1/models/"):
        return "/v1/models/{model}"
    return path if path in ROUTES else "other"


class HttpMetrics:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started, code = time.perf_counter(), "500"

        async def send_and_note(message):
            nonlocal code
            if message["type"] == "http.response.start":
                code = str(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            route = route_of(scope["path"])
            REQUESTS.labels(route, code).inc()
            DURATION.labels(route).observe(time.perf_counter() - started)
