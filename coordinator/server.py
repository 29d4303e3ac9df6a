"""Coordinator servicer: protobuf -> Generator (validation, session, engine) -> protobuf.

A thin shell: it turns a gRPC context into a deadline and a liveness check, keeps token
counters, and maps errors to statuses; `coordinator.generation` does the work.
"""

from __future__ import annotations

import logging
import time

from coordinator.generation import Generator
from coordinator.pools import Pools
from coordinator.requests import validate_session_id
from coordinator.sessions import SessionStore
from coordinator.settings import CoordinatorSettings
from specdec.core.engine import SpeculativeEngine, Stats
from specdec.core.errors import Unavailable
from specdec.core.protocols import Deadline
from specdec.models.sources import load_tokenizer, tokenizer_fingerprint
from specdec.rpc.clients import DraftClient, TargetClient
from specdec.rpc.errors import grpc_errors
from specdec.rpc.metrics import observe_draft_health
from specdec.rpc.server import GrpcServer, build_grpc_server
from specdec.v1 import coordinator_pb2, coordinator_pb2_grpc

log = logging.getLogger(__name__)


def deadline_of(context) -> Deadline:
    remaining = context.time_remaining()
    if remaining is None or remaining > 1e8:
        return Deadline(None)
    return Deadline(time.monotonic() + remaining)


class CoordinatorServicer(coordinator_pb2_grpc.CoordinatorServicer):
    def __init__(
        self, settings: CoordinatorSettings, store: SessionStore, draft: DraftClient, target: TargetClient, tokenizer
    ):
        self.store = store
        self.tokenizer = tokenizer
        self.pools = Pools(draft, target, settings.tokenizer, tokenizer_fingerprint(tokenizer))
        engine = SpeculativeEngine(draft, target, self.decode)
        self.generator = Generator(settings, engine, self.pools.info, tokenizer, store)
        self._tokens_metric = self._rounds_metric = None

    def use_registry(self, registry) -> None:
        """Token-level counters next to the per-call ones the interceptor keeps."""
        self._tokens_metric = registry.counter(
            "specdec_tokens_total", "tokens by kind: prompt, generated, drafted, accepted", ("kind",)
        )
        self._rounds_metric = registry.counter("specdec_rounds_total", "speculative rounds run")
        self.generator.on_finish = self._record

    def _record(self, stats: Stats, generated: int) -> None:
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

    @grpc_errors
    def Generate(self, request, context):  # noqa: N802 - gRPC name
        return self.generator.generate(request, deadline_of(context), context.is_active)

    @grpc_errors
    def GenerateStream(self, request, context):  # noqa: N802
        yield from self.generator.stream(request, deadline_of(context), context.is_active)

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
    """Start the coordinator; SERVING once the tokenizer has loaded. Redis need not answer yet:
    until it does, session calls fail with UNAVAILABLE (a warning says so at start)."""
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(settings.tokenizer)
    store = SessionStore.from_url(
        settings.redis_url, settings.session_key_prefix, settings.session_ttl_s, settings.session_lock_ttl_s
    )
    pool_options = {"credentials": None, "attempts": settings.call_attempts, "keepalive_s": settings.keepalive_s}
    draft = DraftClient(
        settings.draft_address,
        settings.draft_timeout_s,
        settings.info_timeout_s,
        settings.max_message_mb,
        backoff_s=settings.draft_backoff_s,
        **pool_options,
    )
    target = TargetClient(
        settings.target_address,
        settings.verify_timeout_s,
        settings.info_timeout_s,
        settings.max_message_mb,
        **pool_options,
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
    observe_draft_health(grpc_server.registry, draft.health)
    servicer.pools.refresh_s = settings.pool_info_refresh_s
    grpc_server.server.start()
    try:
        store.ping()
    except Unavailable:
        log.warning(
            "Redis at %s is not reachable yet; session calls fail with UNAVAILABLE until it is", settings.redis_url
        )
    grpc_server.set_serving(True)
    return grpc_server, grpc_server.port
