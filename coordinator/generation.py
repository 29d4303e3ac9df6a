"""One Generate call, from request to response: validation, the session, tokens, the engine's
rounds, text and stats. The gRPC servicer and the in-process mode (`specdec generate
--in-process`) both run it; only where the models are and whether sessions persist differ.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from functools import partial

from coordinator.pools import PoolInfo
from coordinator.requests import RequestParams, check_request_work, prompt_token_ids, validate_request
from coordinator.resume import check_resume_request, generation_record, resumable_tokens, resumed, tokens_held
from coordinator.sessions import RoundSaves, SessionLease, SessionRecord, SessionStore
from coordinator.settings import CoordinatorSettings
from specdec.core.engine import GenerationSpec, RoundEvent, Sample, SpeculativeEngine, Stats, batches, new_samples
from specdec.core.errors import FailedPrecondition, InvalidArgument, ServiceError
from specdec.core.protocols import Deadline
from specdec.core.sampling import RoundResult
from specdec.core.text import TextStream
from specdec.rpc import logs, tracing
from specdec.rpc.metrics import GenerationMetrics
from specdec.rpc.wire import stats_to_proto
from specdec.v1 import coordinator_pb2


log = logging.getLogger(__name__)


@dataclass
class RoundStats(Stats):
    """Stats that also keep each sequence's (drafted, accepted, tokens gained) of the round in
    progress, for the per-round metrics: the engine tallies every sequence through `count`."""

    round_sequences: list[tuple[int, int, int]] = field(default_factory=list)

    def count(self, drafted: int, result: RoundResult) -> None:
        super().count(drafted, result)
        self.round_sequences.append((drafted, len(result.accepted_tokens), len(result.tokens)))


@dataclass
class Generation:
    """A started call: its spec, its samples as they grow, and the session it owns."""

    spec: GenerationSpec
    samples: list[Sample]
    stats: RoundStats
    deadline: Deadline
    session_id: str  # "" for num_samples > 1 and in-process calls
    lease: SessionLease | None
    first_round: int = 0  # a resumed generation continues its seeded stream of rounds here
    resumed_tokens: int = 0  # tokens a resumed generation had stored before this call
    held_tokens: int = 0  # of those, the ones its client holds: a stream sends the rest again
    saved: bool = False  # the session has been stored (a new one exists only from its first save)
    draft_down: bool = False  # K > 0 asked for, the draft pool down: every round is a fallback
    arrived: float = field(default_factory=time.perf_counter)  # the call's start, for time to first token
    last_tokens_at: float | None = None  # when a round last produced tokens


def _save(gen: Generation, token_ids: list[int], generation: dict | None) -> None:
    gen.lease.save(token_ids, generation)
    gen.saved = True  # the session exists now (a new one only once saved)


class _Tally:
    """What one round added to a generation's stats: the per-round metrics and span attributes."""

    def __init__(self, stats: RoundStats):
        stats.round_sequences = []
        self._stats = stats
        self._draft_s, self._verify_s = stats.draft_time_s, stats.verify_time_s

    def read(self) -> tuple[float | None, float, list[tuple[int, int, int]]]:
        """(Propose seconds or None when the round made no Propose, Verify seconds, per sequence
        (drafted, accepted, gained))."""
        draft_s = self._stats.draft_time_s - self._draft_s
        return draft_s if draft_s > 0 else None, self._stats.verify_time_s - self._verify_s, self._stats.round_sequences


class Generator:
    def __init__(
        self,
        settings: CoordinatorSettings,
        engine: SpeculativeEngine,
        pool_info: Callable[[Deadline, bool], PoolInfo],
        tokenizer,
        store: SessionStore | None,
    ):
        self.settings = settings
        self.engine = engine
        self.pool_info = pool_info
        self.tokenizer = tokenizer
        self.store = store  # None: no sessions (in-process)
        self.metrics: GenerationMetrics | None = None  # set by a server that exports them

    def _session(
        self, request, num_samples: int, tenant: str, stack: ExitStack
    ) -> tuple[str, SessionLease | None, SessionRecord | None]:
        """(session id, lease, stored record) for this call; a new session unless it continues one."""
        if self.store is None:
            if request.session_id:
                raise InvalidArgument("sessions need the coordinator's Redis; this generator has none")
            return "", None, None
        if request.session_id:
            self.store.get(request.session_id, tenant)  # another tenant's session: NOT_FOUND, not busy
            lease = stack.enter_context(self.store.lease(request.session_id, tenant))
            # Read under the lease: NOT_FOUND releases it, and no other call can change it now.
            return request.session_id, lease, self.store.get(request.session_id, tenant)
        if num_samples > 1:
            return "", None, None
        session_id = self.store.new_session_id()
        return session_id, stack.enter_context(self.store.lease(session_id, tenant)), None

    def start(self, request, deadline: Deadline, streaming: bool, stack: ExitStack, tenant: str = "") -> Generation:
        if request.resume:
            return self._resume(request, deadline, stack, tenant, streaming)
        params = validate_request(request, self.settings, streaming)
        pools = self.pool_info(deadline, params.num_speculative_tokens > 0)
        if params.num_speculative_tokens > 0 and pools.compatible_error and not pools.target.lookup:
            raise FailedPrecondition(pools.compatible_error)
        draft_down = params.num_speculative_tokens > 0 and pools.draft is None and not pools.target.lookup
        if draft_down:  # its Info failed: its needs and limits are unknown, every round runs at K = 0
            params = replace(params, num_speculative_tokens=0, auto_k=False)
        session_id, lease, record = self._session(request, params.num_samples, tenant, stack)
        history = record.token_ids if record is not None else []
        prompt = prompt_token_ids(self.tokenizer, request, bool(history), pools.target.vocab_size)
        check_request_work(params, len(history) + len(prompt), self.settings)
        if not prompt and not history:
            raise InvalidArgument("the prompt is empty")
        spec = self._spec(request, params, pools, history + prompt, session_id)
        samples = new_samples(spec)
        stats = RoundStats(prompt_tokens=len(prompt))
        return Generation(spec, samples, stats, deadline, session_id, lease, draft_down=draft_down)

    def _resume(self, request, deadline: Deadline, stack: ExitStack, tenant: str, streaming: bool) -> Generation:
        """The interrupted generation of `request.session_id`, from where it last saved."""
        check_resume_request(request, streaming)
        session_id, lease, record = self._session(request, 1, tenant, stack)
        left = resumable_tokens(record.generation)
        pools = self.pool_info(deadline, left > 0 and record.generation["k"] > 0)
        fresh = coordinator_pb2.GenerateRequest(max_new_tokens=1, num_speculative_tokens=0, seed=0)
        base = self._spec(fresh, validate_request(fresh, self.settings, False), pools, record.token_ids, session_id)
        spec, sample, first_round = resumed(record.generation, record.token_ids, base)
        draft_down = spec.num_speculative_tokens > 0 and pools.draft is None and not spec.target_lookup
        if spec.num_speculative_tokens > 0 and ((pools.compatible_error and not spec.target_lookup) or draft_down):
            spec = replace(spec, num_speculative_tokens=0, auto_k=False)  # still the same law
        resumed_tokens = len(sample.generated)
        return Generation(
            spec,
            [sample],
            RoundStats(),
            deadline,
            session_id,
            lease,
            first_round,
            resumed_tokens,
            tokens_held(request, resumed_tokens),
            draft_down=draft_down,
        )

    def _spec(
        self, request, params: RequestParams, pools: PoolInfo, context_ids: list[int], session_id: str
    ) -> GenerationSpec:
        max_context = pools.target.max_position_embeddings
        if max_context and len(context_ids) >= max_context:
            raise InvalidArgument(
                f"{len(context_ids)} context tokens leave no room in the target's {max_context} positions"
            )
        # A target with a lookup draft drafts every round itself: the draft pool is not asked.
        draft = None if pools.target.lookup else pools.draft
        return GenerationSpec(
            context_token_ids=context_ids,
            max_new_tokens=params.max_new_tokens,
            sampling=params.sampling,
            seed=request.seed if request.HasField("seed") else secrets.randbits(63),
            num_speculative_tokens=params.num_speculative_tokens,
            auto_k=params.auto_k,
            verify_costs=tuple(pools.target.forward_cost_ms),
            draft_costs=tuple(draft.forward_cost_ms) if draft is not None else (),
            stop=tuple(request.stop),
            eos_token_ids=frozenset() if request.ignore_eos else frozenset(pools.target.eos_token_ids),
            num_samples=params.num_samples,
            max_context=max_context,
            max_draft_context=draft.max_position_embeddings if draft is not None else 0,
            draft_needs_hidden=draft is not None and draft.needs_target_hidden_states,
            draft_lookup=draft is not None and bool(draft.lookup),
            # Without a session (in-process) the model caches still want a key per call.
            cache_key=session_id or secrets.token_hex(8),
            sample_batch_size=self.settings.sample_batch_size,
            decode_steps=max(1, min(self.settings.decode_steps, pools.target.max_decode_steps)),
            stop_ngram=self.settings.decode_stop_ngram,
            target_lookup=bool(pools.target.lookup),
        )

    def rounds(self, gen: Generation, is_active: Callable[[], bool], streaming: bool) -> Iterator[RoundEvent]:
        """Run the engine over the samples in batches, each round in a span of its own.

        A stream saves its session behind the rounds handed to the client, never ahead of them
        (`RoundSaves`: at most every SESSION_SAVE_INTERVAL_S, and when it ends or fails): Redis
        holds no token the client was not sent, and a cut-off stream leaves a record that `resume`
        finishes. A unary call saves once, when it is done: it leaves the session as it was unless
        it returns (retrying it is its resume)."""
        if gen.lease is None or not streaming:
            yield from self._rounds(gen, is_active, None)
            return
        saves = RoundSaves(partial(_save, gen), gen.samples[0].context, self.settings.session_save_interval_s)
        try:
            yield from self._rounds(gen, is_active, saves)
        except BaseException:
            try:
                saves.flush()  # what was sent before the failure, so that resume starts there
            except ServiceError as exc:
                log.warning("session %s: saving the rounds sent before a failure failed: %s", gen.session_id, exc)
            raise
        saves.flush()

    def _rounds(self, gen: Generation, is_active: Callable[[], bool], saves: RoundSaves | None) -> Iterator[RoundEvent]:
        for batch in batches(gen.samples, gen.spec.sample_batch_size):
            events = self.engine.run(gen.spec, batch, gen.stats, gen.deadline, gen.first_round)
            # The engine runs a round while a sample of the batch runs: its Propose and Verify
            # happen inside next(), so their client spans are children of the round's.
            while any(s.running for s in batch):
                with tracing.span("specdec.round") as span:
                    tally, rounds = _Tally(gen.stats), gen.stats.rounds
                    event = next(events, None)
                    if event is None:
                        break
                    self._observe_round(gen, event, tally, span)
                gen.stats.draft_fallback_rounds += gen.draft_down * (gen.stats.rounds - rounds)  # decode steps: several
                yield event  # a stream is resumed here only once gRPC has sent the round's chunk
                if saves is not None:
                    (sample,) = batch
                    saves.sent(generation_record(gen.spec, sample, event.round_index + 1))
                if not is_active():
                    return

    def _observe_round(self, gen: Generation, event: RoundEvent, tally: _Tally, span) -> None:
        draft_s, verify_s, sequences = tally.read()
        if span is not None:
            drafted, accepted, gained = [sum(column) for column in zip(*sequences)] or [0, 0, 0]
            span.set_attributes(
                {
                    "specdec.round": event.round_index,
                    "specdec.drafted_tokens": drafted,
                    "specdec.accepted_tokens": accepted,
                    "specdec.tokens": gained,
                }
            )
        if self.metrics is None:
            return
        self.metrics.round(draft_s, verify_s, sequences)
        if any(event.new_tokens.values()):
            now = time.perf_counter()
            if gen.last_tokens_at is None:
                self.metrics.first_token(now - gen.arrived)
            else:
                self.metrics.next_tokens(now - gen.last_tokens_at)
            gen.last_tokens_at = now

    def generate(
        self, request, deadline: Deadline, is_active: Callable[[], bool], tenant: str = ""
    ) -> coordinator_pb2.GenerateResponse:
        arrived = time.perf_counter()
        with ExitStack() as stack:
            span = stack.enter_context(tracing.span("specdec.generate"))  # ends last: covers the lease's release
            gen = self._started(request, deadline, False, stack, tenant, arrived, span)
            for _ in self.rounds(gen, is_active, streaming=False):
                pass
            if gen.lease is not None and is_active():
                gen.lease.save(gen.samples[0].context)
            generated = sum(len(s.generated) for s in gen.samples) - gen.resumed_tokens
            self._finished(gen, generated, span)
            completions = [self._completion(gen, s) for s in gen.samples]
            return coordinator_pb2.GenerateResponse(
                completions=completions,
                stats=stats_to_proto(gen.stats, generated),
                session_id=gen.session_id,
                seed=gen.spec.seed,
            )

    def _started(
        self, request, deadline: Deadline, streaming: bool, stack: ExitStack, tenant: str, arrived: float, span
    ) -> Generation:
        """`start`, then the ids its logs and its request span (None: tracing off) carry."""
        gen = self.start(request, deadline, streaming, stack, tenant)
        gen.arrived = arrived
        logs.bind_session(gen.session_id)
        if span is not None:
            k = gen.spec.num_speculative_tokens
            span.set_attributes(
                {
                    "specdec.request_id": logs.request_id.get(),
                    "specdec.session_id": gen.session_id,
                    "specdec.k_policy": f"auto (max {k})" if gen.spec.auto_k else str(k),
                    "specdec.num_samples": len(gen.samples),
                    "specdec.streaming": streaming,
                }
            )
        return gen

    def _finished(self, gen: Generation, generated: int, span) -> None:
        stats = gen.stats
        if span is not None:
            span.set_attributes(
                {
                    "specdec.prompt_tokens": stats.prompt_tokens,
                    "specdec.generated_tokens": generated,
                    "specdec.rounds": stats.rounds,
                    "specdec.drafted_tokens": stats.drafted_tokens,
                    "specdec.accepted_tokens": stats.accepted_tokens,
                    "specdec.acceptance_rate": stats.accepted_tokens / stats.drafted_tokens
                    if stats.drafted_tokens
                    else 0.0,
                }
            )
        if self.metrics is not None:
            self.metrics.finished(
                stats.prompt_tokens, generated, stats.drafted_tokens, stats.accepted_tokens, stats.rounds
            )

    def _completion(self, gen: Generation, sample: Sample) -> coordinator_pb2.Completion:
        """What this call generated (a resumed call: only what it added)."""
        text = self.engine.text_of(sample)
        earlier = self._sent_text(gen, sample, gen.resumed_tokens)
        return coordinator_pb2.Completion(
            text=text.removeprefix(earlier),
            token_ids=sample.generated[gen.resumed_tokens :],
            finish_reason=sample.finish_reason,
        )

    def _sent_text(self, gen: Generation, sample: Sample, tokens: int) -> str:
        """The text an interrupted stream had delivered with its first `tokens` tokens."""
        if not tokens:
            return ""
        # What a stream holding back partial characters and stop-string prefixes had sent by then.
        return TextStream(gen.spec.stop).delta(self.engine.decode(sample.generated[:tokens]), False)

    def stream(
        self, request, deadline: Deadline, is_active: Callable[[], bool], tenant: str = ""
    ) -> Iterator[coordinator_pb2.GenerateChunk]:
        """One chunk per round (text deltas that never take back what they sent), then a final one."""
        arrived = time.perf_counter()
        with ExitStack() as stack:
            span = stack.enter_context(tracing.span("specdec.generate_stream"))
            gen = self._started(request, deadline, True, stack, tenant, arrived, span)
            try:
                yield from self._chunks(gen, is_active, span)
            except ServiceError as exc:
                if gen.saved or request.session_id:  # a new session exists only once saved
                    exc.session_id = gen.session_id  # the status names the session to resume
                raise

    def _chunks(self, gen: Generation, is_active: Callable[[], bool], span) -> Iterator[coordinator_pb2.GenerateChunk]:
        (sample,) = gen.samples
        text = TextStream(gen.spec.stop, self._sent_text(gen, sample, gen.held_tokens))
        ids = {"session_id": gen.session_id, "seed": gen.spec.seed}
        offset = gen.held_tokens
        if offset < gen.resumed_tokens:  # stored chunks that never reached the client: again, first
            missed = sample.generated[offset : gen.resumed_tokens]
            delta = text.delta(self.engine.text_of(sample), False)
            yield coordinator_pb2.GenerateChunk(text=delta, token_ids=missed, token_offset=offset, **ids)
            offset += len(missed)
        for event in self.rounds(gen, is_active, streaming=True):
            delta = text.delta(self.engine.text_of(sample), not sample.running)
            new = event.new_tokens.get(sample.index, [])
            yield coordinator_pb2.GenerateChunk(text=delta, token_ids=new, token_offset=offset, **ids)
            offset += len(new)
        generated = len(sample.generated) - gen.resumed_tokens
        self._finished(gen, generated, span)
        yield coordinator_pb2.GenerateChunk(
            text=text.delta(self.engine.text_of(sample), True),
            done=True,
            finish_reason=sample.finish_reason,
            stats=stats_to_proto(gen.stats, generated),
            token_offset=offset,
            **ids,
        )
