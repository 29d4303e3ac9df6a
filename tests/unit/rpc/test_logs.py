"""JSON log lines and the request / session / trace ids they carry."""

from __future__ import annotations

import io
import json
import logging

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from specdec.rpc import logs, tracing


@pytest.fixture()
def json_lines():
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logs.JsonFormatter())
    logger = logging.getLogger("specdec.test_logs")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    # An in-process Generator called by an earlier test binds its session in this thread's context.
    ids = logs.request_id.set(""), logs.session_id.set("")
    yield logger, lambda: [json.loads(line) for line in stream.getvalue().splitlines()]
    logs.request_id.reset(ids[0])
    logs.session_id.reset(ids[1])
    logger.removeHandler(handler)


def test_a_line_is_one_json_object_with_the_ids_of_its_request(json_lines):
    logger, lines = json_lines
    logger.info("outside any request")
    with logs.log_context("req-1"):
        logger.warning("before the session is known: %s", "x")
        logs.bind_session("abc123")
        logger.info('with "quotes" and\nnewlines')
    logger.info("after")
    outside, before, inside, after = lines()
    assert set(outside) == {"timestamp", "level", "logger", "message"}
    assert outside["logger"] == "specdec.test_logs" and outside["level"] == "INFO"
    assert outside["timestamp"].endswith("+00:00")
    assert before["message"] == "before the session is known: x" and before["request_id"] == "req-1"
    assert "session_id" not in before
    assert inside["message"] == 'with "quotes" and\nnewlines' and inside["session_id"] == "abc123"
    assert "request_id" not in after and "session_id" not in after  # reset on exit, bind_session too


def test_exceptions_and_trace_ids_are_fields(json_lines):
    logger, lines = json_lines
    tracing.configure_tracing("specdec-test", "", exporter=InMemorySpanExporter())
    try:
        with tracing.span("specdec.generate") as span:
            try:
                raise ValueError("boom")
            except ValueError:
                logger.exception("failed")
    finally:
        tracing.disable_tracing()
    (line,) = lines()
    assert line["level"] == "ERROR" and "ValueError: boom" in line["exception"]
    assert line["trace_id"] == format(span.get_span_context().trace_id, "032x")


def test_log_format_is_checked():
    with pytest.raises(ValueError, match="text, json"):
        logs.check_log_format("yaml")
