"""Domain logic of the target: p_1..p_{K+1} from ONE forward over prefix + x_1..x_K."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from specdec.runner import ModelRunner
from specdec.sampling import Sampling, to_wire, warp_logits


@dataclass(frozen=True)
class VerifyRequest:
    session_id: str
    prefix_token_ids: list[int]
    draft_token_ids: list[int]
    hidden_from: int | None = None  # also return final hidden states from this position on


@dataclass(frozen=True)
class VerifyResult:
    target_probs: np.ndarray  # [K + 1, V] float32
    cached_tokens: int
    hidden: np.ndarray | None = None  # [len(prefix) + K - hidden_from, H] float32, when asked


def verify(runner: ModelRunner, requests: Sequence[VerifyRequest], sampling: Sampling) -> list[VerifyResult]:
    if len(requests) == 1:
        request = requests[0]
        result = runner.last_logits(
            request.session_id,
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
