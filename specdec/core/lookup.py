"""The model-free lookup drafts as the engine's Drafters, and the settings that make them.

`NgramDrafter` (prompt lookup, `specdec.core.ngram`) and `SuffixDrafter` (a suffix trie over recent
sequences, `specdec.core.suffix`) propose point masses. Where they run: the draft service
(`SPECDEC_DRAFT_MODEL=ngram|suffix`, or with a model: hybrid), the coordinator
(`SPECDEC_COORDINATOR_LOCAL_DRAFT`) and the in-process pipeline; each reads `LookupSettings` from
its own settings object.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

from specdec.core.ngram import ngram_proposal
from specdec.core.protocols import Deadline, DraftProposal, DraftRequest
from specdec.core.sampling import Sampling
from specdec.core.suffix import SuffixCache, SuffixParams
from specdec.settings import setting

NGRAM_MODEL = "ngram"  # prompt lookup
SUFFIX_MODEL = "suffix"  # the suffix trie over recent sequences
MODEL_FREE = (NGRAM_MODEL, SUFFIX_MODEL)
LOOKUPS = ("", *MODEL_FREE)  # a lookup setting: none, or one of them
MAX_NGRAM = 32
MAX_SUFFIX_DEPTH = 64
MAX_SUFFIX_CACHE_TOKENS = 100_000_000


@dataclass(frozen=True)
class LookupSettings:
    """The lookup drafts' settings, part of each settings object that may run one."""

    ngram_min: int = setting(1, "NGRAM_MIN", "ngram draft: shortest suffix looked up in the prefix")
    ngram_max: int = setting(4, "NGRAM_MAX", f"ngram draft: longest suffix looked up in the prefix (<= {MAX_NGRAM})")
    suffix_max_depth: int = setting(
        24,
        "SUFFIX_MAX_DEPTH",
        f"suffix draft: longest substring indexed (contexts up to this - 1 tokens; <= {MAX_SUFFIX_DEPTH})",
    )
    suffix_min_match: int = setting(2, "SUFFIX_MIN_MATCH", "suffix draft: shortest context a proposal may start from")
    suffix_min_token_prob: float = setting(
        0.3, "SUFFIX_MIN_TOKEN_PROB", "suffix draft: least share of its context's continuations a proposed token needs"
    )
    suffix_min_path_prob: float = setting(
        0.3, "SUFFIX_MIN_PATH_PROB", "suffix draft: least product of those shares along a proposal"
    )
    suffix_cache_max_tokens: int = setting(
        65536,
        "SUFFIX_CACHE_MAX_TOKENS",
        "suffix draft: most tokens indexed over all cached prefixes (latest per session, LRU; ~0.5 KB a token "
        "at depth 24)",
    )

    @staticmethod
    def validate_lookup_name(field: str, value: str, empty: str) -> None:
        """ValueError unless `value`, the setting `field`, names a lookup draft or is '' (`empty`: what
        that means for this service)."""
        if value not in LOOKUPS:
            raise ValueError(f"{field} must be '' ({empty}), 'ngram' or 'suffix', got {value!r}")

    def validate_lookups(self) -> None:
        if not 1 <= self.ngram_min <= self.ngram_max <= MAX_NGRAM:
            raise ValueError(
                f"ngram_min and ngram_max must satisfy 1 <= ngram_min <= ngram_max <= {MAX_NGRAM}, "
                f"got ngram_min={self.ngram_min}, ngram_max={self.ngram_max}"
            )
        if not 2 <= self.suffix_max_depth <= MAX_SUFFIX_DEPTH:
            raise ValueError(f"suffix_max_depth must be in [2, {MAX_SUFFIX_DEPTH}], got {self.suffix_max_depth}")
        if not 1 <= self.suffix_min_match < self.suffix_max_depth:
            raise ValueError(
                f"suffix_min_match must be in [1, suffix_max_depth - 1 = {self.suffix_max_depth - 1}], "
                f"got {self.suffix_min_match}"
            )
        for name in ("suffix_min_token_prob", "suffix_min_path_prob"):
            if not 0.0 < getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in (0, 1], got {getattr(self, name)}")
        if not 1 <= self.suffix_cache_max_tokens <= MAX_SUFFIX_CACHE_TOKENS:
            raise ValueError(
                f"suffix_cache_max_tokens must be in [1, {MAX_SUFFIX_CACHE_TOKENS}], got {self.suffix_cache_max_tokens}"
            )

    def suffix_params(self) -> SuffixParams:
        return SuffixParams(
            self.suffix_max_depth, self.suffix_min_match, self.suffix_min_token_prob, self.suffix_min_path_prob
        )


class NgramDrafter:
    """Proposes what followed the prefix's last n tokens (min_n <= n <= max_n) earlier on.

    Its law is a point mass on each token, so any sampling parameters keep the output lossless;
    it may propose fewer tokens than asked, none included.
    """

    def __init__(self, min_n: int = 1, max_n: int = 4):
        if not 1 <= min_n <= max_n <= MAX_NGRAM:
            raise ValueError(f"need 1 <= min_n <= max_n <= {MAX_NGRAM}, got min_n={min_n}, max_n={max_n}")
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, requests: Sequence[DraftRequest], sampling: Sampling, deadline: Deadline) -> list[DraftProposal]:
        deadline.check()
        return [
            DraftProposal(
                ngram_proposal(r.prefix_token_ids, r.num_draft_tokens, self.min_n, self.max_n), None, point_mass=True
            )
            for r in requests
        ]


class SuffixDrafter:
    """Proposes a continuation only where the suffix trie is confident of it; fewer than K tokens
    (none included) otherwise. One `SuffixCache` for every caller, so a session's proposals draw on
    the latest prefixes of other recent sessions too. Thread-safe: one lock around the cache (a
    round costs microseconds).

    Lossless: a proposal is a point mass whose tokens are a function of the prefixes this drafter
    has been sent (earlier rounds, other sessions), never of the target's draws for the round it
    drafts. Other sessions' traffic changes which tokens are proposed, not the output's law (as
    auto K does, it costs seeded requests token-for-token reproducibility, never exactness)."""

    def __init__(self, params: SuffixParams, cache_max_tokens: int):
        self.cache = SuffixCache(params, cache_max_tokens)
        self._lock = threading.Lock()

    @property
    def cached_tokens(self) -> int:
        return self.cache.total_tokens

    def reset(self) -> None:
        """Forget every cached prefix (a benchmark starts each conversation cold with it)."""
        with self._lock:
            self.cache = SuffixCache(self.cache.params, self.cache.max_tokens)

    def propose(self, requests: Sequence[DraftRequest], sampling: Sampling, deadline: Deadline) -> list[DraftProposal]:
        deadline.check()
        with self._lock:
            return [
                DraftProposal(
                    self.cache.propose(r.cache_key, r.prefix_token_ids, r.num_draft_tokens), None, point_mass=True
                )
                for r in requests
            ]


def lookup_drafter(name: str, settings: LookupSettings) -> NgramDrafter | SuffixDrafter:
    """The lookup draft `name` (ngram or suffix) as `settings` configure it."""
    if name == NGRAM_MODEL:
        return NgramDrafter(settings.ngram_min, settings.ngram_max)
    if name == SUFFIX_MODEL:
        return SuffixDrafter(settings.suffix_params(), settings.suffix_cache_max_tokens)
    raise ValueError(f"no lookup draft named {name!r}: {' or '.join(MODEL_FREE)}")


def lookup_model_id(name: str, settings: LookupSettings, tokenizer: str) -> str:
    """The model id such a draft reports in its Info (its settings and the target's tokenizer)."""
    if name == NGRAM_MODEL:
        return f"{NGRAM_MODEL}:{settings.ngram_min}-{settings.ngram_max}@{tokenizer}"
    p = settings.suffix_params()
    return (
        f"{SUFFIX_MODEL}:depth{p.max_depth}-match{p.min_match}-p{p.min_token_prob:g}/{p.min_path_prob:g}@{tokenizer}"
    )
