"""Domain logic of the target: p_1..p_{K+1} from ONE forward over prefix + x_1..x_K (or, at K = 0,
several decode steps sampled here from the coordinator's uniforms).

`verify_task` is one sequence's work as a scheduler task (`specdec.models.scheduler`);
`verify_scheduled` runs a call's sequences on the model's scheduler (the target service,
`LocalVerifier` in-process), `verify` on the calling thread.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

import numpy as np
import torch

from specdec.core.engine import check_laws
from specdec.core.ngram import lookup_matches
from specdec.core.protocols import NO_DEADLINE, Deadline, VerifyRequest, VerifyResult
from specdec.core.sampling import Sampling, draw
from specdec.models.runner import LogitsResult, ModelRunner, StepItem
from specdec.models.scheduler import SessionTask, Task, run_tasks, scheduler_for
from specdec.models.warping import wire_laws


def verify_task(request: VerifyRequest) -> Task:
    """One sequence's forward over prefix + drafts (a scheduler task of one step); it receives
    (its laws [K+1, V] float32 as sent, the LogitsResult) from `verify_laws`. With decode
    uniforms, one step per uniform instead (`_decode_task`)."""
    probs, result = yield StepItem(
        request.cache_key,
        request.prefix_token_ids + request.draft_token_ids,
        len(request.draft_token_ids) + 1,
        hidden_from=request.hidden_from,
    )
    if request.decode_uniforms:
        return (yield from _decode_task(request, probs, result))
    hidden = result.hidden.numpy() if result.hidden is not None else None  # [len - hidden_from, H]
    return VerifyResult(probs, result.cached_tokens, hidden, result.step_sequences, result.step_rows)


def _decode_task(request: VerifyRequest, probs: np.ndarray, first: LogitsResult) -> Task:
    """Target-only rounds without the round trips: each step's token drawn from its law [1, V] at
    its uniform, as the coordinator's K = 0 round draws it from the same float32 law
    (`speculative_round`'s bonus), then the next step over it; the session's cache keeps every step.
    Ends after a stop token, or where a lookup of stop_ngram tokens would match (the coordinator
    drafts from there)."""
    tokens, decoded, result = list(request.prefix_token_ids), [], first
    for step, uniform in enumerate(request.decode_uniforms):
        if step:
            probs, result = yield StepItem(request.cache_key, list(tokens), 1)
        check_laws("target", probs)  # what the coordinator checks of laws it is sent
        token = draw(probs[0], uniform)
        decoded.append(token)
        tokens.append(token)
        if token in request.stop_token_ids or lookup_matches(tokens, request.stop_ngram):
            break
    laws = np.empty((0, 0), np.float32)
    return VerifyResult(laws, first.cached_tokens, None, result.step_sequences, result.step_rows, tuple(decoded))


def verify_laws(sampling: Sampling) -> Callable[[list[LogitsResult]], list[tuple[np.ndarray, LogitsResult]]]:
    """A call's post-processing of one step: every sequence's logits warped at once."""

    def prepare(results: list[LogitsResult]) -> list[tuple[np.ndarray, LogitsResult]]:
        # One sequence (a lone stream's Verify): its rows as they are, not a copy of a megabyte.
        logits = results[0].logits if len(results) == 1 else torch.cat([r.logits for r in results])
        probs = wire_laws(logits, sampling)  # [sum(K+1), V]
        bounds = np.cumsum([0, *(r.logits.shape[0] for r in results)])
        return [(probs[bounds[i] : bounds[i + 1]], r) for i, r in enumerate(results)]

    return prepare


def _tasks(requests: Sequence[VerifyRequest]) -> list[SessionTask]:
    return [(r.cache_key, verify_task(r)) for r in requests]


def verify(
    runner: ModelRunner, requests: Sequence[VerifyRequest], sampling: Sampling, deadline: Deadline = NO_DEADLINE
) -> list[VerifyResult]:
    """One forward per sequence on this thread, the sequences in one step (direct calls)."""
    return run_tasks(runner, _tasks(requests), deadline, verify_laws(sampling))


def verify_scheduled(
    runner: ModelRunner, requests: Sequence[VerifyRequest], sampling: Sampling, deadline: Deadline
) -> list[VerifyResult]:
    """The sequences on the model's scheduler, batched with every other call's; none runs once
    `deadline` has passed (or the caller left) while it waited."""
    steps_on = any(r.decode_uniforms for r in requests)  # decode steps do not wait for company
    return scheduler_for(runner).run(_tasks(requests), deadline, verify_laws(sampling), steps_on)


class LocalVerifier:
    """The engine's Verifier for a model loaded in this process (`specdec generate --in-process`)."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner

    def verify(self, requests: Sequence[VerifyRequest], sampling: Sampling, deadline: Deadline) -> list[VerifyResult]:
        deadline.check()
        results = verify_scheduled(self.runner, list(requests), sampling, deadline)
        # Hidden states as the wire carries them (float16), so a hidden-state draft reads the
        # same numbers in both modes.
        return [r if r.hidden is None else replace(r, hidden=r.hidden.astype(np.float16)) for r in results]
