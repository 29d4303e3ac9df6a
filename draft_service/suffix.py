"""The model-free suffix draft (`specdec.core.suffix`), proposals sent as point masses.

`SuffixDrafter` is the engine's Drafter (in the service and in one process): one `SuffixCache`
for every caller of this pod, so a session's proposals draw on the latest prefixes of other
recent sessions too. `load_suffix` gives what the draft service holds for
`SPECDEC_DRAFT_MODEL=suffix`.

Lossless: a proposal is a point mass whose tokens are a function of the prefixes this drafter
has been sent (earlier rounds, other sessions), never of the target's draws for the round it
drafts. Other sessions' traffic changes which tokens are proposed, not the output's law (as auto K
does, it costs seeded requests token-for-token reproducibility, never exactness).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from draft_service.served import ServedDraft, model_free_info
from draft_service.settings import SUFFIX_MODEL, DraftSettings
from specdec.core.protocols import Deadline, DraftProposal, DraftRequest
from specdec.core.sampling import Sampling
from specdec.core.suffix import SuffixCache, SuffixParams


class SuffixDrafter:
    """Proposes a continuation only where the suffix trie is confident of it; fewer than K tokens
    (none included) otherwise. Thread-safe: one lock around the cache (a round costs microseconds)."""

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


def suffix_params(settings: DraftSettings) -> SuffixParams:
    return SuffixParams(
        settings.suffix_max_depth,
        settings.suffix_min_match,
        settings.suffix_min_token_prob,
        settings.suffix_min_path_prob,
    )


def suffix_drafter(settings: DraftSettings) -> SuffixDrafter:
    return SuffixDrafter(suffix_params(settings), settings.suffix_cache_max_tokens)


def load_suffix(settings: DraftSettings, tokenizer=None) -> ServedDraft:
    """The suffix draft for `settings.tokenizer` (loaded unless given)."""
    if tokenizer is None:
        from specdec.models.sources import load_tokenizer

        tokenizer = load_tokenizer(settings.tokenizer)
    params = suffix_params(settings)
    model_id = (
        f"{SUFFIX_MODEL}:depth{params.max_depth}-match{params.min_match}"
        f"-p{params.min_token_prob:g}/{params.min_path_prob:g}@{settings.tokenizer}"
    )
    return ServedDraft(SuffixDrafter(params, settings.suffix_cache_max_tokens), model_free_info(tokenizer, model_id))
