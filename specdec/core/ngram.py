"""Prompt lookup: a model-free draft that proposes what followed the last n tokens before.

The draft's law is a point mass on each token it proposes, which keeps speculative sampling
lossless (accept with probability p(x); on rejection the residual is p without x), so these
proposals travel as token ids alone (`DraftProposal.point_mass`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def lookup_matches(tokens: Sequence[int], n: int) -> bool:
    """Whether the last n tokens occur earlier in `tokens` (followed by a token there): where a
    lookup draft matching n tokens would propose. False for n < 1."""
    return n >= 1 and len(tokens) > n and bool(ngram_proposal(tokens, 1, n, n))


def ngram_proposal(prefix: Sequence[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k tokens that followed the most recent earlier occurrence of the prefix's last n tokens.

    n runs from max_n down to min_n; the first n with a match wins. The suffix itself is not a
    match (an occurrence must be followed by at least one token inside the prefix), and fewer
    than k tokens come back when the prefix ends sooner. [] when nothing matches or k == 0.
    """
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    if not 1 <= min_n <= max_n:
        raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
    tokens = np.asarray(prefix, dtype=np.int64)
    length = len(tokens)
    if k == 0:
        return []
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        # Windows starting at j = 0 .. length - n - 1: each is followed by a token of the prefix.
        windows = sliding_window_view(tokens[:-1], n)
        hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start : start + k].tolist()
    return []
