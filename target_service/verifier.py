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


@dataclass(frozen=True)
class VerifyResult:
    target_probs: np.ndarray  # [K + 1, V] float32
    cached_tokens: int


def verify(runner: ModelRunner, requests: Sequence[VerifyRequest], sampling: Sampling) -> list[VerifyResult]:
    if len(requests) == 1:
        request = requests[0]
        result = runner.last_logits(
            request.session_id, request.prefix_token_ids + request.draft_token_ids, len(request.draft_token_ids) + 1
        )
        return [VerifyResult(to_wire(warp_logits(result.logits, sampling)), result.cached_tokens)]
    num_last = [len(r.draft_token_ids) + 1 for r in requests]
    logits = runner.batch_last_logits([r.prefix_token_ids + r.draft_token_ids for r in requests], num_last)
    probs = to_wire(warp_logits(torch.cat(logits), sampling))
    bounds = np.cumsum([0, *num_last])
    return [VerifyResult(probs[bounds[i] : bounds[i + 1]], 0) for i in range(len(requests))]
