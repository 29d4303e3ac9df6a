"""Logging setup shared by the services: text or JSON lines, carrying the ids of the request a
line was written for.

The coordinator binds a request id and, once known, the session id to the handling thread's
context (`log_context`, `bind_session`); a line written meanwhile, in any module, carries them,
and the trace id when the line is written inside a traced span.
"""

from __future__ import annotations

import json
import logging
import re
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import UTC, datetime

from specdec.rpc.tracing import current_trace_id

LOG_FORMATS = ("text", "json")
# A caller's request id (metadata / HTTP header), kept when it is a short token.
REQUEST_ID_KEY = "x-request-id"
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,64}")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

request_id: ContextVar[str] = ContextVar("specdec_request_id", default="")
session_id: ContextVar[str] = ContextVar("specdec_session_id", default="")


def request_id_or_new(given: object) -> str:
    """`given` when it is a sane request id (a short token), else a new random one."""
    return given if isinstance(given, str) and _REQUEST_ID.fullmatch(given) else secrets.token_hex(8)


@contextmanager
def log_context(request: str = "", session: str = "") -> Iterator[None]:
    """Lines logged in this block (this thread or task) carry these ids. On exit both ids are
    what they were before, whatever `bind_session` set meanwhile: a pooled worker thread's next
    call starts clean."""
    tokens = (request_id.set(request), session_id.set(session))
    try:
        yield
    finally:
        for var, token in zip((request_id, session_id), tokens, strict=True):
            try:
                var.reset(token)
            except ValueError:  # a stream's generator closed from another context: it ends there anyway
                pass


def bind_session(session: str) -> None:
    """The session of the current `log_context`, once it is known."""
    session_id.set(session)


class JsonFormatter(logging.Formatter):
    """One JSON object per line: timestamp (UTC, ISO 8601), level, logger, message, the request,
    session and trace ids when known, and the exception's traceback when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        line = {
            "timestamp": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in (
            ("request_id", request_id.get()),
            ("session_id", session_id.get()),
            ("trace_id", current_trace_id()),
        ):
            if value:
                line[key] = value
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False)


def check_log_format(log_format: str) -> None:
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log_format must be one of {', '.join(LOG_FORMATS)}, got {log_format!r}")


def configure_logging(level: str, log_format: str = "text") -> None:
    """The root logger at `level`, writing `log_format` lines ("text" or "json") to stderr."""
    check_log_format(log_format)
    logging.basicConfig(level=level.upper(), format=TEXT_FORMAT)
    use_format(log_format)


def use_format(log_format: str) -> None:
    """Switch the root logger's handlers to `log_format` lines; "text" leaves them as they are."""
    if log_format == "json":
        for handler in logging.getLogger().handlers:
            handler.setFormatter(JsonFormatter())
