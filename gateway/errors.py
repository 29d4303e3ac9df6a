"""Errors as the OpenAI API reports them: `{"error": {"message", "type", "param", "code"}}` with
the HTTP status of the gRPC status (or typed error) behind them.

The gateway's own refusals are the project's typed errors (`specdec.core.errors`), so one table
turns both them and the coordinator's statuses into HTTP. A 5xx never carries the detail (it may
name an internal address); the log does.
"""

from __future__ import annotations

import logging

import grpc

from specdec.core.errors import InvalidArgument, NotFound, ServiceError

log = logging.getLogger(__name__)

# gRPC status name -> HTTP status.
HTTP_STATUS = {
    "INVALID_ARGUMENT": 400,
    "OUT_OF_RANGE": 400,
    "FAILED_PRECONDITION": 400,  # e.g. draft and target tokenizers differ: the request cannot be served as asked
    "UNAUTHENTICATED": 401,
    "PERMISSION_DENIED": 403,
    "NOT_FOUND": 404,
    "ABORTED": 409,  # the session is busy with another call: retry after it
    "RESOURCE_EXHAUSTED": 429,
    "UNAVAILABLE": 503,
    "DEADLINE_EXCEEDED": 504,
}
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
}
_TYPES |= {409: "invalid_request_error", 429: "rate_limit_error"}
# What a client is told of a server-side failure.
_SERVER_MESSAGES = {
    503: "the model service is unavailable; retry later",
    504: "the request ran past its deadline",
    500: "internal error",
}


class BadField(InvalidArgument):
    """A request field the gateway refuses, named in the error body's `param`."""

    def __init__(self, message: str, param: str | None):
        super().__init__(message)
        self.param = param


class ModelNotFound(NotFound):
    def __init__(self, model: str, served: str):
        super().__init__(f"The model `{model[:100]}` does not exist; this server serves `{served}`.")
        self.param = "model"


def error_body(status: int, message: str, code: str, param: str | None = None) -> dict:
    kind = _TYPES.get(status, "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def from_service_error(exc: ServiceError) -> tuple[int, dict]:
    """(HTTP status, body) of a typed error raised by the gateway itself."""
    status = HTTP_STATUS.get(exc.code, 500)
    code = "model_not_found" if isinstance(exc, ModelNotFound) else exc.code.lower()
    return status, error_body(status, str(exc), code, getattr(exc, "param", None))


def from_rpc_error(exc: grpc.aio.AioRpcError) -> tuple[int, dict]:
    """(HTTP status, body) of a failed coordinator call."""
    name = exc.code().name
    status = HTTP_STATUS.get(name, 500)
    message = exc.details() or name
    if status >= 500:
        log.warning("coordinator call failed: %s: %s", name, message)
        message = _SERVER_MESSAGES.get(status, _SERVER_MESSAGES[500])
    return status, error_body(status, message, name.lower())
