"""Hybrid draft: a model-free lookup where it is confident, the draft model elsewhere.

Each round, every sequence first goes to the lookup (`ngram` or `suffix`, point masses); the
sequences it proposes nothing for go to the model in one call (on the model's thread, through its
`LocalDrafter`), unless sent `lookup_only` (auto K's choice where the model cannot pay). Lossless:
which drafter serves a sequence is a function of its prefix, of what the lookup has seen and of
the request, fixed before the round's draws, and each proposal carries the law it was drawn from
(one-hot, or the model's q).
"""

from __future__ import annotations

from collections.abc import Sequence

from specdec.core.protocols import Deadline, Drafter, DraftProposal, DraftRequest
from specdec.core.sampling import Sampling


class HybridDrafter:
    def __init__(self, lookup: Drafter, model: Drafter):
        self.lookup = lookup
        self.model = model

    def reset(self) -> None:
        """Forget what the lookup has cached, where it caches anything (suffix)."""
        if callable(reset := getattr(self.lookup, "reset", None)):
            reset()

    def propose(self, requests: Sequence[DraftRequest], sampling: Sampling, deadline: Deadline) -> list[DraftProposal]:
        proposals = list(self.lookup.propose(requests, sampling, deadline))
        unmatched = [i for i, p in enumerate(proposals) if not p.draft_token_ids and not requests[i].lookup_only]
        if unmatched:
            drafted = self.model.propose([requests[i] for i in unmatched], sampling, deadline)
            for i, proposal in zip(unmatched, drafted, strict=True):
                proposals[i] = proposal
        return proposals
