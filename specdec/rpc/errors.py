"""The decorator that turns the project's typed errors (`specdec.core.errors`) into gRPC statuses.

Servicers never build statuses by hand, and no stack trace reaches a client.
"""

from __future__ import annotations

import functools
import inspect
import logging

import grpc

from specdec.core.errors import ServiceError

log = logging.getLogger(__name__)


def status_for(exc: Exception) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, ServiceError):
        return grpc.StatusCode.__members__.get(exc.code, grpc.StatusCode.INTERNAL), str(exc)
    log.exception("unhandled error")
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"


def grpc_errors(method):
    """Servicer-method decorator: exceptions -> context.abort(code, message). Unary and streaming."""
    if inspect.isgeneratorfunction(method):

        @functools.wraps(method)
        def stream_wrapper(self, request, context):
            try:
                yield from method(self, request, context)
            except Exception as exc:  # noqa: BLE001 - every error becomes a status
                context.abort(*status_for(exc))

        return stream_wrapper

    @functools.wraps(method)
    def wrapper(self, request, context):
        try:
            return method(self, request, context)
        except Exception as exc:  # noqa: BLE001 - every error becomes a status
            context.abort(*status_for(exc))

    return wrapper
