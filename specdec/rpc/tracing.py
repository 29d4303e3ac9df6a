"""OpenTelemetry tracing, off unless an OTLP endpoint is configured.

`configure_tracing(service, endpoint)` installs a TracerProvider exporting in batches to an OTLP
gRPC collector; until then (the default) every function here is a no-op: no interceptor is added
to a server or a channel and `span()` is a null context, so tracing costs nothing when it is off.
The trace context crosses each hop in gRPC metadata (W3C `traceparent`), carried by
opentelemetry-instrumentation-grpc's interceptors: the coordinator's Propose / Verify client
spans are the parents of the draft's and target's server spans.
"""

from __future__ import annotations

from collections import namedtuple
from contextlib import AbstractContextManager, nullcontext

import grpc
from opentelemetry import trace

_provider = None  # the SDK TracerProvider once configured, else None (tracing off)

# Health probes and reflection every few seconds would drown the traces of requests.
_UNTRACED_SERVICES = ("grpc.health.v1.Health", "grpc.reflection")


def configure_tracing(service_name: str, endpoint: str, exporter=None) -> None:
    """Trace this process as `service_name`, exporting to the OTLP gRPC `endpoint`
    (`http://host:4317` plaintext, `https://...` TLS); "" leaves tracing off. `exporter` (tests):
    export to it synchronously instead, e.g. an InMemorySpanExporter."""
    global _provider
    if not endpoint and exporter is None:
        return
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: service_name}))
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    else:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
        # The global provider can be set once per process: only a real endpoint takes it, so
        # that spans other libraries start join the same export.
        trace.set_tracer_provider(provider)
    _provider = provider


def disable_tracing() -> None:
    """Flush and stop this process's tracing (tests); servers and channels built since keep
    their interceptors, which then record nothing."""
    global _provider
    provider, _provider = _provider, None
    if provider is not None:
        provider.shutdown()


def tracing_enabled() -> bool:
    return _provider is not None


def tracer(name: str = "specdec"):
    """The configured provider's tracer; None while tracing is off."""
    return None if _provider is None else _provider.get_tracer(name)


def span(name: str, **attributes) -> AbstractContextManager:
    """A span as the current one for the block (yields it), or a null context (yields None)
    while tracing is off."""
    if _provider is None:
        return nullcontext()
    return _provider.get_tracer("specdec").start_as_current_span(name, attributes=attributes)


def current_trace_id() -> str:
    """The current span's trace id (32 hex digits), "" outside a sampled trace."""
    context = trace.get_current_span().get_span_context()
    return format(context.trace_id, "032x") if context.is_valid else ""


def _traced(details) -> bool:
    """Filter of the instrumentation's interceptors: server call details, or client call info."""
    method = getattr(details, "full_method", None) or getattr(details, "method", "")
    if isinstance(method, bytes):  # grpc.aio's client details (grpc/grpc#31092)
        method = method.decode()
    return not method.lstrip("/").startswith(_UNTRACED_SERVICES)


def server_interceptors() -> list:
    """For a sync grpc.server: a SERVER span per call, a child of the caller's span."""
    if _provider is None:
        return []
    from opentelemetry.instrumentation.grpc import server_interceptor

    return [server_interceptor(tracer_provider=_provider, filter_=_traced)]


def client_interceptors() -> list:
    """For `grpc.intercept_channel` on a sync channel: a CLIENT span per unary-unary call whose
    context travels in the call's metadata (other call kinds pass through untraced)."""
    if _provider is None:
        return []
    from opentelemetry.instrumentation.grpc import client_interceptor

    return [_UnaryClientAdapter(client_interceptor(tracer_provider=_provider, filter_=_traced))]


def aio_client_interceptors() -> list:
    """For `grpc.aio` channels (`interceptors=`): CLIENT spans for every call kind."""
    if _provider is None:
        return []
    from opentelemetry.instrumentation.grpc import aio_client_interceptors as make

    return make(tracer_provider=_provider, filter_=_traced)


# What the instrumentation's client interceptor reads of a call (its own grpcext API).
_ClientInfo = namedtuple("_ClientInfo", ("full_method", "timeout", "is_client_stream", "is_server_stream"))


class _CallDetails(
    namedtuple("_CallDetails", ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression")),
    grpc.ClientCallDetails,
):
    pass


class _UnaryClientAdapter(grpc.UnaryUnaryClientInterceptor):
    """The instrumentation's sync client interceptor speaks its own channel-wrapping API
    (grpcext); this puts it behind grpc's standard interceptor interface."""

    def __init__(self, inner):
        self._inner = inner

    def intercept_unary_unary(self, continuation, client_call_details, request):
        details = client_call_details

        def invoke(request, metadata):
            return continuation(
                _CallDetails(
                    details.method,
                    details.timeout,
                    metadata,
                    details.credentials,
                    details.wait_for_ready,
                    details.compression,
                ),
                request,
            )

        info = _ClientInfo(details.method, details.timeout, False, False)
        return self._inner.intercept_unary(request, details.metadata, info, invoke)
