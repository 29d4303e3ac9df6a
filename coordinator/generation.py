"""One Generate call, from request to response: validation, the session, tokens, the engine's
rounds, text and stats. The gRPC servicer and the in-process mode (`specdec generate
--in-process`) both run it; only where the models are and whether sessions persist differ.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass

from coordinator.pools import PoolInfo
from coordinator.requests import RequestParams, prompt_token_ids, validate_request
from coordinator.sessions import SessionLease, SessionStore
from coordinator.settings import CoordinatorSettings
from specdec.core.engine import GenerationSpec, RoundEvent, Sample, SpeculativeEngine, Stats, batches, new_samples
from specdec.core.errors import FailedPrecondition, InvalidArgument
from specdec.core.protocols import Deadline
from specdec.core.text import TextStream
from specdec.rpc.wire import stats_to_proto
from specdec.v1 import coordinator_pb2


@dataclass
class Generation:
    """A started call: its spec, its samples as they grow, and the session it owns."""

    spec: GenerationSpec
    samples: list[Sample]
    stats: Stats
    deadline: Deadline
    session_id: str  # "" for num_samples > 1 and in-process calls
    lease: SessionLease | None


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
        self.on_finish: Callable[[Stats, int], None] = lambda stats, generated: None

    def _session(self, request, params: RequestParams, stack: ExitStack) -> tuple[str, SessionLease | None, list[int]]:
        """(session id, lease, stored history) for this call; a new session unless it continues one."""
        if self.store is None:
            if request.session_id:
                raise InvalidArgument("sessions need the coordinator's Redis; this generator has none")
            return "", None, []
        if request.session_id:
            lease = stack.enter_context(self.store.lease(request.session_id))
            # Read under the lease: NOT_FOUND releases it, and no other call can change it now.
            return request.session_id, lease, self.store.get(request.session_id).token_ids
        if params.num_samples > 1:
            return "", None, []
        session_id = self.store.new_session_id()
        return session_id, stack.enter_context(self.store.lease(session_id)), []

    def start(self, request, deadline: Deadline, streaming: bool, stack: ExitStack) -> Generation:
        params = validate_request(request, self.settings, streaming)
        pools = self.pool_info(deadline, params.num_speculative_tokens > 0)
        if params.num_speculative_tokens > 0 and pools.compatible_error:
            raise FailedPrecondition(pools.compatible_error)
        session_id, lease, history = self._session(request, params, stack)
        prompt = prompt_token_ids(self.tokenizer, request, bool(history), pools.target.vocab_size)
        if not prompt and not history:
            raise InvalidArgument("the prompt is empty")
        spec = self._spec(request, params, pools, history + prompt, session_id)
        samples = new_samples(spec)
        return Generation(spec, samples, Stats(prompt_tokens=len(prompt)), deadline, session_id, lease)

    def _spec(
        self, request, params: RequestParams, pools: PoolInfo, context_ids: list[int], session_id: str
    ) -> GenerationSpec:
        max_context = pools.target.max_position_embeddings
        if max_context and len(context_ids) >= max_context:
            raise InvalidArgument(
                f"{len(context_ids)} context tokens leave no room in the target's {max_context} positions"
            )
        return GenerationSpec(
            context_token_ids=context_ids,
            max_new_tokens=params.max_new_tokens,
            sampling=params.sampling,
            seed=request.seed if request.HasField("seed") else secrets.randbits(63),
            num_speculative_tokens=params.num_speculative_tokens,
            auto_k=params.auto_k,
            verify_costs=tuple(pools.target.forward_cost_ms),
            stop=tuple(request.stop),
            eos_token_ids=frozenset() if request.ignore_eos else frozenset(pools.target.eos_token_ids),
            num_samples=params.num_samples,
            max_context=max_context,
            max_draft_context=pools.draft.max_position_embeddings if pools.draft is not None else 0,
            draft_needs_hidden=pools.draft is not None and pools.draft.needs_target_hidden_states,
            # Without a session (in-process) the model caches still want a key per call.
            cache_key=session_id or secrets.token_hex(8),
            sample_batch_size=self.settings.sample_batch_size,
        )

    def rounds(self, gen: Generation, is_active: Callable[[], bool]) -> Iterator[RoundEvent]:
        """Run the engine over the samples in batches; saves the session after every round."""
        for batch in batches(gen.samples, gen.spec.sample_batch_size):
            for event in self.engine.run(gen.spec, batch, gen.stats, gen.deadline):
                if gen.lease is not None:
                    gen.lease.save(batch[0].context)
                yield event
                if not is_active():
                    return

    def generate(self, request, deadline: Deadline, is_active: Callable[[], bool]) -> coordinator_pb2.GenerateResponse:
        with ExitStack() as stack:
            gen = self.start(request, deadline, False, stack)
            for _ in self.rounds(gen, is_active):
                pass
            generated = sum(len(s.generated) for s in gen.samples)
            self.on_finish(gen.stats, generated)
            completions = [
                coordinator_pb2.Completion(
                    text=self.engine.text_of(s), token_ids=s.generated, finish_reason=s.finish_reason
                )
                for s in gen.samples
            ]
            return coordinator_pb2.GenerateResponse(
                completions=completions,
                stats=stats_to_proto(gen.stats, generated),
                session_id=gen.session_id,
                seed=gen.spec.seed,
            )

    def stream(
        self, request, deadline: Deadline, is_active: Callable[[], bool]
    ) -> Iterator[coordinator_pb2.GenerateChunk]:
        """One chunk per round (text deltas that never take back what they sent), then a final one."""
        with ExitStack() as stack:
            gen = self.start(request, deadline, True, stack)
            (sample,) = gen.samples
            text = TextStream(gen.spec.stop)
            ids = {"session_id": gen.session_id, "seed": gen.spec.seed}
            for event in self.rounds(gen, is_active):
                delta = text.delta(self.engine.text_of(sample), not sample.running)
                yield coordinator_pb2.GenerateChunk(text=delta, token_ids=event.new_tokens.get(sample.index, []), **ids)
            self.on_finish(gen.stats, len(sample.generated))
            yield coordinator_pb2.GenerateChunk(
                text=text.delta(self.engine.text_of(sample), True),
                done=True,
                finish_reason=sample.finish_reason,
                stats=stats_to_proto(gen.stats, len(sample.generated)),
                **ids,
            )
