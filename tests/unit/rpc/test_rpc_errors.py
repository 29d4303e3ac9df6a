"""specdec/rpc/errors.py: typed errors become gRPC statuses, for unary and streaming methods."""

from __future__ import annotations

import inspect
import logging

import grpc
import pytest

from specdec.core import errors
from specdec.rpc.errors import SESSION_KEY, _abort, error_from_reason, grpc_errors, status_for


class AbortCalled(Exception):
    """What grpc's context.abort raises: the method ends there."""


class FakeContext:
    def __init__(self):
        self.aborts: list[tuple[grpc.StatusCode, str]] = []
        self.trailing_metadata: tuple = ()

    def set_trailing_metadata(self, metadata):
        self.trailing_metadata = metadata

    def abort(self, code, details):
        self.aborts.append((code, details))
        raise AbortCalled()


class Servicer:
    def __init__(self, error: Exception | None = None):
        self.error = error

    @grpc_errors
    def Unary(self, request, context):
        if self.error is not None:
            raise self.error
        return f"reply to {request}"

    @grpc_errors
    def Stream(self, request, context):
        yield f"{request}-1"
        yield f"{request}-2"
        if self.error is not None:
            raise self.error
        yield f"{request}-3"


MAPPING = [
    (errors.InvalidArgument("bad k"), grpc.StatusCode.INVALID_ARGUMENT),
    (errors.NotFound("no session"), grpc.StatusCode.NOT_FOUND),
    (errors.FailedPrecondition("incompatible"), grpc.StatusCode.FAILED_PRECONDITION),
    (errors.Aborted("busy"), grpc.StatusCode.ABORTED),
    (errors.Unavailable("redis down"), grpc.StatusCode.UNAVAILABLE),
    (errors.DeadlineExceeded("too late"), grpc.StatusCode.DEADLINE_EXCEEDED),
    (errors.ServiceError("plain"), grpc.StatusCode.INTERNAL),
    (errors.NonFiniteLogitsError("nan logits"), grpc.StatusCode.INTERNAL),
    (errors.InconsistentDraftError("q(x) = 0"), grpc.StatusCode.INTERNAL),
    (errors.ServiceError("full", code="RESOURCE_EXHAUSTED"), grpc.StatusCode.RESOURCE_EXHAUSTED),
    (errors.InvalidArgument("overridden", code="OUT_OF_RANGE"), grpc.StatusCode.OUT_OF_RANGE),
]


def test_every_error_class_has_a_real_status_code():
    classes = [c for c in vars(errors).values() if isinstance(c, type) and issubclass(c, errors.ServiceError)]
    assert len(classes) >= 9
    for cls in classes:
        assert grpc.StatusCode[cls.code] is not None


@pytest.mark.parametrize(("exc", "code"), MAPPING, ids=[f"{type(e).__name__}-{c.name}" for e, c in MAPPING])
def test_service_errors_map_to_their_status_with_their_message(exc, code):
    assert status_for(exc) == (code, str(exc))


@pytest.mark.parametrize(("exc", "code"), MAPPING, ids=[f"{type(e).__name__}-{c.name}" for e, c in MAPPING])
def test_unary_method_aborts_with_the_status(exc, code):
    context = FakeContext()
    with pytest.raises(AbortCalled):
        Servicer(exc).Unary("req", context)
    assert context.aborts == [(code, str(exc))]


def test_an_unexpected_exception_is_internal_with_its_type_and_is_logged(caplog):
    context = FakeContext()
    with caplog.at_level(logging.ERROR, logger="specdec.rpc.errors"), pytest.raises(AbortCalled):
        Servicer(KeyError("cache-7")).Unary("req", context)
    assert context.aborts == [(grpc.StatusCode.INTERNAL, "internal error: KeyError: 'cache-7'")]
    assert caplog.records and caplog.records[0].exc_info is not None  # the trace goes to the log, not the client


def test_service_errors_are_not_logged_as_crashes(caplog):
    with caplog.at_level(logging.ERROR, logger="specdec.rpc.errors"), pytest.raises(AbortCalled):
        Servicer(errors.NotFound("gone")).Unary("req", FakeContext())
    assert not caplog.records


def test_a_unary_method_that_succeeds_returns_its_reply():
    context = FakeContext()
    assert Servicer().Unary("req", context) == "reply to req"
    assert context.aborts == []


def test_a_streaming_method_streams_until_the_error_then_aborts():
    context = FakeContext()
    stream = Servicer(errors.Aborted("lost the lease")).Stream("r", context)
    received = [next(stream), next(stream)]
    with pytest.raises(AbortCalled):
        next(stream)
    assert received == ["r-1", "r-2"]
    assert context.aborts == [(grpc.StatusCode.ABORTED, "lost the lease")]


def test_a_streaming_method_with_an_unexpected_exception_is_internal():
    context = FakeContext()
    with pytest.raises(AbortCalled):
        list(Servicer(ValueError("boom")).Stream("r", context))
    assert context.aborts == [(grpc.StatusCode.INTERNAL, "internal error: ValueError: boom")]


def test_a_streaming_method_that_succeeds_yields_everything():
    context = FakeContext()
    assert list(Servicer().Stream("r", context)) == ["r-1", "r-2", "r-3"]
    assert context.aborts == []


def test_the_decorated_methods_keep_their_names_and_kinds():
    assert Servicer.Unary.__name__ == "Unary" and not inspect.isgeneratorfunction(Servicer.Unary)
    assert Servicer.Stream.__name__ == "Stream" and inspect.isgeneratorfunction(Servicer.Stream)


def test_an_error_with_a_reason_sends_it_and_the_client_gets_the_typed_error_back():
    context = FakeContext()
    with pytest.raises(AbortCalled):
        Servicer(errors.HiddenStatesMiss("resend from row 0")).Unary("req", context)
    assert context.aborts == [(grpc.StatusCode.FAILED_PRECONDITION, "resend from row 0")]
    rebuilt = error_from_reason(context.trailing_metadata, "draft service at x: resend from row 0")
    assert type(rebuilt) is errors.HiddenStatesMiss and str(rebuilt) == "draft service at x: resend from row 0"


def test_errors_without_a_reason_send_no_metadata_and_unknown_reasons_are_ignored():
    context = FakeContext()
    with pytest.raises(AbortCalled):
        Servicer(errors.FailedPrecondition("incompatible")).Unary("req", context)
    assert context.trailing_metadata == ()
    assert error_from_reason((("specdec-reason", "something-new"), ("other", "x")), "m") is None
    assert error_from_reason(None, "m") is None


def test_the_status_of_a_cut_stream_names_its_session_in_trailing_metadata():
    """The trailing metadata of a stream's error carries `specdec-session-id`."""
    class Context:
        metadata = ()

        def set_trailing_metadata(self, metadata):
            self.metadata = metadata

        def abort(self, code, details):
            raise RuntimeError(code)

    error, context = errors.Unavailable("target down"), Context()
    error.session_id = "ab" * 16
    with pytest.raises(RuntimeError):
        _abort(context, error)
    assert (SESSION_KEY, "ab" * 16) in context.metadata
