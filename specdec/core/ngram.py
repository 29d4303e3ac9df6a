"""Prompt lookup: a model-free draft that proposes what followed the last n tokens before.

The draft's law is a point mass on each token it proposes, which keeps speculative sampling
lossless (accept with probability p(x); on rejection the residual is p without x), so these
proposals travel as token ids alone (`DraftProposal.point_mass`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


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
    top = min(max_n, len(tokens) - 1)
    if k == 0 or top < min_n:
        return []
    # Where an earlier occurrence of the last n tokens would end: at an earlier copy of the last
    # token (one pass over the prefix; the longer n are checked at those few places only).
    ends = np.flatnonzero(tokens[:-1] == tokens[-1])
    for n in range(top, min_n - 1, -1):
        candidates = ends[ends >= n - 1]
        agree = np.ones(candidates.size, dtype=bool)
        for back in range(1, n):
            agree &= tokens[candidates - back] == tokens[-1 - back]
        hits = candidates[agree]
        if hits.size:
            start = int(hits[-1]) + 1  # the most recent occurrence: what followed it
            return tokens[start : start + k].tolist()
    return []
