"""specdec/core/suffix.py: the suffix trie, its confident continuations and the cross-session cache."""

from __future__ import annotations

import random
import time

import pytest

from specdec.core.suffix import ROOT, SuffixCache, SuffixParams, SuffixTrie, Window, confident_continuation

LOOSE = SuffixParams(max_depth=8, min_match=1, min_token_prob=0.3, min_path_prob=0.1)


def _cache(params: SuffixParams = LOOSE, max_tokens: int = 10_000) -> SuffixCache:
    return SuffixCache(params, max_tokens)


def _rebuilt(cache: SuffixCache) -> SuffixTrie:
    """A trie built from scratch from the cache's windows, as they stand."""
    trie = SuffixTrie(cache.params.max_depth)
    for window in cache.windows.values():
        fresh = Window()
        for token in window.tokens:
            trie.append(fresh, token)
    return trie


def _depths(trie: SuffixTrie) -> set[tuple[int, int]]:
    """{(node depth, path length)} over the live nodes: equal pairs where the depths are right."""
    out, stack = set(), [(ROOT, 0)]
    while stack:
        node, length = stack.pop()
        out.add((trie.depth(node), length))
        stack.extend((child, length + 1) for _, child in trie.children(node))
    return out


def test_the_trie_counts_every_substring_up_to_max_depth():
    trie, window = SuffixTrie(3), Window()
    for token in [1, 2, 1, 2]:
        trie.append(window, token)
    assert trie.snapshot() == {
        (1,): 2, (2,): 2, (1, 2): 2, (2, 1): 1, (1, 2, 1): 1, (2, 1, 2): 1,
    }  # fmt: skip
    assert window.ends == [trie.walk([2]), trie.walk([1, 2]), trie.walk([2, 1, 2])]


def test_a_match_proposes_what_followed_it():
    # (1, 2) was followed by 3 then 4: the whole continuation, up to the end of what was seen.
    assert _cache().propose("a", [1, 2, 3, 4, 9, 1, 2], 5) == [3, 4, 9, 1, 2]
    assert _cache().propose("a", [1, 2, 3, 4, 9, 1, 2], 2) == [3, 4]


def test_no_match_proposes_nothing():
    assert _cache().propose("a", [1, 2, 3, 4], 3) == []
    assert _cache().propose("a", [7], 3) == []
    assert _cache(SuffixParams(max_depth=8, min_match=2)).propose("a", [3, 6, 5, 3], 3) == []  # only (3) recurs


def test_a_proposal_stops_where_the_continuations_disagree():
    # After (5): 1, 2, 1, 3 -> 1 has 1/2 of the continuations; after (5, 1): 7 then 8 -> 1/2 each.
    params = SuffixParams(max_depth=8, min_match=1, min_token_prob=0.5, min_path_prob=0.5)
    prefix = [5, 1, 7, 5, 2, 5, 1, 8, 5, 3, 5]
    assert SuffixCache(params, 100).propose("a", prefix, 4) == [1]
    strict = SuffixParams(max_depth=8, min_match=1, min_token_prob=0.6, min_path_prob=0.5)
    assert SuffixCache(strict, 100).propose("a", prefix, 4) == []  # unconfident: nothing


def test_the_path_probability_bounds_the_length():
    # (4) was followed by 1 three times and 2 once (0.75); (1) always by 4 (1.0). The path's
    # probability after each token taken: 0.75, 0.75, 0.56, 0.56, 0.42 ...
    prefix = [4, 1, 4, 1, 4, 1, 4, 2, 4]
    for min_path_prob, expected in [(0.4, [1, 4, 1, 4, 1, 4]), (0.5, [1, 4, 1, 4]), (0.6, [1, 4]), (0.8, [])]:
        params = SuffixParams(max_depth=2, min_match=1, min_token_prob=0.5, min_path_prob=min_path_prob)
        assert SuffixCache(params, 100).propose("a", prefix, 8) == expected
    params = SuffixParams(max_depth=2, min_match=1, min_token_prob=0.5, min_path_prob=0.1)
    assert SuffixCache(params, 100).propose("a", prefix, 3) == [1, 4, 1]  # K bounds it too


def test_the_longest_followed_context_wins():
    # (2, 3) was followed by 7; (3) alone more often by 8.
    prefix = [2, 3, 7, 3, 8, 3, 8, 2, 3]
    assert _cache().propose("a", prefix, 1) == [7]


def test_a_repeating_prefix_keeps_proposing_past_its_end():
    # The occurrences of the matched context run into the window's end: the context is matched again.
    assert _cache().propose("a", [1, 2, 3, 1, 2, 3, 1, 2], 7) == [3, 1, 2, 3, 1, 2, 3]


def test_k_bounds_and_params():
    assert _cache().propose("a", [1, 2, 1], 0) == []
    with pytest.raises(ValueError, match="k must be"):
        _cache().propose("a", [1, 2, 1], -1)
    for bad in (
        {"max_depth": 1},
        {"max_depth": 65},
        {"min_match": 0},
        {"max_depth": 4, "min_match": 4},
        {"min_token_prob": 0.0},
        {"min_path_prob": 1.5},
    ):
        with pytest.raises(ValueError):
            SuffixParams(**bad)
    with pytest.raises(ValueError, match="max_tokens"):
        SuffixCache(LOOSE, 0)


def test_other_sessions_prefixes_are_reused_and_samples_leave_nothing():
    cache = _cache()
    assert cache.propose("a", [9, 1, 2, 3, 4, 5], 3) == []
    assert cache.propose("b", [8, 8, 1, 2], 3) == [3, 4, 5]  # what session a's prefix continued with
    assert set(cache.windows) == {"a", "b"}
    assert cache.propose("", [6, 6, 6, 1, 2, 3], 2) == [4, 5]  # a sample (no key) reads the cache ...
    assert set(cache.windows) == {"a", "b"} and cache.total_tokens == 10  # ... and is not kept
    assert cache.trie.snapshot() == _rebuilt(cache).snapshot()


def test_the_token_bound_trims_the_least_recently_used_first():
    cache = _cache(max_tokens=10)
    cache.propose("a", [1, 2, 3, 4], 1)
    cache.propose("b", [5, 6, 7, 8], 1)
    cache.propose("a", [1, 2, 3, 4, 9], 1)  # a is now the most recent
    cache.propose("c", [10, 11, 12], 1)  # 12 tokens: b loses its 2 oldest
    assert cache.total_tokens == 10
    assert {k: (w.offset, w.tokens) for k, w in cache.windows.items()} == {
        "b": (2, [7, 8]), "a": (0, [1, 2, 3, 4, 9]), "c": (0, [10, 11, 12]),
    }  # fmt: skip
    cache.propose("d", list(range(20, 28)), 1)  # 18 tokens: b and a go, c loses its oldest
    assert list(cache.windows) == ["c", "d"] and cache.windows["c"].tokens == [11, 12]
    assert cache.total_tokens == 10
    cache.propose("e", list(range(30, 50)), 1)  # alone over the bound: only its last 10 tokens are kept
    assert list(cache.windows) == ["e"] and cache.windows["e"].offset == 10
    assert cache.trie.snapshot() == _rebuilt(cache).snapshot()
    assert cache.trie.nodes == len(_rebuilt(cache).snapshot())


def test_memory_follows_the_bound():
    rng = random.Random(3)
    cache = _cache(SuffixParams(max_depth=8), max_tokens=500)
    for step in range(60):
        cache.propose(f"s{step % 13}", [rng.randrange(50) for _ in range(rng.randrange(1, 80))], 3)
        assert cache.total_tokens <= 500
        assert cache.trie.nodes <= 500 * 8  # at most max_depth substrings start at each kept token
        assert cache.trie.slots <= 500 * 8  # freed ids are reused
    assert cache.trie.snapshot() == _rebuilt(cache).snapshot()


def test_incremental_updates_equal_a_rebuild():
    """Appends, divergences (a turn cut mid-round), trims and samples, against a trie built afresh."""
    rng = random.Random(7)
    cache = _cache(SuffixParams(max_depth=6, min_match=1), max_tokens=300)
    prefixes: dict[str, list[int]] = {}
    for _ in range(400):
        key = rng.choice(["a", "b", "c", "d", ""])
        prefix = prefixes.get(key, [rng.randrange(6) for _ in range(rng.randrange(1, 30))])
        if rng.random() < 0.2 and len(prefix) > 3:  # diverge: cut, then continue differently
            prefix = prefix[: rng.randrange(1, len(prefix))]
        prefix = prefix + [rng.randrange(6) for _ in range(rng.randrange(0, 5))]
        if key:
            prefixes[key] = prefix
        proposal = cache.propose(key, prefix, 4)
        if key:
            window = cache.windows[key]
            assert window.tokens == prefix[window.offset :]
            fresh = _rebuilt(cache)
            assert cache.trie.snapshot() == fresh.snapshot()
            assert all(depth == length for depth, length in _depths(cache.trie))  # rematches read depths
            assert window.ends == [cache.trie.walk(window.tokens[-n:]) for n in range(1, len(window.ends) + 1)]
            assert proposal == confident_continuation(fresh, _window_in(fresh, window), 4, cache.params)


def _window_in(trie: SuffixTrie, window: Window) -> Window:
    ends = [trie.walk(window.tokens[-n:]) for n in range(1, min(trie.max_depth, len(window.tokens)) + 1)]
    return Window(window.offset, list(window.tokens), ends)


def test_a_round_on_a_long_prefix_costs_well_under_a_millisecond():
    rng = random.Random(0)
    base = [rng.randrange(50_000) for _ in range(300)]
    prefix = [t for _ in range(12) for t in base]  # 3,600 tokens that repeat: proposals happen
    cache = SuffixCache(SuffixParams(), 65_536)
    cache.propose("s", prefix, 8)
    costs = []
    for _ in range(100):
        prefix = prefix + prefix[len(prefix) - 300 : len(prefix) - 297]  # 3 accepted tokens a round
        started = time.perf_counter()
        assert len(cache.propose("s", prefix, 8)) == 8
        costs.append(time.perf_counter() - started)
    costs.sort()
    assert costs[50] < 0.001, f"median {costs[50] * 1e6:.0f} us"
