"""The speculative decoding loop: draft -> verify -> accept/reject, round after round.

Transport-free domain logic: it talks to the model pools through the clients'
`propose` / `verify` and leaves sessions, text streaming and protobuf
responses to the servicer. All randomness derives from (seed, sample, round),
so a seeded request gives the same tokens on any coordinator replica.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from coordinator.clients import Deadline
from specdec.errors import ServiceError
from specdec.sampling import Sampling, derive_seed, rng_for, speculative_round
from specdec.v1 import coordinator_pb2, draft_pb2, target_pb2
from specdec.wire import decode_probs, encode_hidden_states, sampling_to_proto

FINISH_LENGTH = coordinator_pb2.FINISH_REASON_LENGTH
FINISH_EOS = coordinator_pb2.FINISH_REASON_EOS
FINISH_STOP = coordinator_pb2.FINISH_REASON_STOP

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
    num_speculative_tokens: int
    stop: tuple[str, ...] = ()
    eos_token_ids: frozenset[int] = frozenset()
    num_samples: int = 1
    max_context: int = 0  # the target's position limit (0 = unknown)
    max_draft_context: int = 0  # the draft's position limit (0 = unknown)
    cache_key: str = ""  # KV-cache key for the model services (single-sample requests)
    sample_batch_size: int = 1024
    # The draft reads the target's hidden states (ModelInfo.needs_target_hidden_states).
    draft_needs_hidden: bool = False


@dataclass
class Sample:
    """One sequence being generated."""

    index: int
    context: list[int]
    generated: list[int] = field(default_factory=list)
    finish_reason: int = 0  # FINISH_REASON_UNSPECIFIED while running
    stopped_text: str | None = None  # text cut before a stop string, once one matched
    # [m, H] float16: the target's final hidden states at context positions 0..m-1, for a
    # draft that reads them. Kept for the whole call; rebuilt by the first round of the next.
    target_hidden: np.ndarray | None = None

    @property
    def running(self) -> bool:
        return self.finish_reason == 0


@dataclass
class Stats:
    rounds: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    recovered_tokens: int = 0
    bonus_tokens: int = 0
    emitted_tokens: int = 0
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0
    prompt_tokens: int = 0
    started: float = field(default_factory=time.perf_counter)

    def to_proto(self, generated_tokens: int) -> coordinator_pb2.GenerationStats:
        total = time.perf_counter() - self.started
        return coordinator_pb2.GenerationStats(
            rounds=self.rounds,
            drafted_tokens=self.drafted_tokens,
            accepted_tokens=self.accepted_tokens,
            acceptance_rate=self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0,
            mean_tokens_per_round=self.emitted_tokens / self.rounds if self.rounds else 0.0,
            draft_time_s=self.draft_time_s,
            verify_time_s=self.verify_time_s,
            coordinator_time_s=max(0.0, total - self.draft_time_s - self.verify_time_s),
            total_time_s=total,
            tokens_per_second=generated_tokens / total if total > 0 else 0.0,
            prompt_tokens=self.prompt_tokens,
            generated_tokens=generated_tokens,
            recovered_tokens=self.recovered_tokens,
            bonus_tokens=self.bonus_tokens,
        )


@dataclass(frozen=True)
class RoundEvent:
    """After one round: the samples that took part and what each appended."""

    round_index: int
    new_tokens: dict[int, list[int]]  # sample index -> tokens appended this round


class SpeculativeEngine:
    def __init__(self, draft, target, decode: Callable[[Sequence[int]], str]):
        self.draft = draft
        self.target = target
        self.decode = decode

    def run(
        self, spec: GenerationSpec, samples: list[Sample], stats: Stats, deadline: Deadline
    ) -> Iterator[RoundEvent]:
        """Advance `samples` in lockstep rounds until each finishes; yields after every round."""
        round_index = 0
        while True:
            running = [s for s in samples if s.running]
            if not running:
                return
            yield self._round(spec, running, round_index, stats, deadline)
            round_index += 1

    # ------------------------------------------------------------ one round

    def _num_draft_tokens(self, spec: GenerationSpec, sample: Sample) -> int:
        # Drafting past max_new_tokens or the context window is wasted work.
        k = min(spec.num_speculative_tokens, spec.max_new_tokens - len(sample.generated) - 1)
        for limit in (spec.max_context, spec.max_draft_context):
            if limit:
                k = min(k, limit - len(sample.context))
        return max(0, k)

    @staticmethod
    def _known_hidden(spec: GenerationSpec, sample: Sample) -> int:
        """Rows of the target's hidden states this sample holds (0 unless the draft reads them)."""
        if not spec.draft_needs_hidden or spec.num_speculative_tokens <= 0 or sample.target_hidden is None:
            return 0
        return min(sample.target_hidden.shape[0], len(sample.context) - 1)

    def _cache_key(self, spec: GenerationSpec, sample: Sample) -> str:
        return spec.cache_key if spec.num_samples == 1 else ""

    def _round(
        self, spec: GenerationSpec, running: list[Sample], round_index: int, stats: Stats, deadline: Deadline
    ) -> RoundEvent:
        sampling_proto = sampling_to_proto(spec.sampling)
        ks = [self._num_draft_tokens(spec, s) for s in running]
        reads_hidden = spec.draft_needs_hidden and spec.num_speculative_tokens > 0
        known = [self._known_hidden(spec, s) for s in running]
        if reads_hidden:
            # The draft at position t reads the target's state at t - 1: until the target has
            # returned them for the whole context (its first round here), the round is target-only.
            ks = [k if known[i] == len(running[i].context) - 1 else 0 for i, k in enumerate(ks)]
        drafts: list[list[int]] = [[] for _ in running]
        draft_probs: list[np.ndarray | None] = [None for _ in running]

        proposing = [i for i, k in enumerate(ks) if k > 0]
        if proposing:
            request = draft_pb2.ProposeRequest(
                sequences=[
                    draft_pb2.DraftSequence(
                        session_id=self._cache_key(spec, running[i]),
                        prefix_token_ids=running[i].context,
                        num_draft_tokens=ks[i],
                        seed=derive_seed(spec.seed, running[i].index, round_index, _DRAFT_STREAM),
                        target_hidden_states=(
                            encode_hidden_states(running[i].target_hidden[: known[i]]) if reads_hidden else None
                        ),
                    )
                    for i in proposing
                ],
                sampling=sampling_proto,
            )
            started = time.perf_counter()
            response = self.draft.propose(request, deadline)
            stats.draft_time_s += time.perf_counter() - started
            if len(response.proposals) != len(proposing):
                raise ServiceError(f"draft returned {len(response.proposals)} proposals for {len(proposing)} sequences")
            for i, proposal in zip(proposing, response.proposals, strict=True):
                drafts[i] = list(proposal.draft_token_ids)
                draft_probs[i] = decode_probs(proposal.draft_probs)
                if len(drafts[i]) != ks[i] or draft_probs[i].shape[0] != ks[i]:
                    raise ServiceError(f"draft returned {len(drafts[i])} tokens / {draft_probs[i].shape} for K={ks[i]}")

        request = target_pb2.VerifyRequest(
            sequences=[
                target_pb2.VerifySequence(
                    session_id=self._cache_key(spec, s),
                    prefix_token_ids=s.context,
                    draft_token_ids=drafts[i],
                    hidden_states_from=known[i] if reads_hidden else None,
                )
                for i, s in enumerate(running)
            ],
            sampling=sampling_proto,
        )
        started = time.perf_counter()
        response = self.target.verify(request, deadline)
        stats.verify_time_s += time.perf_counter() - started
        if len(response.verifications) != len(running):
            raise ServiceError(f"target returned {len(response.verifications)} results for {len(running)} sequences")

        new_tokens: dict[int, list[int]] = {}
        for i, (sample, verification) in enumerate(zip(running, response.verifications, strict=True)):
            target_probs = decode_probs(verification.target_probs)
            if target_probs.shape[0] != ks[i] + 1:
                raise ServiceError(f"target returned {target_probs.shape[0]} laws for K={ks[i]}")
            if draft_probs[i] is not None and draft_probs[i].shape[1] != target_probs.shape[1]:
                raise ServiceError(
                    f"draft and target laws differ in vocabulary size: "
                    f"{draft_probs[i].shape[1]} vs {target_probs.shape[1]}"
                )
            result = speculative_round(
                drafts[i],
                draft_probs[i] if draft_probs[i] is not None else np.empty((0, target_probs.shape[1]), np.float32),
                target_probs,
                rng_for(spec.seed, sample.index, round_index, _ACCEPT_STREAM),
            )
            stats.rounds += 1
            stats.drafted_tokens += ks[i]
            stats.accepted_tokens += len(result.accepted_tokens)
            stats.recovered_tokens += result.recovered_token is not None
            stats.bonus_tokens += result.bonus_token is not None
            stats.emitted_tokens += len(result.tokens)
            if reads_hidden:
                self._keep_hidden(sample, verification, known[i], ks[i], len(result.accepted_tokens))
            new_tokens[sample.index] = self._append(spec, sample, result.tokens)
        return RoundEvent(round_index, new_tokens)

    @staticmethod
    def _keep_hidden(sample: Sample, verification, known: int, k: int, accepted: int) -> None:
        """Extend the sample's hidden states by the rows the target just computed on tokens that stay.

        The target ran positions known..n+K-1 (n = context length before this round). Rows up to
        the last accepted draft token (n - 1 + accepted) belong to the committed context; the
        rejected drafts' rows do not, and the new last token has none yet (the next round's
        Verify returns it).
        """
        n = len(sample.context)  # called before the round's tokens are appended
        if not verification.HasField("hidden_states"):
            raise ServiceError(
                "the target returned no hidden states, which this draft reads: the target service "
                "must support VerifySequence.hidden_states_from"
            )
        try:
            rows = decode_probs(verification.hidden_states)
        except ValueError as exc:
            raise ServiceError(f"target hidden states: {exc}") from exc
        if rows.ndim != 2 or rows.shape[0] != n + k - known:
            raise ServiceError(f"target returned hidden states {rows.shape} for positions {known}..{n + k - 1}")
        keep = rows[: n + accepted - known]
        old = sample.target_hidden[:known] if sample.target_hidden is not None and known else None
        sample.target_hidden = keep if old is None else np.concatenate([old, keep])

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
        if spec.stop:
            self._apply_stop_strings(spec, sample, before)
        return sample.generated[before:]

    def _apply_stop_strings(self, spec: GenerationSpec, sample: Sample, before: int) -> None:
        text = self.decode(sample.generated)
        if not any(stop in text for stop in spec.stop):
            return
        # The earliest token count whose text holds a stop string ends the sample there.
        for count in range(before + 1, len(sample.generated) + 1):
            text = self.decode(sample.generated[:count])
            hits = [text.find(stop) for stop in spec.stop if stop in text]
            if hits:
                dropped = len(sample.generated) - count
                del sample.generated[count:]
                if dropped:
                    del sample.context[-dropped:]
                sample.stopped_text = text[: min(hits)]
                sample.finish_reason = FINISH_STOP
                return

    def text_of(self, sample: Sample) -> str:
        return sample.stopped_text if sample.stopped_text is not None else self.decode(sample.generated)


def new_samples(spec: GenerationSpec) -> list[Sample]:
    return [Sample(index=i, context=list(spec.context_token_ids)) for i in range(spec.num_samples)]


def batches(samples: list[Sample], size: int) -> Iterator[list[Sample]]:
    for start in range(0, len(samples), size):
        yield samples[start : start + size]
