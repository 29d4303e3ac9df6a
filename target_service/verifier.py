"""Domain logic of the target: p_1..p_{K+1} from ONE forward over prefix + x_1..x_K (or several
rounds played here from the coordinator's uniforms: decode steps at K = 0, or rounds drafted by the
target's own lookup).

`verify_task` is one sequence's work as a scheduler task (`specdec.models.scheduler`);
`verify_scheduled` runs a call's sequences on the model's scheduler (the target service,
`LocalVerifier` in-process), `verify` on the calling thread.
"""

from __future__ import annotations

import itertools
import operator
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from specdec.core.engine import check_laws
from specdec.core.errors import NoTargetLookup
from specdec.core.ngram import lookup_matches
from specdec.core.protocols import NO_DEADLINE, Deadline, Drafter, DraftRequest, VerifyRequest, VerifyResult
from specdec.core.sampling import RoundResult, Sampling, greedy_round, speculative_round
from specdec.models.runner import LogitsResult, ModelRunner, StepItem
from specdec.models.scheduler import Prepare, SessionTask, Task, run_tasks, scheduler_for
from specdec.models.warping import greedy_tokens, wire_laws


def verify_task(request: VerifyRequest, lookup: Drafter | None = None) -> Task:
    """One sequence's forward over prefix + drafts (a scheduler task of one step); it receives
    (its laws [K+1, V] float32 as sent, the LogitsResult) from `verify_laws`. With decode
    uniforms, rounds played here instead (`_rounds_task`), drafted by `lookup` at lookup_k."""
    if request.decode_uniforms:
        return (yield from _rounds_task(request, lookup))
    probs, result = yield StepItem(
        request.cache_key,
        request.prefix_token_ids + request.draft_token_ids,
        len(request.draft_token_ids) + 1,
        hidden_from=request.hidden_from,
    )
    hidden = result.hidden.numpy() if result.hidden is not None else None  # [len - hidden_from, H]
    return VerifyResult(probs, result.cached_tokens, hidden, result.step_sequences, result.step_rows)


class _Uniforms:
    """A round's block of the coordinator's uniforms, read as `speculative_round` reads its rng."""

    def __init__(self, values: Sequence[float]):
        self._values = iter(values)

    def random(self) -> float:
        return next(self._values)


def _rounds_task(request: VerifyRequest, lookup: Drafter | None) -> Task:
    """Rounds without the round trips: each drafts up to lookup_k point masses by `lookup` (none at
    lookup_k = 0: a decode step), runs one step over them and plays `speculative_round` on its laws
    at its block of uniforms, as the coordinator's round would on the same float32 laws; the next
    round steps from its tokens (the session's cache rolls back what was rejected). Ends after a
    stop token, at max_tokens, or where a lookup of stop_ngram tokens would match (the coordinator
    drafts from there). Under auto K a shared step may verify a round's first drafts only
    (`VerifyRequest.lookup_acceptance`): the round is then played as one of those."""
    tokens, decoded, played, proposed, first = list(request.prefix_token_ids), [], [], [], None
    block, limit = request.lookup_k + 1, request.most_tokens
    seconds, started = [], time.perf_counter()
    for r in range(request.rounds):
        k = min(request.lookup_k, limit - len(decoded) - 1)
        drafts = _lookup(lookup, request, tokens, k) if k > 0 else []
        gains = tuple(itertools.accumulate(request.lookup_acceptance[: len(drafts)], operator.mul))
        laws, result = yield StepItem(request.cache_key, tokens + drafts, len(drafts) + 1, gains=gains)
        first = result if first is None else first
        verified = drafts[: len(laws) - 1]  # (a shared step may leave out a tail: `draft_rows`)
        outcome = _play(verified, laws, request.decode_uniforms[r * block : (r + 1) * block])
        decoded += outcome.tokens
        tokens += outcome.tokens
        played.append((len(verified), len(outcome.accepted_tokens)))
        proposed.append(len(drafts))
        seconds.append(time.perf_counter() - started)
        started += seconds[-1]
        if (
            len(decoded) >= limit
            or not request.stop_token_ids.isdisjoint(outcome.tokens)
            or lookup_matches(tokens, request.stop_ngram)
        ):
            break
    no_laws = np.empty((0, 0), np.float32)  # (the decoded tokens are the answer)
    rounds = tuple(played) if request.lookup_k else ()
    cut = tuple(proposed) if any(p > d for p, (d, _) in zip(proposed, played, strict=True)) else ()
    step = (result.step_sequences, result.step_rows)
    timed = tuple(seconds) if request.lookup_k else ()
    return VerifyResult(no_laws, first.cached_tokens, None, *step, tuple(decoded), rounds, cut, timed)


@dataclass(frozen=True)
class GreedyLaws:
    """A sequence's greedy laws [K+1, V] by their tokens (`greedy_tokens`): the one-hot rows that
    rounds played here at T = 0 never read, not built (5 rows: 0.46 -> 0.03 ms a round)."""

    tokens: np.ndarray  # [K+1] int64

    def __len__(self) -> int:
        return len(self.tokens)


def _play(verified: list[int], laws: np.ndarray | GreedyLaws, uniforms: Sequence[float]) -> RoundResult:
    """A round of point masses at its block of uniforms, on the float32 laws the coordinator would
    be sent (checked as it checks them), or on greedy laws' tokens (`greedy_round`: the same tokens)."""
    if isinstance(laws, GreedyLaws):
        return greedy_round(verified, laws.tokens)
    check_laws("target", laws)
    return speculative_round(verified, None, laws, _Uniforms(uniforms))


_NO_SAMPLING = Sampling()  # (a lookup draft's point masses read no sampling parameters)


def _lookup(lookup: Drafter, request: VerifyRequest, tokens: list[int], k: int) -> list[int]:
    """The lookup's point masses for the sequence so far (its seed unused: a lookup draws nothing)."""
    if lookup is None:
        raise NoTargetLookup()
    (proposal,) = lookup.propose([DraftRequest(request.cache_key, tokens, k, 0)], _NO_SAMPLING, NO_DEADLINE)
    return list(proposal.draft_token_ids)[:k]


def verify_laws(sampling: Sampling, requests: Sequence[VerifyRequest] = ()) -> Prepare:
    """A call's post-processing of one step: every sequence's logits warped at once; at T = 0 for a
    call of rounds played here (`requests` all with decode uniforms), their greedy laws' tokens."""
    if sampling.greedy and requests and all(r.decode_uniforms for r in requests):
        return lambda results: [(GreedyLaws(greedy_tokens(r.logits)), r) for r in results]

    def prepare(results: list[LogitsResult]) -> list[tuple[np.ndarray, LogitsResult]]:
        # One sequence (a lone stream's Verify): its rows as they are, not a copy of a megabyte.
        logits = results[0].logits if len(results) == 1 else torch.cat([r.logits for r in results])
        probs = wire_laws(logits, sampling)  # [sum(K+1), V]
        bounds = np.cumsum([0, *(r.logits.shape[0] for r in results)])
        return [(probs[bounds[i] : bounds[i + 1]], r) for i, r in enumerate(results)]

    return prepare


def _tasks(requests: Sequence[VerifyRequest], lookup: Drafter | None) -> list[SessionTask]:
    return [(r.cache_key, verify_task(r, lookup)) for r in requests]


def verify(
    runner: ModelRunner,
    requests: Sequence[VerifyRequest],
    sampling: Sampling,
    deadline: Deadline = NO_DEADLINE,
    lookup: Drafter | None = None,
) -> list[VerifyResult]:
    """One forward per sequence on this thread, the sequences in one step (direct calls)."""
    return run_tasks(runner, _tasks(requests, lookup), deadline, verify_laws(sampling, requests))


def verify_scheduled(
    runner: ModelRunner,
    requests: Sequence[VerifyRequest],
    sampling: Sampling,
    deadline: Deadline,
    lookup: Drafter | None = None,
) -> list[VerifyResult]:
    """The sequences on the model's scheduler, batched with every other call's; none runs once
    `deadline` has passed (or the caller left) while it waited. `lookup`: the target's own lookup
    draft, for rounds it plays (VerifyRequest.lookup_k)."""
    steps_on = any(r.decode_uniforms for r in requests)  # decode steps do not wait for company
    _index(lookup, requests)
    return scheduler_for(runner).run(_tasks(requests, lookup), deadline, verify_laws(sampling, requests), steps_on)


def _index(lookup: Drafter | None, requests: Sequence[VerifyRequest]) -> None:
    """Show the lookup each drafting sequence's prefix on the calling thread, asking for nothing: a
    suffix draft indexes what is new in it there (a new session's prompt: ~40 us a token), not on
    the model thread, whose every step all streams wait for; the rounds then add a few tokens each."""
    drafting = [DraftRequest(r.cache_key, r.prefix_token_ids, 0, 0) for r in requests if r.lookup_k]
    if lookup is not None and drafting:
        lookup.propose(drafting, _NO_SAMPLING, NO_DEADLINE)


class LocalVerifier:
    """The engine's Verifier for a model loaded in this process (`specdec generate --in-process`);
    `lookup`: its own lookup draft, as a target service's (`SPECDEC_TARGET_LOOKUP`)."""

    def __init__(self, runner: ModelRunner, lookup: Drafter | None = None):
        self.runner = runner
        self.lookup = lookup

    def verify(self, requests: Sequence[VerifyRequest], sampling: Sampling, deadline: Deadline) -> list[VerifyResult]:
        deadline.check()
        results = verify_scheduled(self.runner, list(requests), sampling, deadline, self.lookup)
        # Hidden states as the wire carries them (float16), so a hidden-state draft reads the
        # same numbers in both modes.
        return [r if r.hidden is None else replace(r, hidden=r.hidden.astype(np.float16)) for r in results]
