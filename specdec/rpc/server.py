"""What every gRPC service of the project shares: server setup, health, reflection, metrics,
shutdown (the model services' own part is `specdec.rpc.model_service`)."""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable, Iterable
from concurrent import futures
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from specdec.rpc import logs, tracing
from specdec.rpc.metrics import MetricsInterceptor, Registry, serve_metrics
from specdec.rpc.tls import TlsFiles, server_credentials

log = logging.getLogger(__name__)


def grpc_message_options(max_message_mb: int) -> list[tuple[str, int]]:
    size = max_message_mb * 1024 * 1024
    return [("grpc.max_send_message_length", size), ("grpc.max_receive_message_length", size)]


def connection_age_options(max_connection_age_s: float) -> list[tuple[str, int]]:
    """Close client connections after this age (0 = never), so that clients using
    round_robin over DNS re-resolve and spread load onto pods added by an autoscaler."""
    if max_connection_age_s <= 0:
        return []
    age_ms = int(max_connection_age_s * 1000)
    return [("grpc.max_connection_age_ms", age_ms), ("grpc.max_connection_age_grace_ms", age_ms)]


# Accept the keepalive pings clients send between calls (the coordinator's pool channels: every
# KEEPALIVE_S, at least MIN_KEEPALIVE_S): by default a server takes a ping without a call in
# flight as abuse and closes the connection (GOAWAY too_many_pings), so idle pool channels dropped.
MIN_KEEPALIVE_S = 1.0
KEEPALIVE_SERVER_OPTIONS = [
    ("grpc.keepalive_permit_without_calls", 1),
    # Half the shortest client interval: pings sent on time must never arrive "too early".
    ("grpc.http2.min_ping_interval_without_data_ms", int(MIN_KEEPALIVE_S * 500)),
]


@dataclass
class GrpcServer:
    server: grpc.Server
    port: int
    health: health.HealthServicer
    service_names: tuple[str, ...]
    registry: Registry
    metrics_port: int | None  # None: no /metrics endpoint
    # Set by a signal or by a fatal start-up error (e.g. the model failed to load).
    stop_requested: threading.Event = field(default_factory=threading.Event)
    failed: bool = False
    # Threads that finish a requested stop (a model's close): serve_until_signal waits for them,
    # since a process that exits with its model still open dies in C++ instead of exiting 0.
    closers: list[threading.Thread] = field(default_factory=list)

    def set_serving(self, serving: bool = True) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", *self.service_names):
            self.health.set(name, status)


def build_grpc_server(
    host: str,
    port: int,
    max_workers: int,
    max_message_mb: int,
    register: Callable[[grpc.Server], None],
    service_names: Iterable[str],
    metrics_label: str,
    metrics_port: int = -1,
    registry: Registry | None = None,
    max_connection_age_s: float = 0.0,
    max_concurrent_requests: int = 0,
    tls: TlsFiles | None = None,
) -> GrpcServer:
    """A ready-to-start server with health (NOT_SERVING until `set_serving`), reflection and metrics.

    Binds host:port; port 0 picks a free one (tests). metrics_port: -1 = no
    /metrics endpoint, 0 = any free port. `tls`: serve TLS (certificate files re-read when they
    change; mutual TLS with a client CA), None = plaintext. Raises RuntimeError if binding fails.
    """
    registry = registry or Registry()
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers),
        # No SO_REUSEPORT: a second server on a taken port must fail to bind, not silently
        # share it (the kernel would split connections between the two, including one that
        # is shutting down: "connection refused" for a fraction of clients).
        options=[("grpc.so_reuseport", 0)]
        + grpc_message_options(max_message_mb)
        + connection_age_options(max_connection_age_s)
        + KEEPALIVE_SERVER_OPTIONS,
        # Tracing outermost: a call refused at capacity still has its span.
        interceptors=[
            *tracing.server_interceptors(),
            MetricsInterceptor(registry, metrics_label, max_concurrent_requests),
        ],
    )
    register(server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = tuple(service_names)
    reflection.enable_server_reflection((*names, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    bound = _add_port(server, f"{host}:{port}", tls, metrics_label)
    if bound == 0:
        raise RuntimeError(f"could not bind {host}:{port}")
    metrics_bound = None
    if metrics_port >= 0:
        metrics_bound = serve_metrics(registry, host, metrics_port).server_port
    result = GrpcServer(server, bound, health_servicer, names, registry, metrics_bound)
    result.set_serving(False)
    return result


def _add_port(server: grpc.Server, address: str, tls: TlsFiles | None, label: str) -> int:
    if tls is None:
        log.warning("%s serves plaintext gRPC on %s (no TLS certificate configured)", label, address)
        return server.add_insecure_port(address)
    mode = "mutual TLS" if tls.client_ca_file else "TLS"
    log.info("%s serves %s on %s with %s", label, mode, address, tls.cert_file)
    return server.add_secure_port(address, server_credentials(tls))


CLOSER_WAIT_S = 10.0  # the longest a stop waits for each closer after the drain


def serve_until_signal(grpc_server: GrpcServer, grace_s: float, on_stop: Callable[[], None] | None = None) -> int:
    """Block until SIGTERM/SIGINT, then report NOT_SERVING and drain in-flight calls for `grace_s`.

    Returns the process exit code (1 if the server failed during start-up).
    """
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: grpc_server.stop_requested.set())
    while not grpc_server.stop_requested.wait(0.5):
        pass
    log.info("stopping: draining in-flight calls for up to %.1fs", grace_s)
    grpc_server.set_serving(False)
    grpc_server.server.stop(grace_s).wait()
    for closer in grpc_server.closers:
        closer.join(CLOSER_WAIT_S)
    if on_stop is not None:
        on_stop()
    return 1 if grpc_server.failed else 0


def configure_logging(level: str, log_format: str = "text") -> None:
    logs.configure_logging(level, log_format)


def configure_observability(service_name: str, settings) -> None:
    """A service process's log format and tracing, from its settings (`log_format`,
    `otlp_endpoint`); the defaults (text, no endpoint) change nothing. Before its server is built:
    the server's interceptors depend on it."""
    logs.use_format(settings.log_format)
    tracing.configure_tracing(service_name, settings.otlp_endpoint)
