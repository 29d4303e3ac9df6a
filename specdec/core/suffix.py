"""Suffix lookup (SuffixDecoding-style): a depth-bounded suffix trie with counts over recent sequences.

The trie holds every substring of at most `max_depth` tokens of the indexed windows, each with how
often it occurs. For a context w, count(w + t) / sum_u count(w + u) is how often t followed w, an
estimate of P(t | w). A proposal starts at the longest suffix of the prefix that was followed by
something, takes the most frequent next token while that estimate (and the product of the estimates
along the path) stays above its threshold, and so drafts nothing rather than a guess.

Proposals are point masses (q = one-hot), lossless for any choice of tokens that is a function of
what the drafter has seen: here the prefixes of earlier Propose calls, never the target's draws.

`SuffixCache` keeps the latest prefix of each recent cache key (one window per key, at most
`max_tokens` tokens over all windows, least recently used trimmed first) and updates the trie
incrementally: O(max_depth) per token appended or dropped, so a round that adds a few tokens to a
long prefix costs microseconds. Stdlib only.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

ROOT = 0
_NONE = -1  # no node / no child
_SEVERAL = -2  # a node's children are in a dict
MAX_DEPTH = 64  # longest substring the trie may index (settings bound)


@dataclass(frozen=True)
class SuffixParams:
    """When a continuation is confident enough to propose (see the module docstring)."""

    max_depth: int = 24  # longest substring indexed: contexts of up to max_depth - 1 tokens
    min_match: int = 2  # shortest context (suffix of the prefix) a proposal may start from
    min_token_prob: float = 0.3  # every proposed token: count / continuations of its context
    min_path_prob: float = 0.3  # the product of those along the proposal

    def __post_init__(self) -> None:
        if not 2 <= self.max_depth <= MAX_DEPTH:
            raise ValueError(f"max_depth must be in [2, {MAX_DEPTH}], got {self.max_depth}")
        if not 1 <= self.min_match < self.max_depth:
            raise ValueError(f"min_match must be in [1, max_depth - 1 = {self.max_depth - 1}], got {self.min_match}")
        for name in ("min_token_prob", "min_path_prob"):
            value = getattr(self, name)
            if not 0.0 < value <= 1.0:
                raise ValueError(f"{name} must be in (0, 1], got {value}")


@dataclass
class Window:
    """One indexed sequence: prefix positions offset .. offset + len(tokens) - 1 of its key."""

    offset: int = 0
    tokens: list[int] = field(default_factory=list)
    # ends[L - 1] is the node of tokens[-L:], L = 1 .. min(max_depth, len(tokens)).
    ends: list[int] = field(default_factory=list)


class SuffixTrie:
    """Substrings of at most max_depth tokens of some windows, with their occurrence counts.

    Node ids index flat arrays (about 20 bytes a node: most nodes lie on unbranched paths, and only
    a node with several children keeps a dict of them); node 0 is the root (the empty string).
    count(w) = the number of start positions in the windows where w occurs; count(w + t) <= count(w),
    so a node whose count falls to 0 has no live children and is freed (its id is reused).
    """

    def __init__(self, max_depth: int):
        self.max_depth = max_depth
        self._count = array("i", [0])
        self._parent = array("i", [-1])
        self._depth = array("b", [0])
        # The only child and its token; _SEVERAL when the children are in _several[node].
        self._only_child = array("i", [_NONE])
        self._only_token = array("i", [0])
        self._several: dict[int, dict[int, int]] = {}
        self._free: list[int] = []

    @property
    def nodes(self) -> int:
        """Live nodes, the root excluded."""
        return len(self._count) - len(self._free) - 1

    @property
    def slots(self) -> int:
        """Node ids allocated, live or free for reuse: the arrays' length, what the trie's memory follows."""
        return len(self._count) - 1

    def child(self, node: int, token: int) -> int:
        """The node of (node's string) + token, or -1."""
        only = self._only_child[node]
        if only >= 0:
            return only if self._only_token[node] == token else _NONE
        return self._several[node].get(token, _NONE) if only == _SEVERAL else _NONE

    def children(self, node: int) -> list[tuple[int, int]]:
        """[(token, child node)] of a node."""
        only = self._only_child[node]
        if only >= 0:
            return [(self._only_token[node], only)]
        return list(self._several[node].items()) if only == _SEVERAL else []

    def depth(self, node: int) -> int:
        return self._depth[node]

    def followed(self, node: int) -> bool:
        """Whether the node's string occurs with a token after it."""
        return self._only_child[node] != _NONE

    def most_likely_next(self, node: int) -> tuple[int, float]:
        """(the most frequent next token, its share of the node's continuations); ties: smallest id."""
        total, best, best_count = 0, -1, 0
        for token, child in self.children(node):
            count = self._count[child]
            total += count
            if count > best_count or (count == best_count and token < best):
                best, best_count = token, count
        return best, best_count / total

    def walk(self, tokens: Sequence[int]) -> int:
        """The node of `tokens` (at most max_depth of them), or -1 when it does not occur."""
        node = ROOT
        for token in tokens:
            node = self.child(node, token)
            if node < 0:
                return _NONE
        return node

    def snapshot(self) -> dict[tuple[int, ...], int]:
        """Every live substring -> its count (tests compare an updated trie with a rebuilt one)."""
        out: dict[tuple[int, ...], int] = {}
        stack: list[tuple[int, tuple[int, ...]]] = [(ROOT, ())]
        while stack:
            node, path = stack.pop()
            for token, child in self.children(node):
                out[path + (token,)] = self._count[child]
                stack.append((child, path + (token,)))
        return out

    # ------------------------------------------------------------ counts

    def _link(self, node: int, token: int, child: int) -> None:
        only = self._only_child[node]
        if only == _NONE:
            self._only_child[node], self._only_token[node] = child, token
        elif only == _SEVERAL:
            self._several[node][token] = child
        else:
            self._several[node] = {self._only_token[node]: only, token: child}
            self._only_child[node] = _SEVERAL

    def _unlink(self, node: int, token: int) -> None:
        if self._only_child[node] != _SEVERAL:
            self._only_child[node] = _NONE
            return
        several = self._several[node]
        del several[token]
        if len(several) == 1:
            ((self._only_token[node], self._only_child[node]),) = several.items()
            del self._several[node]

    def _new_node(self, parent: int) -> int:
        depth = self._depth[parent] + 1
        if self._free:
            node = self._free.pop()
            self._count[node], self._parent[node], self._depth[node] = 0, parent, depth
            self._only_child[node] = _NONE  # every child of a freed node was freed before it
            return node
        self._count.append(0)
        self._parent.append(parent)
        self._depth.append(depth)
        self._only_child.append(_NONE)
        self._only_token.append(0)
        return len(self._count) - 1

    def _remove(self, node: int, token: int) -> None:
        """One occurrence fewer of `node` (reached from its parent by `token`); freed at 0."""
        self._count[node] -= 1
        if self._count[node] == 0:
            self._unlink(self._parent[node], token)
            self._free.append(node)

    # ------------------------------------------------------------ windows

    def append(self, window: Window, token: int) -> None:
        """Index the occurrences that end at a token appended to the window: O(max_depth).

        One more occurrence of (suffix + token) for the empty suffix and each of the window's
        suffixes that can grow, each node created where new. Inlined, locals bound: the hot loop
        of indexing a prompt (up to max_depth nodes a token; a quarter faster than a call a node)."""
        count, only_child, only_token, several = self._count, self._only_child, self._only_token, self._several
        ends = []
        for node in (ROOT, *window.ends[: self.max_depth - 1]):
            only = only_child[node]
            if only >= 0 and only_token[node] == token:
                child = only
            elif only == _SEVERAL and (child := several[node].get(token, _NONE)) >= 0:
                pass
            elif only == _NONE and not self._free:  # a leaf's first child, a new node: _new_node + _link
                child = len(count)
                count.append(0)
                self._parent.append(node)
                self._depth.append(self._depth[node] + 1)
                only_child.append(_NONE)
                only_token.append(0)
                only_child[node], only_token[node] = child, token
            else:
                child = self._new_node(node)
                self._link(node, token, child)
            count[child] += 1
            ends.append(child)
        window.ends = ends
        window.tokens.append(token)

    def pop_back(self, window: Window) -> None:
        """Forget the occurrences that end at the window's last token: O(max_depth)."""
        token = window.tokens.pop()
        shorter = [self._parent[node] for node in window.ends[1:]]  # suffixes of the shortened window
        for node in window.ends:
            self._remove(node, token)
        if len(window.tokens) >= self.max_depth:  # its longest suffix was not among the ends
            shorter.append(self.walk(window.tokens[-self.max_depth :]))
        window.ends = shorter

    def pop_front(self, window: Window, count: int) -> None:
        """Forget the occurrences that start at the window's first `count` tokens: O(count * max_depth)."""
        tokens = window.tokens
        for start in range(count):
            path, node = [], ROOT
            for token in tokens[start : start + self.max_depth]:
                node = self.child(node, token)
                path.append((node, token))
            for node, token in path:
                self._remove(node, token)
        del tokens[:count]
        window.offset += count
        del window.ends[len(tokens) :]  # suffixes longer than the window no longer occur in it


def _longest_context(trie: SuffixTrie, window: Window, min_match: int) -> int:
    """The node of the longest suffix of the window (min_match .. max_depth - 1 tokens) that was
    followed by something, or -1. Monotone: a followed context's suffixes are followed too."""
    for length in range(min(len(window.ends), trie.max_depth - 1), min_match - 1, -1):
        if trie.followed(window.ends[length - 1]):
            return window.ends[length - 1]
    return -1


def _rematch(trie: SuffixTrie, tail: Sequence[int], min_match: int) -> int:
    """As _longest_context, for a token list that is not a window (the prefix plus a proposal)."""
    for length in range(min(len(tail), trie.max_depth - 1), min_match - 1, -1):
        node = trie.walk(tail[-length:])
        if node >= 0 and trie.followed(node):
            return node
    return -1


def confident_continuation(trie: SuffixTrie, window: Window, k: int, params: SuffixParams) -> list[int]:
    """Up to k tokens likely to follow the window, each the most frequent continuation of its context.

    Stops before a token whose share of its context's continuations is below min_token_prob, or
    that would take the product of the shares below min_path_prob; [] when no context of at least
    min_match tokens was ever followed. The context grows with each token taken (a walk down the
    trie); where it cannot (max_depth reached, or every occurrence ends a window) it is matched
    again as the longest followed suffix of the prefix plus the tokens taken.
    """
    proposal: list[int] = []
    node = _longest_context(trie, window, params.min_match)
    path_prob = 1.0
    while node >= 0 and len(proposal) < k:
        token, prob = trie.most_likely_next(node)
        path_prob *= prob
        if prob < params.min_token_prob or path_prob < params.min_path_prob:
            break
        proposal.append(token)
        node = trie.child(node, token)
        if trie.depth(node) >= trie.max_depth or not trie.followed(node):
            tail = window.tokens[-(trie.max_depth - 1) :] + proposal
            node = _rematch(trie, tail, params.min_match)
    return proposal


class SuffixCache:
    """The latest prefix of each recent cache key, indexed in one trie; at most max_tokens tokens.

    `propose(key, prefix, k)` first makes the key's window hold the prefix (keeping what it shares
    with the previous one: a round costs the tokens it added), then trims the least recently used
    windows from their front until the bound holds (the current window last, down to its most
    recent max_tokens tokens). A key of "" is a sequence seen once (one of a request's samples):
    indexed for the call and forgotten after it, so samples never evict sessions.
    """

    def __init__(self, params: SuffixParams, max_tokens: int):
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self.params = params
        self.max_tokens = max_tokens
        self.trie = SuffixTrie(params.max_depth)
        self.windows: OrderedDict[str, Window] = OrderedDict()
        self.total_tokens = 0

    def propose(self, key: str, prefix: Sequence[int], k: int) -> list[int]:
        if k < 0:
            raise ValueError(f"k must be >= 0, got {k}")
        if key:
            window = self._observe(key, prefix)
            return confident_continuation(self.trie, window, k, self.params) if k else []
        window = Window()
        self._extend(window, prefix, start=max(0, len(prefix) - self.max_tokens))
        try:
            return confident_continuation(self.trie, window, k, self.params) if k else []
        finally:
            self.trie.pop_front(window, len(window.tokens))

    def _observe(self, key: str, prefix: Sequence[int]) -> Window:
        """The key's window, made to hold the prefix's last tokens (at most max_tokens)."""
        window = self.windows.pop(key, None) or Window()
        self.windows[key] = window  # most recently used
        before = len(window.tokens)
        kept = _common_length(window, prefix)
        if kept == 0:  # nothing to keep: start the window where the bound would trim it to
            self.trie.pop_front(window, len(window.tokens))
            window.offset = max(0, len(prefix) - self.max_tokens)
        while len(window.tokens) > kept:
            self.trie.pop_back(window)
        self._extend(window, prefix, start=window.offset + len(window.tokens))
        self.total_tokens += len(window.tokens) - before
        self._trim()
        return window

    def _extend(self, window: Window, prefix: Sequence[int], start: int) -> None:
        for token in prefix[start:]:
            self.trie.append(window, token)

    def _trim(self) -> None:
        """Drop tokens from the front of the least recently used windows until the bound holds."""
        while self.total_tokens > self.max_tokens:
            key, window = next(iter(self.windows.items()))
            count = min(len(window.tokens), self.total_tokens - self.max_tokens)
            self.trie.pop_front(window, count)
            self.total_tokens -= count
            if not window.tokens:
                del self.windows[key]


def _common_length(window: Window, prefix: Sequence[int]) -> int:
    """How many of the window's tokens the prefix repeats at the same positions (from its start)."""
    stored, offset = window.tokens, window.offset
    if not stored or len(prefix) < offset:
        return 0
    seen = list(prefix[offset : offset + len(stored)])
    if seen == stored:
        return len(stored)
    for i, (a, b) in enumerate(zip(stored, seen, strict=False)):
        if a != b:
            return i
    return len(seen)
