"""Domain logic of the draft: sample K tokens autoregressively, keeping each law q_i.

`propose` is what the draft service runs; `LocalDrafter` is the same function as the engine's
Drafter in one process (no server).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from specdec.core.protocols import NO_DEADLINE, Deadline, DraftProposal, DraftRequest
from specdec.core.sampling import Sampling, normalize, sample_token
from specdec.models.draft_artifact import fed_hidden
from specdec.models.runner import ModelRunner
from specdec.models.warping import to_wire, warp_logits


def _uniforms(seed: int, count: int) -> np.ndarray:
    return np.random.Generator(np.random.PCG64(seed)).random(count)


def _draw(probs_wire: np.ndarray, uniform: float) -> int:
    # Sample from the float32 array we send, normalised as the coordinator will:
    # the q it scores with is then the very law this token came from.
    return sample_token(normalize(probs_wire), uniform)


def _fed_hidden(request: DraftRequest) -> torch.Tensor:
    """[len(prefix), H]: what each prefix position reads (`draft_artifact.fed_hidden`)."""
    return fed_hidden(torch.from_numpy(np.asarray(request.target_hidden, dtype=np.float32)))


def propose(
    runner: ModelRunner, requests: Sequence[DraftRequest], sampling: Sampling, deadline: Deadline = NO_DEADLINE
) -> list[DraftProposal]:
    """K draft steps per sequence; `deadline` is checked before each (a call that waited in the
    model thread's queue past its caller's deadline, or whose caller left, runs no forward)."""
    if len(requests) == 1:
        return [_propose_cached(runner, requests[0], sampling, deadline)]
    return _propose_batch(runner, requests, sampling, deadline)


def _propose_cached(
    runner: ModelRunner, request: DraftRequest, sampling: Sampling, deadline: Deadline
) -> DraftProposal:
    """One sequence: each step extends the session's KV cache by one token."""
    uniforms = _uniforms(request.seed, request.num_draft_tokens)
    tokens: list[int] = []
    rows: list[np.ndarray] = []
    cached = 0
    # A hidden-state draft reads the target's states along the prefix, then its own for the
    # tokens it drafts (the target has not seen those yet). Only the prefix positions are
    # cached for the next round: the drafted ones were computed from the draft's guesses.
    fed = _fed_hidden(request) if runner.needs_target_hidden else None
    exact_len = len(request.prefix_token_ids) if fed is not None else None
    for step in range(request.num_draft_tokens):
        deadline.check()
        result = runner.last_logits(
            request.cache_key, request.prefix_token_ids + tokens, 1, input_hidden=fed, exact_len=exact_len
        )
        if step == 0:
            cached = result.cached_tokens
        probs = to_wire(warp_logits(result.logits, sampling))[0]
        tokens.append(_draw(probs, uniforms[step]))
        rows.append(probs)
        if fed is not None:
            fed = torch.cat([fed, result.hidden[-1:]])
    return DraftProposal(tokens, np.stack(rows), cached)


def _propose_batch(
    runner: ModelRunner, requests: Sequence[DraftRequest], sampling: Sampling, deadline: Deadline
) -> list[DraftProposal]:
    """Independent sequences in lockstep padded forwards (no cache: short samples)."""
    uniforms = [_uniforms(r.seed, r.num_draft_tokens) for r in requests]
    tokens: list[list[int]] = [[] for _ in requests]
    rows: list[list[np.ndarray]] = [[] for _ in requests]
    fed = [_fed_hidden(r) for r in requests] if runner.needs_target_hidden else None
    for step in range(max(r.num_draft_tokens for r in requests)):
        deadline.check()
        active = [i for i, r in enumerate(requests) if r.num_draft_tokens > step]
        results = runner.batch_forward(
            [requests[i].prefix_token_ids + tokens[i] for i in active],
            [1] * len(active),
            input_hidden=[fed[i] for i in active] if fed is not None else None,
        )
        probs = to_wire(warp_logits(torch.cat([r.logits for r in results]), sampling))
        for row, i in enumerate(active):
            tokens[i].append(_draw(probs[row], uniforms[i][step]))
            rows[i].append(probs[row])
            if fed is not None:
                fed[i] = torch.cat([fed[i], results[row].hidden[-1:]])
    return [DraftProposal(tokens[i], np.stack(rows[i]), 0) for i in range(len(requests))]


class LocalDrafter:
    """The engine's Drafter for a model loaded in this process (`specdec generate --in-process`)."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner

    def propose(self, requests: Sequence[DraftRequest], sampling: Sampling, deadline: Deadline) -> list[DraftProposal]:
        deadline.check()
        return self.runner.on_model_thread(propose, self.runner, list(requests), sampling, deadline)
