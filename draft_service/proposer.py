"""Domain logic of the draft: sample K tokens autoregressively, keeping each law q_i.

`draft_task` is one sequence's work as a scheduler task (`specdec.models.scheduler`);
`LocalDrafter` runs a call's sequences on the model's scheduler (the draft service, in-process
mode), `propose` on the calling thread.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from specdec.core.protocols import NO_DEADLINE, Deadline, DraftProposal, DraftRequest
from specdec.core.sampling import Sampling, draw
from specdec.models.draft_artifact import fed_hidden
from specdec.models.runner import LogitsResult, ModelRunner, StepItem
from specdec.models.scheduler import SessionTask, Task, run_tasks, scheduler_for
from specdec.models.warping import wire_laws


def _uniforms(seed: int, count: int) -> np.ndarray:
    return np.random.Generator(np.random.PCG64(seed)).random(count)


def _fed_hidden(request: DraftRequest) -> torch.Tensor:
    """[len(prefix), H]: what each prefix position reads (`draft_artifact.fed_hidden`)."""
    return fed_hidden(torch.from_numpy(np.asarray(request.target_hidden, dtype=np.float32)))


def draft_task(request: DraftRequest, needs_target_hidden: bool) -> Task:
    """One sequence's K draft steps (a scheduler task): each yields the prefix so far and receives
    (its law [V] float32 as sent, the step's LogitsResult) from `draft_laws`, then samples."""
    uniforms = _uniforms(request.seed, request.num_draft_tokens)
    tokens: list[int] = []
    rows: list[np.ndarray] = []  # K x [V] float32: the law each token was drawn from
    cached = 0
    # A hidden-state draft reads the target's states along the prefix, then its own for the
    # tokens it drafts (the target has not seen those yet). Only the prefix positions are
    # cached for the next round: the drafted ones were computed from the draft's guesses.
    fed = _fed_hidden(request) if needs_target_hidden else None  # [len(prefix) + step, H]
    exact_len = len(request.prefix_token_ids) if fed is not None else None
    for step in range(request.num_draft_tokens):
        probs, result = yield StepItem(
            request.cache_key, request.prefix_token_ids + tokens, 1, input_hidden=fed, exact_len=exact_len
        )
        if step == 0:
            cached = result.cached_tokens
        # Drawn from the float32 array we send, normalised as the coordinator will: the q it
        # scores with is then the very law this token came from.
        tokens.append(draw(probs, uniforms[step]))
        rows.append(probs)
        if fed is not None:
            fed = torch.cat([fed, result.hidden[-1:]])
    return DraftProposal(tokens, np.stack(rows), cached)


def draft_laws(sampling: Sampling) -> Callable[[list[LogitsResult]], list[tuple[np.ndarray, LogitsResult]]]:
    """A call's post-processing of one step: every sequence's logits warped at once."""

    def prepare(results: list[LogitsResult]) -> list[tuple[np.ndarray, LogitsResult]]:
        probs = wire_laws(torch.cat([r.logits for r in results]), sampling)  # [n, V]
        return [(probs[i], r) for i, r in enumerate(results)]

    return prepare


def _tasks(runner: ModelRunner, requests: Sequence[DraftRequest]) -> list[SessionTask]:
    return [(r.cache_key, draft_task(r, runner.needs_target_hidden)) for r in requests]


def propose(
    runner: ModelRunner, requests: Sequence[DraftRequest], sampling: Sampling, deadline: Deadline = NO_DEADLINE
) -> list[DraftProposal]:
    """K draft steps per sequence on this thread, the sequences in lockstep (direct calls: tests,
    tools); `deadline` is checked before each step."""
    return run_tasks(runner, _tasks(runner, requests), deadline, draft_laws(sampling))


class LocalDrafter:
    """The engine's Drafter for a loaded model: its sequences join the model's scheduler, which
    batches them with every other call's (the draft service, and `--in-process`)."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner

    def propose(self, requests: Sequence[DraftRequest], sampling: Sampling, deadline: Deadline) -> list[DraftProposal]:
        deadline.check()
        # Each sequence stops before its next step once `deadline` passes or the caller leaves.
        return scheduler_for(self.runner).run(_tasks(self.runner, requests), deadline, draft_laws(sampling))
