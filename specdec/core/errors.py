"""Errors that carry their status, raised anywhere in the project.

`code` is the name of a gRPC status code, kept as a string so that this module (and the
engine that raises these) imports nothing but the standard library; `specdec.rpc.errors`
turns them into statuses, and no stack trace reaches a client.
"""

from __future__ import annotations


class ServiceError(Exception):
    code = "INTERNAL"
    # A cause a caller can act on, beyond the status code (sent as trailing metadata
    # `specdec-reason`, turned back into this class by the client); "" = none.
    reason = ""

    def __init__(self, message: str, code: str | None = None):
        super().__init__(message)
        if code is not None:
            self.code = code


class InvalidArgument(ServiceError):
    code = "INVALID_ARGUMENT"


class NotFound(ServiceError):
    code = "NOT_FOUND"


class FailedPrecondition(ServiceError):
    code = "FAILED_PRECONDITION"


class HiddenStatesMiss(FailedPrecondition):
    """A hidden-state delta the draft cannot join to rows it keeps (another replica, an evicted
    entry, a prefix that no longer lines up): the caller resends the rows from row 0."""

    reason = "hidden-states-miss"


class NoTargetLookup(FailedPrecondition):
    """Rounds drafted by the target's lookup (`lookup_k`) asked of a target that has none (a pool
    mid-rollout, some replicas with SPECDEC_TARGET_LOOKUP and some without): nothing ran, so the
    caller plays the call another way."""

    reason = "no-target-lookup"

    def __init__(self, message: str = "lookup_k needs a lookup draft in the target (SPECDEC_TARGET_LOOKUP); none here"):
        super().__init__(message)


class Aborted(ServiceError):
    code = "ABORTED"


class AtCapacity(ServiceError):
    """A service's queue or admission limit is full: another replica (or this one, a little later)
    may serve the call, so callers retry it elsewhere."""

    code = "RESOURCE_EXHAUSTED"
    reason = "at-capacity"


class Unavailable(ServiceError):
    code = "UNAVAILABLE"


class DeadlineExceeded(ServiceError):
    code = "DEADLINE_EXCEEDED"


class Cancelled(ServiceError):
    """The caller has gone (it cancelled the call): its work stops."""

    code = "CANCELLED"


class NonFiniteLogitsError(ServiceError, ValueError):
    """A model produced NaN or +inf logits: sampling from them would be silently wrong."""


class InconsistentDraftError(ServiceError, ValueError):
    """The draft reported q(x) = 0 for a token it proposed: its q is not the law it sampled."""
