"""specdec/core/ngram.py: prompt lookup."""

from __future__ import annotations

import time

import numpy as np
import pytest

from specdec.core.ngram import lookup_matches, ngram_proposal


def test_the_longest_suffix_that_occurred_before_wins():
    # The last 3 tokens (1, 2, 3) occurred at the start, followed by 4, 5.
    assert ngram_proposal([1, 2, 3, 4, 5, 9, 1, 2, 3], k=2, min_n=1, max_n=4) == [4, 5]


def test_a_longer_match_beats_a_more_recent_shorter_one():
    # (2, 3) occurred at the start (followed by 7); (3) alone occurred later (followed by 8).
    assert ngram_proposal([2, 3, 7, 3, 8, 2, 3], k=1, min_n=1, max_n=4) == [7]


def test_falls_back_to_smaller_n():
    # No earlier (5, 3) nor (x, 5, 3); 3 alone occurred, followed by 6.
    assert ngram_proposal([3, 6, 5, 3], k=1, min_n=1, max_n=4) == [6]
    assert ngram_proposal([3, 6, 5, 3], k=1, min_n=2, max_n=4) == []


def test_the_most_recent_occurrence_wins():
    assert ngram_proposal([1, 2, 1, 3, 1, 4, 1], k=1, min_n=1, max_n=1) == [4]
    assert ngram_proposal([5, 6, 7, 5, 6, 8, 0, 5, 6], k=2, min_n=2, max_n=2) == [8, 0]


def test_no_match_is_empty():
    assert ngram_proposal([1, 2, 3, 4], k=3, min_n=1, max_n=4) == []
    assert ngram_proposal([7], k=3, min_n=1, max_n=4) == []
    assert ngram_proposal([], k=3, min_n=1, max_n=4) == []


def test_the_suffix_itself_is_not_a_match_but_overlap_is():
    assert ngram_proposal([4, 5], k=2, min_n=2, max_n=2) == []
    # (1, 1) at 0 is followed by the prefix's last 1: overlapping the suffix is fine.
    assert ngram_proposal([1, 1, 1], k=3, min_n=2, max_n=2) == [1]


def test_a_proposal_is_shorter_than_k_when_the_prefix_ends_sooner():
    assert ngram_proposal([1, 2, 3, 1, 2], k=5, min_n=1, max_n=4) == [3, 1, 2]


def test_k_bounds():
    assert ngram_proposal([1, 2, 1], k=0, min_n=1, max_n=4) == []
    assert ngram_proposal([1, 2, 1], k=1, min_n=1, max_n=4) == [2]
    with pytest.raises(ValueError, match="k must be"):
        ngram_proposal([1, 2, 1], k=-1, min_n=1, max_n=4)
    for min_n, max_n in [(0, 2), (3, 2)]:
        with pytest.raises(ValueError, match="min_n"):
            ngram_proposal([1, 2, 1], k=1, min_n=min_n, max_n=max_n)


def test_a_few_thousand_tokens_are_fast():
    prefix = np.random.default_rng(0).integers(0, 50_000, 8_000).tolist()
    started = time.perf_counter()
    for _ in range(10):
        assert ngram_proposal(prefix, k=8, min_n=1, max_n=32) == []  # the worst case: every n scanned
    assert (time.perf_counter() - started) / 10 < 0.05


def test_lookup_matches_where_the_last_n_tokens_occurred_before():
    assert lookup_matches([1, 2, 3, 1, 2], 2) and lookup_matches([1, 2, 3, 1, 2], 1)
    assert not lookup_matches([1, 2, 3, 1, 2], 3)  # (3, 1, 2) is new
    assert not lookup_matches([5, 1, 2], 2)  # (1, 2) only at the end: no earlier occurrence
    assert not lookup_matches([2, 2], 2) and lookup_matches([2, 2, 2], 2)
    assert not lookup_matches([1, 2, 1, 2], 0) and not lookup_matches([], 1)


def _windows_proposal(prefix, k, min_n, max_n):
    """The definition, window by window: the most recent earlier window equal to the last n tokens."""
    for n in range(min(max_n, len(prefix) - 1), min_n - 1, -1):
        for j in range(len(prefix) - n - 1, -1, -1):
            if list(prefix[j : j + n]) == list(prefix[-n:]):
                return list(prefix[j + n : j + n + k])
    return []


def test_proposals_equal_the_window_by_window_definition_on_random_prefixes():
    rng = np.random.default_rng(11)
    for _ in range(3000):
        length, vocab = int(rng.integers(1, 40)), int(rng.integers(2, 6))
        prefix = rng.integers(0, vocab, length).tolist()
        k, min_n = int(rng.integers(0, 5)), int(rng.integers(1, 4))
        max_n = min_n + int(rng.integers(0, 4))
        expected = _windows_proposal(prefix, k, min_n, max_n) if k else []
        assert ngram_proposal(prefix, k, min_n, max_n) == expected, (prefix, k, min_n, max_n)
