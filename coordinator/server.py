"""Coordinator servicer: protobuf -> Generator (validation, session, engine) -> protobuf.

A thin shell: it turns a gRPC context into a deadline and a liveness check, keeps token
counters, and maps errors to statuses; `coordinator.generation` does the work.
"""

from __future__ import annotations

import logging
import time

from coordinator.auth import ApiKeys
from coordinator.generation import Generator
from coordinator.pools import Pools
from coordinator.requests import validate_session_id
from coordinator.resume import resumable_tokens
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
from specdec.rpc.tls import ChannelCertificateFiles, TlsFiles, redact_url
from specdec.v1 import coordinator_pb2, coordinator_pb2_grpc

log = logging.getLogger(__name__)


def deadline_of(context) -> Deadline:
    remaining = context.time_remaining()
    if remaining is None or remaining > 1e8:
        return Deadline(None)
    return Deadline(time.monotonic() + remaining)


class CoordinatorServicer(coordinator_pb2_grpc.CoordinatorServicer):
    def __init__(
        self,
        settings: CoordinatorSettings,
        store: SessionStore,
        draft: DraftClient,
        target: TargetClient,
        tokenizer,
        api_keys: ApiKeys | None = None,
    ):
        self.store = store
        self.api_keys = api_keys or ApiKeys("")
        self.tokenizer = tokenizer
        self.pools = Pools(
            draft, target, settings.tokenizer, tokenizer_fingerprint(tokenizer), settings.pool_info_refresh_s
        )
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

    def tenant(self, context) -> str:
        """The caller's tenant from its API key (UNAUTHENTICATED without a valid one; "" with keys off)."""
        return self.api_keys.tenant_of(context.invocation_metadata())

    @grpc_errors
    def Generate(self, request, context):  # noqa: N802 - gRPC name
        tenant = self.tenant(context)
        return self.generator.generate(request, deadline_of(context), context.is_active, tenant=tenant)

    @grpc_errors
    def GenerateStream(self, request, context):  # noqa: N802
        tenant = self.tenant(context)
        yield from self.generator.stream(request, deadline_of(context), context.is_active, tenant=tenant)

    @grpc_errors
    def GetSession(self, request, context):  # noqa: N802
        tenant = self.tenant(context)
        validate_session_id(request.session_id)
        record = self.store.get(request.session_id, tenant=tenant)
        return coordinator_pb2.Session(
            session_id=record.session_id,
            token_ids=record.token_ids,
            text=self.decode(record.token_ids),
            ttl_seconds=record.ttl_seconds,
            created_at=record.created_at,
            updated_at=record.updated_at,
            resumable_tokens=resumable_tokens(record.generation),
        )

    @grpc_errors
    def DeleteSession(self, request, context):  # noqa: N802
        tenant = self.tenant(context)
        validate_session_id(request.session_id)
        return coordinator_pb2.DeleteSessionResponse(deleted=self.store.delete(request.session_id, tenant=tenant))


def pool_channel_credentials(settings: CoordinatorSettings) -> ChannelCertificateFiles | None:
    """TLS to the draft and target pools when their CA is set (mutual with a client certificate), else
    None. The pool clients rebuild their channels when these files are rotated."""
    if not settings.pool_tls_ca_file:
        log.warning("the draft and target pools are reached in plaintext (no pool_tls_ca_file)")
        return None
    return ChannelCertificateFiles(settings.pool_tls_ca_file, settings.pool_tls_cert_file, settings.pool_tls_key_file)


def create_server(settings: CoordinatorSettings, tokenizer=None) -> tuple[GrpcServer, int]:
    """Start the coordinator; SERVING once the tokenizer has loaded. Redis need not answer yet:
    until it does, session calls fail with UNAVAILABLE (a warning says so at start)."""
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(settings.tokenizer)
    store = SessionStore.from_url(
        settings.redis_url, settings.session_key_prefix, settings.session_ttl_s, settings.session_lock_ttl_s
    )
    pool_options = {
        "credentials": pool_channel_credentials(settings),
        "attempts": settings.call_attempts,
        "keepalive_s": settings.keepalive_s,
    }
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
    api_keys = ApiKeys(settings.api_keys_file)
    if not api_keys.enabled:
        log.warning("no API keys file: every caller is served without authentication, as one tenant")
    servicer = CoordinatorServicer(settings, store, draft, target, tokenizer, api_keys)
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
        tls=TlsFiles.from_settings(settings),
    )
    servicer.use_registry(grpc_server.registry)
    observe_draft_health(grpc_server.registry, draft.health)
    grpc_server.server.start()
    try:
        store.ping()
    except Unavailable:
        log.warning(
            "Redis at %s is not reachable yet; session calls fail with UNAVAILABLE until it is",
            redact_url(settings.redis_url),
        )
    grpc_server.set_serving(True)
    return grpc_server, grpc_server.port
