"""Domain logic of the target: p_1..p_{K+1} from ONE forward over prefix + x_1..x_K.

`verify` is what the target service runs; `LocalVerifier` is the same function as the engine's
Verifier in one process (no server).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np
import torch

from specdec.core.protocols import NO_DEADLINE, Deadline, VerifyRequest, VerifyResult
from specdec.core.sampling import Sampling
from specdec.models.runner import ModelRunner
from specdec.models.warping import to_wire, warp_logits


def verify(
    runner: ModelRunner, requests: Sequence[VerifyRequest], sampling: Sampling, deadline: Deadline = NO_DEADLINE
) -> list[VerifyResult]:
    """One forward over all sequences; none if `deadline` has passed (or the caller left) while
    the call waited for the model thread."""
    deadline.check()
    if len(requests) == 1:
        request = requests[0]
        result = runner.last_logits(
            request.cache_key,
            request.prefix_token_ids + request.draft_token_ids,
            len(request.draft_token_ids) + 1,
            hidden_from=request.hidden_from,
        )
        hidden = result.hidden.numpy() if result.hidden is not None else None
        return [VerifyResult(to_wire(warp_logits(result.logits, sampling)), result.cached_tokens, hidden)]
    num_last = [len(r.draft_token_ids) + 1 for r in requests]
    want_hidden = any(r.hidden_from is not None for r in requests)
    results = runner.batch_forward(
        [r.prefix_token_ids + r.draft_token_ids for r in requests],
        num_last,
        hidden_from=[r.hidden_from or 0 for r in requests] if want_hidden else None,
    )
    probs = to_wire(warp_logits(torch.cat([r.logits for r in results]), sampling))
    bounds = np.cumsum([0, *num_last])
    return [
        VerifyResult(
            probs[bounds[i] : bounds[i + 1]],
            0,
            results[i].hidden.numpy() if request.hidden_from is not None else None,
        )
        for i, request in enumerate(requests)
    ]


class LocalVerifier:
    """The engine's Verifier for a model loaded in this process (`specdec generate --in-process`)."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner

    def verify(self, requests: Sequence[VerifyRequest], sampling: Sampling, deadline: Deadline) -> list[VerifyResult]:
        deadline.check()
        results = self.runner.on_model_thread(verify, self.runner, list(requests), sampling, deadline)
        # Hidden states as the wire carries them (float16), so a hidden-state draft reads the
        # same numbers in both modes.
        return [r if r.hidden is None else replace(r, hidden=r.hidden.astype(np.float16)) for r in results]
