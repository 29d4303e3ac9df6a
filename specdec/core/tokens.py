"""Token-sequence helpers shared by the engine's adapters and the model runner."""

from __future__ import annotations

from collections.abc import Sequence

_CHUNK = 64  # elements compared at once, at C speed


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences. Two lists (or two tuples) are
    compared a chunk at a time as slices, then element by element within the first chunk that
    differs: the model runner compares a session's whole context on every step (4,096 tokens: ~0.2
    ms a session element by element in Python)."""
    n = min(len(a), len(b))
    i = 0
    if type(a) is type(b) and type(a) in (list, tuple):
        while i + _CHUNK <= n and a[i : i + _CHUNK] == b[i : i + _CHUNK]:
            i += _CHUNK
    while i < n and a[i] == b[i]:
        i += 1
    return i
