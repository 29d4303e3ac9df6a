"""HiddenRowStore: the draft's kept hidden-state rows, joined with a delta or refused, and bounded."""

from __future__ import annotations

import numpy as np
import pytest

from draft_service.hidden_rows import HiddenRowStore
from specdec.core.errors import HiddenStatesMiss

H = 3


def _rows(tokens: list[int]) -> np.ndarray:
    """[len(tokens) - 1, H] float16 rows, row t a function of tokens 0..t (as the target's)."""
    return np.stack([np.full(H, sum(tokens[: t + 1]) + t / 8, np.float16) for t in range(len(tokens) - 1)])


def test_a_full_history_is_used_as_sent_and_kept():
    store, prefix = HiddenRowStore(4, 100), [3, 1, 4, 1]
    rows = _rows(prefix)
    assert store.join("k", prefix, 0, rows) is rows
    store.keep("k", prefix, rows)
    assert len(store) == 1 and store.total_rows == 3


def test_a_delta_joins_the_kept_rows_bitwise():
    store, first, later = HiddenRowStore(4, 100), [3, 1, 4, 1], [3, 1, 4, 1, 5, 9]
    store.keep("k", first, _rows(first))
    joined = store.join("k", later, 3, _rows(later)[3:])
    assert joined.dtype == np.float16 and np.array_equal(joined, _rows(later))
    # A shorter offset (the draft holds more than it needs) joins as well.
    assert np.array_equal(store.join("k", later, 1, _rows(later)[1:]), _rows(later))


@pytest.mark.parametrize(
    ("key", "offset", "later", "words"),
    [
        ("other", 3, [3, 1, 4, 1, 5], "keeps no hidden states under"),  # a replica that never saw it
        ("", 3, [3, 1, 4, 1, 5], "keeps no hidden states under"),  # a caller that asked to keep nothing
        ("k", 4, [3, 1, 4, 1, 5], "does not line up"),  # more rows than it holds
        ("k", 3, [3, 1, 7, 1, 5], "does not line up"),  # the prefix diverged before the offset
    ],
)
def test_a_delta_that_does_not_line_up_is_a_miss_that_stores_nothing(key, offset, later, words):
    store, first = HiddenRowStore(4, 100), [3, 1, 4, 1]
    store.keep("k", first, _rows(first))
    with pytest.raises(HiddenStatesMiss, match=words) as info:
        store.join(key, later, offset, _rows(later)[offset:])
    assert "resend target_hidden_states from row 0" in str(info.value)
    assert info.value.code == "FAILED_PRECONDITION" and info.value.reason == "hidden-states-miss"
    assert len(store) == 1 and store.total_rows == 3
    # The entry it held still serves a delta that fits.
    assert np.array_equal(store.join("k", first + [2], 3, _rows(first + [2])[3:]), _rows(first + [2]))


def test_an_empty_key_keeps_nothing():
    store = HiddenRowStore(4, 100)
    store.keep("", [3, 1, 4], _rows([3, 1, 4]))
    assert len(store) == 0 and store.total_rows == 0


def test_entries_and_rows_are_bounded_least_recently_kept_first():
    store = HiddenRowStore(2, 6)
    for key in ("a", "b", "c"):
        store.keep(key, [1, 2, 3], _rows([1, 2, 3]))  # 2 rows each
    assert len(store) == 2 and store.total_rows == 4
    with pytest.raises(HiddenStatesMiss):
        store.join("a", [1, 2, 3, 4], 2, _rows([1, 2, 3, 4])[2:])
    store.keep("b", [1, 2, 3, 4, 5, 6], _rows([1, 2, 3, 4, 5, 6]))  # b grows to 5 rows: c goes
    assert len(store) == 1 and store.total_rows == 5
    store.keep("d", list(range(8)), _rows(list(range(8))))  # 7 rows: over the bound, never kept
    assert len(store) == 1 and store.total_rows == 5
