"""specdec.rpc.model_service: the deadline a model call runs under, and the cache-key limit."""

from __future__ import annotations

import pytest

from specdec.core.errors import Cancelled, DeadlineExceeded, InvalidArgument
from specdec.rpc.model_service import MAX_KEY_BYTES, CallDeadline, validate_key


class _Context:
    def __init__(self, remaining, active=True):
        self.remaining, self.active = remaining, active

    def time_remaining(self):
        return self.remaining

    def is_active(self):
        return self.active


def test_a_live_caller_with_time_left_passes():
    CallDeadline.of(_Context(None)).check()
    CallDeadline.of(_Context(10.0)).check()
    assert CallDeadline.of(_Context(None)).at is None


def test_a_caller_that_left_is_cancelled_and_one_past_its_deadline_is_deadline_exceeded():
    with pytest.raises(Cancelled):
        CallDeadline.of(_Context(10.0, active=False)).check()
    with pytest.raises(DeadlineExceeded):
        CallDeadline.of(_Context(-0.1)).check()
    deadline = CallDeadline.of(_Context(10.0))
    deadline.context.remaining, deadline.context.active = 0.0, False  # expired while it waited
    with pytest.raises(DeadlineExceeded):
        deadline.check()


def test_cache_keys_are_at_most_128_utf8_bytes():
    validate_key("", "cache_key")
    validate_key("k" * MAX_KEY_BYTES, "cache_key")
    validate_key("é" * (MAX_KEY_BYTES // 2), "cache_key")
    for bad in ("k" * (MAX_KEY_BYTES + 1), "é" * (MAX_KEY_BYTES // 2 + 1), "k" * (20 << 20)):
        with pytest.raises(InvalidArgument, match="cache_key is longer than the limit of 128 bytes"):
            validate_key(bad, "cache_key")
