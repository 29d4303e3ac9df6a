"""What the draft service holds, for every kind of draft: a Drafter, its Info, and its runner.

`DraftServicer.Propose` calls `served.drafter.propose(...)` whatever the draft is: a model's
drafter runs on the model's own thread (`LocalDrafter`), a model-free one in the calling thread,
a hybrid one both. `runner` is the model's (for KV-cache metrics), None without a model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from specdec.core.protocols import Drafter
from specdec.v1 import common_pb2

if TYPE_CHECKING:
    from specdec.models.runner import ModelRunner


@dataclass(frozen=True)
class ServedDraft:
    drafter: Drafter
    info: common_pb2.ModelInfo
    runner: ModelRunner | None = None  # None: model-free


def served(loaded) -> ServedDraft:
    """A ServedDraft as is; a loaded model (`LoadedModel`: runner and Info) behind its LocalDrafter."""
    if isinstance(loaded, ServedDraft):
        return loaded
    from draft_service.proposer import LocalDrafter

    return ServedDraft(LocalDrafter(loaded.runner), loaded.info, loaded.runner)


def model_free_info(tokenizer, model_id: str) -> common_pb2.ModelInfo:
    """Info of a draft without a model: the vocabulary, EOS ids and fingerprint of the target's
    tokenizer (its proposals are ids of that vocabulary), no position limit, no hidden states."""
    from specdec.models.sources import tokenizer_fingerprint

    eos = [] if tokenizer.eos_token_id is None else [int(tokenizer.eos_token_id)]
    return common_pb2.ModelInfo(
        model_id=model_id,
        vocab_size=len(tokenizer),
        tokenizer_fingerprint=tokenizer_fingerprint(tokenizer),
        eos_token_ids=eos,
        dtype="",
        device="cpu",
        max_position_embeddings=0,  # no position limit of its own
        role="draft",
        hidden_size=0,
        needs_target_hidden_states=False,
    )
