"""The speculative decoding loop: draft -> verify -> accept/reject, round after round.

Transport-free: it reaches its models through the `Drafter` / `Verifier` protocols
(`specdec.core.protocols`), whether they are gRPC clients or models in this process, and leaves
sessions, tokenisation and responses to its callers. All randomness derives from
(seed, sample, round), so a seeded request with a fixed K gives the same tokens on any
coordinator replica; with auto K (`specdec.core.kpolicy`) the K of each round follows measured
timings, so the tokens may differ while their law stays the target's.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

import numpy as np

from specdec.core.draft_health import DraftHealth
from specdec.core.errors import InconsistentDraftError, NoTargetLookup, ServiceError
from specdec.core.hidden import HiddenStateRelay
from specdec.core.kpolicy import AdaptiveK, DecodeRecord, DraftRecord, FixedK, RoundOutcome, curve_at
from specdec.core.ngram import lookup_matches
from specdec.core.protocols import (
    Deadline,
    Drafter,
    DraftProposal,
    DraftRequest,
    Verifier,
    VerifyRequest,
    VerifyResult,
)
from specdec.core.sampling import RoundResult, Sampling, derive_seed, draw, rng_for, speculative_round
from specdec.core.text import Decode, GrowingText, concatenates, stop_point

log = logging.getLogger(__name__)

# The values of specdec.v1.FinishReason.
FINISH_RUNNING = 0
FINISH_LENGTH = 1
FINISH_EOS = 2
FINISH_STOP = 3

# Streams of randomness per (sample, round): one seeds the draft's K uniforms,
# the other the coordinator's accept/recover/bonus draws.
_DRAFT_STREAM = 0
_ACCEPT_STREAM = 1


@dataclass(frozen=True)
class GenerationSpec:
    """A validated request, in tokens."""

    context_token_ids: list[int]  # session history + prompt: what the models condition on
    max_new_tokens: int
    sampling: Sampling
    seed: int
    num_speculative_tokens: int  # K; with auto_k, the largest K a round may draft
    stop: tuple[str, ...] = ()
    eos_token_ids: frozenset[int] = frozenset()
    num_samples: int = 1
    max_context: int = 0  # the target's position limit (0 = unknown)
    max_draft_context: int = 0  # the draft's position limit (0 = unknown)
    cache_key: str = ""  # the model services' KV-cache key ("" = run uncached)
    sample_batch_size: int = 1024
    # The draft reads the target's hidden states (ModelInfo.needs_target_hidden_states).
    draft_needs_hidden: bool = False
    # K chosen per round from this request's measured acceptance and costs (specdec.core.kpolicy).
    auto_k: bool = False
    # [r - 1]: the target's cost of a forward over r rows (its ModelInfo.forward_cost_ms): how
    # auto K estimates Verify lengths it has not timed yet.
    verify_costs: tuple[float, ...] = ()
    # [r - 1]: the draft's own forward costs (its forward_cost_ms; () for a model-free draft): auto
    # K drafts nothing where the two curves say no draft could pay.
    draft_costs: tuple[float, ...] = ()
    # The draft is a hybrid (ModelInfo.lookup): draft_costs are its model's, which auto K lets serve
    # only where they can pay (DraftRequest.lookup_only).
    draft_lookup: bool = False
    # Rounds at K = 0 the target may run in one call, sampling each token itself from the uniforms
    # the coordinator would have drawn (VerifyRequest.decode_uniforms): the same tokens, without a
    # round trip per token. 1 = a call per token.
    decode_steps: int = 1
    # A round whose draft proposed nothing is played as such a stretch instead of a Verify of its
    # own, ending where a lookup of this many tokens would match (VerifyRequest.stop_ngram), so the
    # next round drafts there. 0 = a round of its own.
    stop_ngram: int = 0
    # The target drafts rounds itself by its own lookup (its ModelInfo.lookup): a round at K > 0 is a
    # call of up to decode_steps such rounds (VerifyRequest.lookup_k), no Propose, no round trip
    # between them; the drafter is never called.
    target_lookup: bool = False

    def sample_cache_key(self, index: int) -> str:
        """The model services' KV-cache key of sample `index`: each of several samples has its own
        entry (they diverge after the prompt), so no round recomputes a prefix."""
        if self.num_samples == 1 or not self.cache_key:
            return self.cache_key
        return f"{self.cache_key}/{index}"


@dataclass
class Sample:
    """One sequence being generated."""

    index: int
    context: list[int]
    generated: list[int] = field(default_factory=list)
    finish_reason: int = FINISH_RUNNING
    stopped_text: str | None = None  # text cut before a stop string, once one matched
    text: GrowingText | None = field(default=None, repr=False, compare=False)  # its decode, where that grows

    @property
    def running(self) -> bool:
        return self.finish_reason == FINISH_RUNNING


@dataclass
class Stats:
    rounds: int = 0  # rounds played (all samples of a round count once; a decode-steps call plays several)
    sample_rounds: int = 0  # rounds summed over samples: what tokens per round divides by
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    recovered_tokens: int = 0
    bonus_tokens: int = 0
    emitted_tokens: int = 0
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0
    prompt_tokens: int = 0
    draft_fallback_rounds: int = 0  # rounds run at K = 0 because the draft failed or was backing off
    started: float = field(default_factory=time.perf_counter)

    def count(self, drafted: int, result: RoundResult) -> None:
        self.sample_rounds += 1
        self.drafted_tokens += drafted
        self.accepted_tokens += len(result.accepted_tokens)
        self.recovered_tokens += result.recovered_token is not None
        self.bonus_tokens += result.bonus_token is not None
        self.emitted_tokens += len(result.tokens)


@dataclass(frozen=True)
class RoundEvent:
    """After one round: the samples that took part and what each appended."""

    round_index: int  # its round (the last of them, for decode steps: several rounds at K = 0)
    new_tokens: dict[int, list[int]]  # sample index -> tokens appended this round


def check_laws(role: str, probs: np.ndarray) -> None:
    """ServiceError unless every row of `probs` is a law: finite, non-negative, summing to 1.

    A pool that returns anything else (a broken model, a bad replica) must fail the call, not
    produce tokens that get stored. 1e-4 is far above float32 rounding of a sum of laws.
    Two passes without temporaries (every row a round verifies, 49,152 entries each, 2.5x faster
    than isfinite + a comparison + a float64 sum): a minimum is NaN where any entry is, and a row
    holding +inf sums to inf.
    """
    sums = probs.sum(axis=-1)
    if (probs.size and not probs.min() >= 0) or not np.isfinite(sums).all():
        raise ServiceError(f"the {role} returned laws with NaN, infinite or negative entries")
    if np.abs(sums - 1.0).max(initial=0.0) > 1e-4:
        raise ServiceError(f"the {role} returned laws that do not sum to 1 (sums {sums.min():.6g}..{sums.max():.6g})")


@dataclass
class _Draft:
    """One sample's proposal this round (empty when it drafts nothing)."""

    tokens: list[int] = field(default_factory=list)  # [k]
    probs: np.ndarray | None = None  # [k, V] float32, None when k = 0 or point_mass
    point_mass: bool = False  # q_i = one-hot(tokens[i]), never built: speculative_round takes it so

    def laws(self, vocab: int) -> np.ndarray | None:
        """[k, V] float32 laws the tokens were drawn from, None for point masses (`speculative_round`
        takes them so); ServiceError when they cannot be over V or do not give their own tokens a
        positive probability. Decided from the draft alone, before any accept draw, so that dropping
        such a draft cannot bias the round."""
        outside = [t for t in self.tokens if not 0 <= t < vocab]
        if outside:
            raise ServiceError(f"draft proposed token id {outside[0]}, outside the target's vocabulary [0, {vocab})")
        if self.point_mass:
            return None
        rows = np.arange(len(self.tokens))
        if self.probs is None:
            return np.empty((0, vocab), np.float32)
        if self.probs.shape[1] != vocab:
            raise ServiceError(f"draft and target laws differ in vocabulary size: {self.probs.shape[1]} vs {vocab}")
        zero = np.flatnonzero(~(self.probs[rows, self.tokens] > 0))
        if zero.size:
            i = int(zero[0])
            raise InconsistentDraftError(f"draft proposed token {self.tokens[i]} with q = 0 at position {i + 1}")
        return self.probs


def checked_draft(proposal: DraftProposal, k: int) -> _Draft:
    """A proposal as this round's draft; ServiceError unless it is at most k tokens with their laws."""
    tokens = list(proposal.draft_token_ids)
    if proposal.point_mass:
        if len(tokens) > k:
            raise ServiceError(f"draft returned {len(tokens)} point-mass tokens for K={k}")
        return _Draft(tokens, None, point_mass=True) if tokens else _Draft()
    probs = proposal.draft_probs
    # A drafter may propose fewer tokens than asked (none included), never more.
    if len(tokens) > k or probs is None or probs.ndim != 2 or probs.shape[0] != len(tokens):
        shape = None if probs is None else probs.shape
        raise ServiceError(f"draft returned {len(tokens)} tokens / {shape} for K={k}")
    if not tokens:
        return _Draft()
    check_laws("draft", probs)
    return _Draft(tokens, probs)


def _step_share(requests: list[VerifyRequest], results: list[VerifyResult]) -> tuple[int, int, int]:
    """(other requests' sequences, the step's rows, this request's rows in it) of the batched
    forward a Verify's sequences ran in (the largest, should they have been split)."""
    step = max(results, key=lambda r: (r.step_rows, r.step_sequences))
    own_rows = sum(
        len(q.prefix_token_ids) + len(q.draft_token_ids) - r.cached_tokens
        for q, r in zip(requests, results, strict=True)
    )
    others = max(0, step.step_sequences - len(results))
    return others, step.step_rows, min(own_rows, step.step_rows)


def _lookup_rounds(
    spec: GenerationSpec, result: VerifyResult, request: VerifyRequest
) -> list[tuple[int, RoundResult]]:
    """The rounds of a call the target drafted by lookup (`VerifyRequest.lookup_k`), as (tokens drafted,
    what the round emitted); ServiceError unless each drafted at most lookup_k, accepted at most what
    it drafted, proposed (where a shared step cut it) at least what it drafted and at most lookup_k,
    timed (where reported) in finite seconds, their tokens add up, and the call took every round it
    could or ended on a stop token."""
    tokens, rounds, proposed = list(result.decoded_token_ids), result.round_drafts, result.round_proposed
    fits = 1 <= len(rounds) <= request.rounds and all(0 <= a <= d <= request.lookup_k for d, a in rounds)
    if proposed:  # (a step verified fewer drafts than its lookup proposed: only under auto K)
        pairs = zip(rounds, proposed, strict=False)
        fits &= bool(request.lookup_acceptance) and len(proposed) == len(rounds)
        fits &= all(d <= p <= request.lookup_k for (d, _), p in pairs)
    if seconds := result.round_seconds:
        fits &= len(seconds) == len(rounds) and all(0.0 <= s < math.inf for s in seconds)
    if not fits or sum(a + 1 for _, a in rounds) != len(tokens) or len(tokens) > request.most_tokens:
        raise ServiceError(f"target returned rounds {list(rounds)} ({len(tokens)} tokens) for {request.rounds} rounds")
    played, start = [], 0
    for drafted, accepted in rounds:
        emitted = tokens[start : start + accepted + 1]
        last = emitted[-1]  # recovered at a rejection, else the bonus
        rejected = accepted < drafted
        played.append((drafted, RoundResult(emitted[:-1], last if rejected else None, None if rejected else last)))
        start += accepted + 1
    short = len(rounds) < request.rounds and len(tokens) < request.most_tokens
    if short and spec.eos_token_ids.isdisjoint(played[-1][1].tokens):
        raise ServiceError(f"target played {len(rounds)} of {request.rounds} rounds without a stop token")
    return played


class SpeculativeEngine:
    """`health`: the draft pool's, shared by every request (by default the drafter's own, as a
    DraftClient keeps one): while the draft is down, rounds run at K = 0 instead of failing."""

    def __init__(self, drafter: Drafter, verifier: Verifier, decode: Decode, health: DraftHealth | None = None):
        self.drafter = drafter
        self.verifier = verifier
        self.decode = decode
        self.health = health if health is not None else getattr(drafter, "health", None) or DraftHealth()
        # What every request's rounds showed of the draft's model; greedy and sampled requests apart
        # (a greedy draft is accepted where its argmax is the target's: another rate).
        self.records = {True: DraftRecord(), False: DraftRecord()}
        self.decode_record = DecodeRecord()  # what auto K's decode steps cost against a Verify here

    def run(
        self, spec: GenerationSpec, samples: list[Sample], stats: Stats, deadline: Deadline, first_round: int = 0
    ) -> Iterator[RoundEvent]:
        """Advance `samples` in lockstep rounds until each finishes; yields after every round.

        `first_round`: the index of the first round's randomness; an interrupted generation resumed
        from its saved samples at the round where it stopped continues the same seeded stream."""
        # One policy for the samples of this run: it reads only rounds already played.
        k_max = spec.num_speculative_tokens
        policy, record = FixedK(k_max), self.records[spec.sampling.greedy]
        if spec.auto_k:
            policy = AdaptiveK(
                k_max,
                verify_curve=spec.verify_costs,
                draft_curve=spec.draft_costs,
                draft_lookup=spec.draft_lookup,
                recorded=record.verdict(k_max, spec.verify_costs) if spec.draft_costs else None,
                decodes=spec.decode_steps > 1,
                decode_prior=self.decode_record.prior(),
                stretches=spec.stop_ngram > 0,
            )
        drafter, verifier = self.drafter, self.verifier
        if spec.draft_needs_hidden and k_max > 0 and policy.drafts_at_all and not policy.lookup_only:
            # (A policy that never drafts, or drafts by lookup alone, would only make every Verify
            # return hidden states.)
            drafter = verifier = HiddenStateRelay(self.drafter, self.verifier)
            policy.decodes = False  # (the relay's K = 0 rounds are Verifies of their own: `_steps_of_round`)
        round_index, outcomes = first_round, []
        while running := [s for s in samples if s.running]:
            k = policy.choose()
            one_step = round_index == first_round or verifier is not self.verifier  # (`_steps_of_round`)
            steps = self._steps_of_round(spec, policy, k, one_step)
            if k and spec.target_lookup:
                rounds = 1 if one_step else spec.decode_steps
                call = (verifier, spec, running, rounds, round_index, stats, deadline)
                try:
                    event, played = self._decode(*call, lookup_k=k, acceptance=policy.draft_acceptance(k))
                except NoTargetLookup as exc:  # nothing ran: the round is played again, at K = 0
                    log.warning("the rest of this request runs at K = 0: %s", exc)
                    policy = FixedK(0)  # (no draft pool is asked where the target drafts)
                    continue
            elif steps > 1:
                event, played = self._decode(verifier, spec, running, steps, round_index, stats, deadline)
            else:
                event, played = self._round(
                    drafter, verifier, spec, running, k, round_index, stats, deadline, policy.lookup_only, one_step
                )
            for outcome in played:
                outcomes.append(outcome)
                policy.observe(outcome)
            if not any(s.running for s in samples):  # before the last yield: a caller need not ask past it
                if spec.draft_costs:  # (a model draft's curve: what the record is for)
                    record.add(outcomes)
                if not spec.target_lookup:  # (its rounds of one row are shares of a call, not Verifies of their own)
                    self.decode_record.add(outcomes)  # (reads only requests that played both kinds of round)
            yield event
            round_index = event.round_index + 1

    # ------------------------------------------------------------ one round

    def _round(
        self,
        drafter: Drafter,
        verifier: Verifier,
        spec: GenerationSpec,
        running: list[Sample],
        k: int,
        round_index: int,
        stats: Stats,
        deadline: Deadline,
        lookup_only: bool,
        one_step: bool = True,
    ) -> tuple[RoundEvent, list[RoundOutcome]]:
        """One round: Propose (up to k tokens a sample), Verify, accept/reject; its event and outcome.
        Where every draft came back empty (a lookup without a match), the round and the next ones
        until a lookup could match are a stretch of decode steps instead (`spec.stop_ngram`)."""
        drafts, draft_s = self._propose(drafter, spec, running, k, round_index, stats, deadline, lookup_only)
        if drafts is None:  # the draft failed or is backing off: this round is target-only
            k, drafts = 0, [_Draft() for _ in running]
        elif k and spec.stop_ngram and spec.decode_steps > 1 and not one_step and not any(d.tokens for d in drafts):
            return self._decode(verifier, spec, running, spec.decode_steps, round_index, stats, deadline, (k, draft_s))
        started = time.perf_counter()
        event, results, step = self._verify(verifier, spec, running, drafts, round_index, stats, deadline)
        # The policy prices the Verify with the accept/reject work on its laws: both grow with
        # the round's rows (a drafted row's laws cost ~0.1 ms here beside its ~1.3 ms forward).
        verify_s = time.perf_counter() - started
        counts = [(len(d.tokens), len(r.accepted_tokens)) for d, r in zip(drafts, results, strict=True)]
        rows = 1 + max(drafted for drafted, _ in counts)
        drawn = [bool(d.tokens) and not d.point_mass for d in drafts]
        return event, [RoundOutcome(k, draft_s, verify_s, rows, counts, *step, model_drawn=drawn)]

    @staticmethod
    def _num_draft_tokens(spec: GenerationSpec, sample: Sample, k: int) -> int:
        # Drafting past max_new_tokens or the context window is wasted work.
        k = min(k, spec.max_new_tokens - len(sample.generated) - 1)
        for limit in (spec.max_context, spec.max_draft_context):
            if limit:
                k = min(k, limit - len(sample.context))
        return max(0, k)

    def _propose(
        self,
        drafter: Drafter,
        spec: GenerationSpec,
        running: list[Sample],
        k: int,
        round_index: int,
        stats: Stats,
        deadline: Deadline,
        lookup_only: bool = False,
    ) -> tuple[list[_Draft] | None, float]:
        """This round's drafts (at most k tokens each; a hybrid's by its lookup alone with
        `lookup_only`) and the seconds the Propose took; None for the drafts when the draft pool
        failed or is backing off (counted in `stats`)."""
        ks = [self._num_draft_tokens(spec, s, k) for s in running]
        drafts = [_Draft() for _ in running]
        proposing = [i for i, n in enumerate(ks) if n > 0]
        if not proposing:
            return drafts, 0.0
        if not self.health.may_propose():
            self._fallback(stats)
            return None, 0.0
        started = time.perf_counter()  # the requests' making too: a drafting round pays it, K = 0 does not
        requests = [
            DraftRequest(
                cache_key=spec.sample_cache_key(running[i].index),
                prefix_token_ids=list(running[i].context),
                num_draft_tokens=ks[i],
                seed=derive_seed(spec.seed, running[i].index, round_index, _DRAFT_STREAM),
                sequence=running[i].index,
                lookup_only=lookup_only,
            )
            for i in proposing
        ]
        try:
            proposals = drafter.propose(requests, spec.sampling, deadline)
            if len(proposals) != len(proposing):
                raise ServiceError(f"draft returned {len(proposals)} proposals for {len(proposing)} sequences")
            for i, proposal in zip(proposing, proposals, strict=True):
                drafts[i] = checked_draft(proposal, ks[i])
        except ServiceError as exc:
            stats.draft_time_s += time.perf_counter() - started
            deadline.check()  # the request's own deadline passed: that is no fault of the draft
            self._draft_failed(exc, stats)
            return None, 0.0
        self.health.succeeded()
        draft_s = time.perf_counter() - started
        stats.draft_time_s += draft_s
        return drafts, draft_s

    def _draft_failed(self, error: ServiceError, stats: Stats) -> None:
        log.warning("draft failed; rounds run at K=0 for %.0f s: %s", self.health.backoff_s, error)
        self.health.failed()
        self._fallback(stats)

    def _fallback(self, stats: Stats) -> None:
        # K = 0 samples from the target's law alone: still exactly lossless, and the draft stream's
        # failure cannot bias it (the accept stream is independent of the draft's).
        stats.draft_fallback_rounds += 1
        self.health.count_fallback()

    def _verify(
        self,
        verifier: Verifier,
        spec: GenerationSpec,
        running: list[Sample],
        drafts: list[_Draft],
        round_index: int,
        stats: Stats,
        deadline: Deadline,
    ) -> tuple[RoundEvent, list[RoundResult], tuple[int, int, int]]:
        """The round's event, each sample's round result, and the batched forward the Verify ran
        in as the K policy reads it (`_step_share`)."""
        requests = [
            VerifyRequest(spec.sample_cache_key(s.index), list(s.context), drafts[i].tokens, sequence=s.index)
            for i, s in enumerate(running)
        ]
        results, _ = self._call_verifier(verifier, requests, spec.sampling, stats, deadline)
        stats.rounds += 1
        target_laws = [
            self._target_laws(draft, result.target_probs) for draft, result in zip(drafts, results, strict=True)
        ]
        draft_laws = self._vet(drafts, target_laws, stats)
        new_tokens: dict[int, list[int]] = {}
        outcomes = []
        for i, sample in enumerate(running):
            rng = rng_for(spec.seed, sample.index, round_index, _ACCEPT_STREAM)
            result = speculative_round(drafts[i].tokens, draft_laws[i], target_laws[i], rng)
            stats.count(len(drafts[i].tokens), result)
            outcomes.append(result)
            new_tokens[sample.index] = self._append(spec, sample, result.tokens)
        return RoundEvent(round_index, new_tokens), outcomes, _step_share(requests, results)

    @staticmethod
    def _steps_of_round(spec: GenerationSpec, policy, k: int, one_step: bool) -> int:
        """Rounds of a K = 0 stretch to play in one call: the policy's own run of K = 0 rounds (until
        its next probe), at most spec.decode_steps; 1 (`one_step`) in a request's first round (its
        prompt: the first token goes out alone) and through the hidden-state relay (a draft's catch-up)."""
        if k or one_step or spec.decode_steps <= 1:
            return 1
        return max(1, min(spec.decode_steps, policy.zero_run()))

    def _decode(
        self,
        verifier: Verifier,
        spec: GenerationSpec,
        running: list[Sample],
        steps: int,
        round_index: int,
        stats: Stats,
        deadline: Deadline,
        asked: tuple[int, float] = (0, 0.0),
        lookup_k: int = 0,
        acceptance: tuple[float, ...] = (),
    ) -> tuple[RoundEvent, list[RoundOutcome]]:
        """Rounds round_index.. in one call, played by the target: at K = 0 each sample's token of
        round r drawn at the uniform this engine's K = 0 round r would draw (`speculative_round`'s
        bonus); at `lookup_k` each round drafted by the target's own lookup and played by
        `speculative_round` on the first lookup_k + 1 uniforms of round r's stream, as this engine
        plays a round of point masses. Returns the event and one outcome a round played (the
        call's seconds shared among them: what such a round costs the K policy). `acceptance`: auto
        K's (`VerifyRequest.lookup_acceptance`: the target may verify fewer drafts in a shared step).
        `asked`: (K, seconds) of the first round's Propose that drafted nothing (`_round`): the stretch
        then ends where a lookup could match (`spec.stop_ngram`)."""
        asked_k, draft_s = asked
        stop_ngram = spec.stop_ngram if asked_k else 0
        requests = [
            VerifyRequest(
                spec.sample_cache_key(s.index),
                list(s.context),
                [],
                sequence=s.index,
                decode_uniforms=self._uniforms(spec, s.index, round_index, min(steps, room), lookup_k + 1),
                stop_token_ids=spec.eos_token_ids,
                stop_ngram=stop_ngram,
                lookup_k=lookup_k,
                max_tokens=room if lookup_k else 0,
                lookup_acceptance=acceptance,
            )
            for s, room in ((s, self._room(spec, s)) for s in running)
        ]
        results, verify_s = self._call_verifier(verifier, requests, spec.sampling, stats, deadline)
        rounds = [self._decoded(spec, r, q) for r, q in zip(results, requests, strict=True)]
        played = max(len(r) for r in rounds)
        stats.rounds += played
        new_tokens = {}
        for sample, its_rounds in zip(running, rounds, strict=True):
            for drafted, result in its_rounds:
                stats.count(drafted, result)
            tokens = [t for _, result in its_rounds for t in result.tokens]
            new_tokens[sample.index] = self._append(spec, sample, tokens)
        event = RoundEvent(round_index + played - 1, new_tokens)
        if lookup_k:
            return event, self._lookup_outcomes(spec, lookup_k, rounds, results, verify_s)
        share = _step_share(requests, results)
        outcome = RoundOutcome(0, 0.0, verify_s / played, 1, [(0, 0)] * len(running), *share, decoded=True)
        first = replace(outcome, k=asked_k, draft_s=draft_s)  # (the policy counts an empty ask's cost)
        return event, [first] + [outcome] * (played - 1)

    @staticmethod
    def _uniforms(spec: GenerationSpec, sample: int, round_index: int, rounds: int, block: int) -> tuple[float, ...]:
        """The first `block` uniforms of each round's accept stream: what this engine's own rounds
        round_index.. would read first (one per examined draft, then the final draw)."""
        streams = (rng_for(spec.seed, sample, round_index + j, _ACCEPT_STREAM) for j in range(rounds))
        return tuple(u for rng in streams for u in rng.random(block).tolist())

    @staticmethod
    def _lookup_outcomes(
        spec: GenerationSpec,
        k: int,
        rounds: list[list[tuple[int, RoundResult]]],
        results: list[VerifyResult],
        verify_s: float,
    ) -> list[RoundOutcome]:
        """One outcome per round of a call the target drafted by lookup (`rounds`: per sample, read
        from its `results`): its rows are 1 + its longest draft verified, what each sample's lookup
        proposed (longer where a step cut it: `round_proposed`), and its seconds the call's shared by
        what each round took in the target (`round_seconds`, the longest of the samples'), else by
        the forward-cost curve at those rows (rows alone without one). The start-up curve prices a
        row at a short context: at ~550 cached tokens a lone 9-row step cost 2.4x a 1-row one,
        against 1.95x by that curve, and auto K read long drafts as cheaper than they were. Priced
        as alone: the call's steps ran in company the policy cannot apportion."""
        played = max(len(r) for r in rounds)
        per_round = [
            [(its[j][0], len(its[j][1].accepted_tokens)) for its in rounds if j < len(its)] for j in range(played)
        ]
        proposed = [r.round_proposed or tuple(d for d, _ in its) for r, its in zip(results, rounds, strict=True)]
        lengths = [[p[j] for p, its in zip(proposed, rounds, strict=True) if j < len(its)] for j in range(played)]
        rows = [1 + max(d for d, _ in pairs) for pairs in per_round]
        weights = [curve_at(spec.verify_costs, r) if spec.verify_costs else float(r) for r in rows]
        took = [[r.round_seconds[j] for r in results if j < len(r.round_seconds)] for j in range(played)]
        if all(took) and sum(max(t) for t in took) > 0:
            weights = [max(t) for t in took]
        total = sum(weights)
        return [
            RoundOutcome(k, 0.0, verify_s * w / total, r, pairs, proposed=p)
            for pairs, p, r, w in zip(per_round, lengths, rows, weights, strict=True)
        ]

    @staticmethod
    def _room(spec: GenerationSpec, sample: Sample) -> int:
        """Tokens the sample may still take: before max_new_tokens and the context window."""
        room = spec.max_new_tokens - len(sample.generated)
        if spec.max_context:
            room = min(room, spec.max_context - len(sample.context))
        return max(1, room)

    @staticmethod
    def _decoded(spec: GenerationSpec, result: VerifyResult, request: VerifyRequest) -> list[tuple[int, RoundResult]]:
        """A call's rounds as (tokens drafted, what the round emitted); ServiceError unless they are
        rounds the request asked for (`_lookup_rounds`) or its decode steps, every step taken or ended
        on a stop token or a lookup match (`VerifyRequest.stop_ngram`). A replica that runs no decode
        steps (an older one, mid-rollout) answers with the first step's law: its token is drawn here
        at the first uniform, as the target would have."""
        if request.lookup_k:
            return _lookup_rounds(spec, result, request)
        tokens, steps = list(result.decoded_token_ids), len(request.decode_uniforms)
        if not tokens and result.target_probs.shape[0] == 1:
            check_laws("target", result.target_probs)
            tokens = [draw(result.target_probs[0], request.decode_uniforms[0])]
        elif not 1 <= len(tokens) <= steps or (
            len(tokens) < steps
            and tokens[-1] not in spec.eos_token_ids
            and not lookup_matches(request.prefix_token_ids + tokens, request.stop_ngram)
        ):
            raise ServiceError(f"target returned {len(tokens)} decoded tokens for {steps} decode steps")
        return [(0, RoundResult([], None, token)) for token in tokens]

    @staticmethod
    def _call_verifier(
        verifier: Verifier, requests: list[VerifyRequest], sampling: Sampling, stats: Stats, deadline: Deadline
    ) -> tuple[list[VerifyResult], float]:
        """The Verify call's results, one per request (else ServiceError), and its seconds (counted)."""
        started = time.perf_counter()
        results = verifier.verify(requests, sampling, deadline)
        seconds = time.perf_counter() - started
        stats.verify_time_s += seconds
        if len(results) != len(requests):
            raise ServiceError(f"target returned {len(results)} results for {len(requests)} sequences")
        return results, seconds

    @staticmethod
    def _target_laws(draft: _Draft, target_probs: np.ndarray) -> np.ndarray:
        k = len(draft.tokens)
        if target_probs.ndim != 2 or target_probs.shape[0] != k + 1:
            raise ServiceError(f"target returned {target_probs.shape[0]} laws for K={k}")
        check_laws("target", target_probs)
        return target_probs

    def _vet(self, drafts: list[_Draft], target_laws: list[np.ndarray], stats: Stats) -> list[np.ndarray | None]:
        """Each draft's laws over the target's vocabulary (None: point masses). A draft that cannot be
        read over it is dropped (in place, with its target laws cut to the first): that sample's round
        is K = 0, from the law a K = 0 Verify returns."""
        laws, error = [], None
        for i, (draft, target) in enumerate(zip(drafts, target_laws, strict=True)):
            try:
                laws.append(draft.laws(target.shape[1]))
            except ServiceError as exc:
                error = exc
                drafts[i], target_laws[i] = _Draft(), target[:1]
                laws.append(np.empty((0, target.shape[1]), np.float32))
        if error is not None:
            self._draft_failed(error, stats)
        return laws

    # ------------------------------------------------------------ stopping

    def _append(self, spec: GenerationSpec, sample: Sample, tokens: list[int]) -> list[int]:
        """Append a round's tokens up to the first stopping point; returns what was kept."""
        before = len(sample.generated)
        for token in tokens:
            sample.generated.append(token)
            sample.context.append(token)
            if token in spec.eos_token_ids:
                sample.finish_reason = FINISH_EOS
            elif len(sample.generated) >= spec.max_new_tokens:
                sample.finish_reason = FINISH_LENGTH
            elif spec.max_context and len(sample.context) >= spec.max_context:
                sample.finish_reason = FINISH_LENGTH
            if not sample.running:
                break
        stopped = stop_point(self._decode_of(sample), sample.generated, before, spec.stop)
        if stopped is not None:
            count, sample.stopped_text = stopped
            dropped = len(sample.generated) - count
            del sample.generated[count:]
            if dropped:
                del sample.context[-dropped:]
            sample.finish_reason = FINISH_STOP
        return sample.generated[before:]

    def text_of(self, sample: Sample) -> str:
        return sample.stopped_text if sample.stopped_text is not None else self._decode_of(sample)(sample.generated)

    def _decode_of(self, sample: Sample) -> Decode:
        """The decode for this sample's own growing tokens: only what is new, where the decode allows."""
        if not concatenates(self.decode):
            return self.decode
        if sample.text is None:
            sample.text = GrowingText(self.decode)
        return sample.text


def new_samples(spec: GenerationSpec) -> list[Sample]:
    return [Sample(index=i, context=list(spec.context_token_ids)) for i in range(spec.num_samples)]


def batches(samples: list[Sample], size: int) -> Iterator[list[Sample]]:
    for start in range(0, len(samples), size):
        yield samples[start : start + size]
