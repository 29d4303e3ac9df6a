"""Coordinator servicer: protobuf -> GenerationSpec -> SpeculativeEngine -> protobuf.

Owns what the engine does not: request validation, tokenisation, the
draft/target compatibility check, sessions in Redis, deadlines and streaming.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from contextlib import ExitStack
from dataclasses import dataclass

from coordinator.clients import Deadline, DraftClient, TargetClient, check_compatible
from coordinator.generation import GenerationSpec, Sample, SpeculativeEngine, Stats, batches, new_samples
from coordinator.sessions import SessionLease, SessionStore
from coordinator.settings import CoordinatorSettings
from specdec.errors import FailedPrecondition, InvalidArgument, Unavailable, grpc_errors
from specdec.sampling import Sampling
from specdec.serving import GrpcServer, build_grpc_server
from specdec.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc
from specdec.wire import sampling_from_proto

log = logging.getLogger(__name__)

_INFO_REFRESH_S = 60.0


@dataclass(frozen=True)
class PoolInfo:
    target: common_pb2.ModelInfo
    draft: common_pb2.ModelInfo | None  # None: unreachable or never needed yet
    compatible_error: str | None  # why speculative rounds are refused, if they are


class TextStream:
    """Turns a growing token list into text deltas whose concatenation is the final text.

    Holds back a trailing partial UTF-8 character and any tail that could be the
    start of a stop string, since the final text may cut it.
    """

    def __init__(self, stop: tuple[str, ...]):
        self.stop = stop
        self.sent = ""

    def _safe(self, text: str) -> str:
        text = text.rstrip("\ufffd")
        for stop in self.stop:
            for size in range(min(len(stop) - 1, len(text)), 0, -1):
                if text.endswith(stop[:size]):
                    text = text[:-size]
                    break
        return text

    def delta(self, text: str, final: bool) -> str:
        visible = text if final else self._safe(text)
        if not visible.startswith(self.sent) or len(visible) <= len(self.sent):
            return ""
        out = visible[len(self.sent) :]
        self.sent = visible
        return out


def chat_turn_text(tokenizer, prompt: str, continuing: bool) -> str:
    """The chat-template text of one user turn, ending with the assistant's generation prompt.

    A first turn is the whole template (with any default system prompt). A follow-up turn in a
    session is what the template adds after an earlier exchange, so the system prompt and BOS
    are not repeated; templates that are not prefix-stable fall back to the first-turn form.
    """
    user = {"role": "user", "content": prompt}
    if continuing:
        earlier = [{"role": "user", "content": "."}, {"role": "assistant", "content": "."}]
        before = tokenizer.apply_chat_template(earlier, tokenize=False)
        after = tokenizer.apply_chat_template([*earlier, user], add_generation_prompt=True, tokenize=False)
        if after.startswith(before):
            return after[len(before) :]
    return tokenizer.apply_chat_template([user], add_generation_prompt=True, tokenize=False)


def validate_session_id(session_id: str) -> None:
    if not session_id:
        raise InvalidArgument("session_id is empty")
    if len(session_id) > 128 or not session_id.isprintable() or any(c.isspace() for c in session_id):
        raise InvalidArgument("session_id must be 1-128 printable characters without spaces")


class CoordinatorServicer(coordinator_pb2_grpc.CoordinatorServicer):
    def __init__(
        self, settings: CoordinatorSettings, store: SessionStore, draft: DraftClient, target: TargetClient, tokenizer
    ):
        from specdec.models import tokenizer_fingerprint

        self.settings = settings
        self.store = store
        self.draft = draft
        self.target = target
        self.tokenizer = tokenizer
        self.fingerprint = tokenizer_fingerprint(tokenizer)
        self.engine = SpeculativeEngine(draft, target, self.decode)
        self._pool_info: PoolInfo | None = None
        self._pool_info_at = 0.0
        self._pool_lock = threading.Lock()
        self._tokens_metric = self._rounds_metric = None

    def use_registry(self, registry) -> None:
        """Token-level counters next to the per-call ones the interceptor keeps."""
        self._tokens_metric = registry.counter(
            "specdec_tokens_total", "tokens by kind: prompt, generated, drafted, accepted", ("kind",)
        )
        self._rounds_metric = registry.counter("specdec_rounds_total", "speculative rounds run")

    def _record(self, stats: Stats, generated: int) -> None:
        if self._tokens_metric is None:
            return
        for kind, value in (
            ("prompt", stats.prompt_tokens),
            ("generated", generated),
            ("drafted", stats.drafted_tokens),
            ("accepted", stats.accepted_tokens),
        ):
            self._tokens_metric.inc(value, kind=kind)
        self._rounds_metric.inc(stats.rounds)

    def decode(self, token_ids) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True, clean_up_tokenization_spaces=False)

    # ------------------------------------------------------------ pools

    def pool_info(self, deadline: Deadline, need_draft: bool) -> PoolInfo:
        """Target (and draft) ModelInfo, checked for compatibility; refreshed every minute."""
        with self._pool_lock:
            info = self._pool_info
            fresh = info is not None and time.monotonic() - self._pool_info_at < _INFO_REFRESH_S
            if fresh and (info.draft is not None or not need_draft):
                return info
            target = self.target.info(deadline)
            if target.tokenizer_fingerprint != self.fingerprint:
                raise FailedPrecondition(
                    f"the coordinator's tokenizer ({self.settings.tokenizer!r}) does not match the target model "
                    f"{target.model_id!r}: set the coordinator's tokenizer to the target's model"
                )
            draft, error = None, None
            if need_draft:
                draft = self.draft.info(deadline)
                try:
                    check_compatible(draft, target)
                except FailedPrecondition as exc:
                    error = str(exc)
            self._pool_info = PoolInfo(target, draft, error)
            self._pool_info_at = time.monotonic()
            return self._pool_info

    # ------------------------------------------------------------ requests

    def _deadline(self, context) -> Deadline:
        remaining = context.time_remaining()
        if remaining is None or remaining > 1e8:
            return Deadline(None)
        return Deadline(time.monotonic() + remaining)

    def _validate(self, request: coordinator_pb2.GenerateRequest, streaming: bool) -> tuple[Sampling, int, int, int]:
        s = self.settings
        try:
            sampling = sampling_from_proto(request.sampling)
        except ValueError as exc:
            raise InvalidArgument(str(exc)) from exc
        max_new = request.max_new_tokens if request.HasField("max_new_tokens") else s.default_max_new_tokens
        if not 1 <= max_new <= s.max_new_tokens_limit:
            raise InvalidArgument(f"max_new_tokens must be in [1, {s.max_new_tokens_limit}], got {max_new}")
        k = (
            request.num_speculative_tokens
            if request.HasField("num_speculative_tokens")
            else s.default_num_speculative_tokens
        )
        if not 0 <= k <= s.max_num_speculative_tokens:
            raise InvalidArgument(f"num_speculative_tokens must be in [0, {s.max_num_speculative_tokens}], got {k}")
        num_samples = request.num_samples or 1
        if not 1 <= num_samples <= s.max_num_samples:
            raise InvalidArgument(f"num_samples must be in [1, {s.max_num_samples}], got {request.num_samples}")
        if num_samples > 1 and request.session_id:
            raise InvalidArgument("num_samples > 1 cannot continue a session")
        if num_samples > 1 and streaming:
            raise InvalidArgument("GenerateStream serves one sample; use Generate for num_samples > 1")
        if request.prompt and request.prompt_token_ids:
            raise InvalidArgument("set prompt or prompt_token_ids, not both")
        if request.chat and request.prompt_token_ids:
            raise InvalidArgument("chat applies to a text prompt, not to prompt_token_ids")
        if any(not stop for stop in request.stop):
            raise InvalidArgument("stop strings must be non-empty")
        if request.session_id:
            validate_session_id(request.session_id)
        return sampling, max_new, k, num_samples

    def _prompt_tokens(self, request: coordinator_pb2.GenerateRequest, has_history: bool, vocab_size: int) -> list[int]:
        if request.prompt_token_ids:
            ids = list(request.prompt_token_ids)
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise InvalidArgument(f"prompt_token_ids contains {bad[0]}, outside [0, {vocab_size})")
            return ids
        if not request.prompt:
            return []
        if request.chat:
            rendered = chat_turn_text(self.tokenizer, request.prompt, continuing=has_history)
            return self.tokenizer(rendered, add_special_tokens=False)["input_ids"]
        # A continued session already has its BOS.
        return self.tokenizer(request.prompt, add_special_tokens=not has_history)["input_ids"]

    def _start(self, request, context, streaming: bool, stack: ExitStack):
        """Validate, resolve the session, tokenise: -> (spec, lease or None, session id, deadline, prompt length)."""
        sampling, max_new, k, num_samples = self._validate(request, streaming)
        deadline = self._deadline(context)
        pools = self.pool_info(deadline, need_draft=k > 0)
        if k > 0 and pools.compatible_error:
            raise FailedPrecondition(pools.compatible_error)

        lease: SessionLease | None = None
        history: list[int] = []
        session_id = request.session_id
        if session_id:
            lease = stack.enter_context(self.store.lease(session_id))
            # Read under the lease: NOT_FOUND releases it, and no other call can change it now.
            history = self.store.get(session_id).token_ids
        elif num_samples == 1:
            session_id = self.store.new_session_id()
            lease = stack.enter_context(self.store.lease(session_id))

        prompt = self._prompt_tokens(request, bool(history), pools.target.vocab_size)
        if not prompt and not history:
            raise InvalidArgument("the prompt is empty")
        context_ids = history + prompt
        max_context = pools.target.max_position_embeddings
        if max_context and len(context_ids) >= max_context:
            raise InvalidArgument(
                f"{len(context_ids)} context tokens leave no room in the target's {max_context} positions"
            )
        eos = frozenset() if request.ignore_eos else frozenset(pools.target.eos_token_ids)
        spec = GenerationSpec(
            context_token_ids=context_ids,
            max_new_tokens=max_new,
            sampling=sampling,
            seed=request.seed if request.HasField("seed") else secrets.randbits(63),
            num_speculative_tokens=k,
            stop=tuple(request.stop),
            eos_token_ids=eos,
            num_samples=num_samples,
            max_context=max_context,
            max_draft_context=pools.draft.max_position_embeddings if pools.draft is not None else 0,
            draft_needs_hidden=pools.draft is not None and pools.draft.needs_target_hidden_states,
            cache_key=session_id or "",
            sample_batch_size=self.settings.sample_batch_size,
        )
        return spec, lease, session_id, deadline, len(prompt)

    def _rounds(self, spec: GenerationSpec, samples: list[Sample], stats: Stats, deadline: Deadline, lease, context):
        """Run the engine over `samples` in batches; saves the session after every round."""
        for batch in batches(samples, spec.sample_batch_size):
            for event in self.engine.run(spec, batch, stats, deadline):
                if lease is not None:
                    lease.save(batch[0].context)
                yield event
                if not context.is_active():
                    return

    @grpc_errors
    def Generate(self, request, context):  # noqa: N802 - gRPC name
        with ExitStack() as stack:
            spec, lease, session_id, deadline, prompt_len = self._start(request, context, False, stack)
            stats = Stats(prompt_tokens=prompt_len)
            samples = new_samples(spec)
            for _ in self._rounds(spec, samples, stats, deadline, lease, context):
                pass
            generated = sum(len(s.generated) for s in samples)
            self._record(stats, generated)
            return coordinator_pb2.GenerateResponse(
                completions=[
                    coordinator_pb2.Completion(
                        text=self.engine.text_of(s), token_ids=s.generated, finish_reason=s.finish_reason
                    )
                    for s in samples
                ],
                stats=stats.to_proto(generated),
                session_id=session_id or "",
                seed=spec.seed,
            )

    @grpc_errors
    def GenerateStream(self, request, context):  # noqa: N802
        with ExitStack() as stack:
            spec, lease, session_id, deadline, prompt_len = self._start(request, context, True, stack)
            stats = Stats(prompt_tokens=prompt_len)
            samples = new_samples(spec)
            (sample,) = samples
            text = TextStream(spec.stop)
            for event in self._rounds(spec, samples, stats, deadline, lease, context):
                final = not sample.running
                chunk_text = text.delta(self.engine.text_of(sample), final)
                yield coordinator_pb2.GenerateChunk(
                    text=chunk_text,
                    token_ids=event.new_tokens.get(sample.index, []),
                    session_id=session_id,
                    seed=spec.seed,
                )
            self._record(stats, len(sample.generated))
            yield coordinator_pb2.GenerateChunk(
                text=text.delta(self.engine.text_of(sample), True),
                done=True,
                finish_reason=sample.finish_reason,
                stats=stats.to_proto(len(sample.generated)),
                session_id=session_id,
                seed=spec.seed,
            )

    @grpc_errors
    def GetSession(self, request, context):  # noqa: N802
        validate_session_id(request.session_id)
        record = self.store.get(request.session_id)
        return coordinator_pb2.Session(
            session_id=record.session_id,
            token_ids=record.token_ids,
            text=self.decode(record.token_ids),
            ttl_seconds=record.ttl_seconds,
            created_at=record.created_at,
            updated_at=record.updated_at,
        )

    @grpc_errors
    def DeleteSession(self, request, context):  # noqa: N802
        validate_session_id(request.session_id)
        return coordinator_pb2.DeleteSessionResponse(deleted=self.store.delete(request.session_id))


def create_server(settings: CoordinatorSettings, tokenizer=None) -> tuple[GrpcServer, int]:
    """Start the coordinator; SERVING once Redis answers and the tokenizer has loaded."""
    from specdec.models import load_tokenizer

    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(settings.tokenizer)
    store = SessionStore.from_url(
        settings.redis_url, settings.session_key_prefix, settings.session_ttl_s, settings.session_lock_ttl_s
    )
    draft = DraftClient(
        settings.draft_address, settings.draft_timeout_s, settings.info_timeout_s, settings.max_message_mb
    )
    target = TargetClient(
        settings.target_address, settings.verify_timeout_s, settings.info_timeout_s, settings.max_message_mb
    )
    servicer = CoordinatorServicer(settings, store, draft, target, tokenizer)
    grpc_server = build_grpc_server(
        settings.host,
        settings.port,
        settings.max_workers,
        settings.max_message_mb,
        lambda server: coordinator_pb2_grpc.add_CoordinatorServicer_to_server(servicer, server),
        [coordinator_pb2.DESCRIPTOR.services_by_name["Coordinator"].full_name],
        metrics_label="coordinator",
        metrics_port=settings.metrics_port,
        max_concurrent_requests=settings.max_concurrent_requests,
    )
    servicer.use_registry(grpc_server.registry)
    grpc_server.server.start()
    try:
        store.ping()
    except Unavailable:
        log.warning(
            "Redis at %s is not reachable yet; session calls fail with UNAVAILABLE until it is", settings.redis_url
        )
    grpc_server.set_serving(True)
    return grpc_server, grpc_server.port
