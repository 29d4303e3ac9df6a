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
