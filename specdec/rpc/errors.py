"""The decorator that turns the project's typed errors (`specdec.core.errors`) into gRPC statuses.

Servicers never build statuses by hand, and no stack trace reaches a client.
"""

from __future__ import annotations

import functools
import inspect
import logging

import grpc

from specdec.core.errors import HiddenStatesMiss, NoTargetLookup, ServiceError

log = logging.getLogger(__name__)

REASON_KEY = "specdec-reason"
# On an error that ends a stream after it saved tokens: the session `resume` finishes.
SESSION_KEY = "specdec-session-id"
# ServiceError subclasses a client rebuilds from the reason a status carries.
_BY_REASON: dict[str, type[ServiceError]] = {e.reason: e for e in (HiddenStatesMiss, NoTargetLookup)}


def status_for(exc: Exception) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, ServiceError):
        return grpc.StatusCode.__members__.get(exc.code, grpc.StatusCode.INTERNAL), str(exc)
    log.exception("unhandled error")
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"


def error_from_reason(metadata, message: str) -> ServiceError | None:
    """The typed error a status's trailing metadata names (`REASON_KEY`), or None."""
    for key, value in metadata or ():
        if key == REASON_KEY and value in _BY_REASON:
            return _BY_REASON[value](message)
    return None


def _abort(context, exc: Exception) -> None:
    metadata = []
    if isinstance(exc, ServiceError) and exc.reason:
        metadata.append((REASON_KEY, exc.reason))
    if getattr(exc, "session_id", ""):  # a stream cut off mid-way: the session to resume
        metadata.append((SESSION_KEY, exc.session_id))
    if metadata:
        context.set_trailing_metadata(tuple(metadata))
    context.abort(*status_for(exc))


def grpc_errors(method):
    """Servicer-method decorator: exceptions -> context.abort(code, message). Unary and streaming."""
    if inspect.isgeneratorfunction(method):

        @functools.wraps(method)
        def stream_wrapper(self, request, context):
            try:
                yield from method(self, request, context)
            except Exception as exc:  # noqa: BLE001 - every error becomes a status
                _abort(context, exc)

        return stream_wrapper

    @functools.wraps(method)
    def wrapper(self, request, context):
        try:
            return method(self, request, context)
        except Exception as exc:  # noqa: BLE001 - every error becomes a status
            _abort(context, exc)

    return wrapper
