"""The model-free draft: prompt lookup (`specdec.core.ngram`), proposals sent as point masses.

`NgramDrafter` is the engine's Drafter in one process; `load_ngram` gives what the draft service
holds for `SPECDEC_DRAFT_MODEL=ngram` (a `ServedDraft`): Info from the target's tokenizer, no KV
cache, no position limit.
"""

from __future__ import annotations

from collections.abc import Sequence

from draft_service.served import ServedDraft, model_free_info
from draft_service.settings import MAX_NGRAM, NGRAM_MODEL, DraftSettings
from specdec.core.ngram import ngram_proposal
from specdec.core.protocols import Deadline, DraftProposal, DraftRequest
from specdec.core.sampling import Sampling
from specdec.v1 import common_pb2


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


def ngram_info(tokenizer, tokenizer_spec: str, min_n: int, max_n: int) -> common_pb2.ModelInfo:
    return model_free_info(tokenizer, f"{NGRAM_MODEL}:{min_n}-{max_n}@{tokenizer_spec}")


def load_ngram(settings: DraftSettings, tokenizer=None) -> ServedDraft:
    """The ngram draft for `settings.tokenizer` (loaded unless given)."""
    if tokenizer is None:
        from specdec.models.sources import load_tokenizer

        tokenizer = load_tokenizer(settings.tokenizer)
    info = ngram_info(tokenizer, settings.tokenizer, settings.ngram_min, settings.ngram_max)
    return ServedDraft(NgramDrafter(settings.ngram_min, settings.ngram_max), info)
