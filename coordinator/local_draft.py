"""A lookup draft run inside the coordinator (`LOCAL_DRAFT`): no draft pool, no Propose call.

The lookup drafts (`ngram`, `suffix`) cost microseconds a round, so a Propose through the draft
pool cost more in its round trip than in its drafting: 1.4-1.7 ms of a ~10 ms served round here
(README, "Configuration"). Run here, the engine asks them directly, as the in-process pipeline
does. They are the draft service's own drafters (`specdec.core.lookup`), so what a round proposes
and how it is verified are unchanged; the suffix draft's cache of recent sequences is then this
coordinator's (each replica its own).
"""

from __future__ import annotations

from collections.abc import Sequence

from specdec.core.draft_health import DraftHealth
from specdec.core.lookup import LookupSettings, lookup_drafter, lookup_model_id
from specdec.core.protocols import Deadline, DraftProposal, DraftRequest
from specdec.core.sampling import Sampling
from specdec.rpc.metrics import observe_suffix_cache
from specdec.rpc.model_service import model_free_info
from specdec.v1 import common_pb2


class LocalDraft:
    """The engine's Drafter and the Pools' draft for a lookup draft in this process; shaped like
    `DraftClient` (info, propose, health, close)."""

    def __init__(self, drafter, info: common_pb2.ModelInfo):
        self.drafter = drafter
        self._info = info
        self.health = DraftHealth()  # nothing to back off from; read by the Pools and the metrics

    def info(self, deadline: Deadline) -> common_pb2.ModelInfo:
        return self._info

    def propose(self, requests: Sequence[DraftRequest], sampling: Sampling, deadline: Deadline) -> list[DraftProposal]:
        return self.drafter.propose(requests, sampling, deadline)

    def close(self) -> None:
        pass

    def observe(self, registry) -> None:
        """The suffix draft's cache size, as a draft service reports it (`service` coordinator)."""
        if hasattr(self.drafter, "cached_tokens"):
            observe_suffix_cache(registry, "coordinator", lambda: self.drafter.cached_tokens)


def load_local_draft(name: str, settings: LookupSettings, tokenizer_spec: str, tokenizer) -> LocalDraft:
    """The lookup draft `name` (ngram or suffix) over the target's tokenizer, as `settings` configure it."""
    info = model_free_info(tokenizer, lookup_model_id(name, settings, tokenizer_spec))
    return LocalDraft(lookup_drafter(name, settings), info)
