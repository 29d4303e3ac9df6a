"""Errors that carry their gRPC status, and the decorator that turns them into one.

Domain code raises these; servicers never build statuses by hand, and no
stack trace reaches a client.
"""

from __future__ import annotations

import functools
import inspect
import logging

import grpc

from specdec.sampling import InconsistentDraftError, NonFiniteLogitsError

log = logging.getLogger(__name__)


class ServiceError(Exception):
    code = grpc.StatusCode.INTERNAL

    def __init__(self, message: str, code: grpc.StatusCode | None = None):
        super().__init__(message)
        if code is not None:
            self.code = code


class InvalidArgument(ServiceError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(ServiceError):
    code = grpc.StatusCode.NOT_FOUND


class FailedPrecondition(ServiceError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class Aborted(ServiceError):
    code = grpc.StatusCode.ABORTED


class Unavailable(ServiceError):
    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(ServiceError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


def _status_for(exc: Exception) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, ServiceError):
        return exc.code, str(exc)
    if isinstance(exc, (NonFiniteLogitsError, InconsistentDraftError)):
        return grpc.StatusCode.INTERNAL, str(exc)
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
                context.abort(*_status_for(exc))

        return stream_wrapper

    @functools.wraps(method)
    def wrapper(self, request, context):
        try:
            return method(self, request, context)
        except Exception as exc:  # noqa: BLE001 - every error becomes a status
            context.abort(*_status_for(exc))

    return wrapper
