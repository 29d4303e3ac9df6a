"""Coordinator servicer: protobuf -> Generator (validation, session, engine) -> protobuf.

A thin shell: it turns a gRPC context into a deadline, a liveness check and the request id its
log lines carry, exports the generation metrics, and maps errors to statuses;
`coordinator.generation` does the work.
"""

from __future__ import annotations

import functools
import inspect
import logging
import time

from coordinator.auth import ApiKeys
from coordinator.generation import Generator
from coordinator.local_draft import LocalDraft, load_local_draft
from coordinator.pools import Pools
from coordinator.requests import validate_session_id
from coordinator.resume import resumable_tokens
from coordinator.sessions import SessionStore
from coordinator.settings import CoordinatorSettings
from specdec.core.call_batching import BatchingVerifier
from specdec.core.engine import SpeculativeEngine
from specdec.core.errors import Unavailable
from specdec.core.protocols import Deadline
from specdec.models.sources import TokenizerText, load_tokenizer, tokenizer_fingerprint
from specdec.rpc.clients import DraftClient, TargetClient
from specdec.rpc.errors import grpc_errors
from specdec.rpc.logs import REQUEST_ID_KEY, log_context, request_id_or_new
from specdec.rpc.metrics import (
    GenerationMetrics,
    observe_call_batching,
    observe_draft_health,
    observe_draft_records,
)
from specdec.rpc.server import GrpcServer, build_grpc_server, configure_observability
from specdec.rpc.tls import ChannelCertificateFiles, TlsFiles, redact_url
from specdec.v1 import coordinator_pb2, coordinator_pb2_grpc

log = logging.getLogger(__name__)


def deadline_of(context) -> Deadline:
    remaining = context.time_remaining()
    if remaining is None or remaining > 1e8:
        return Deadline(None)
    return Deadline(time.monotonic() + remaining)


def request_id_of(context) -> str:
    """The caller's x-request-id when it is a sane token, else a new random one."""
    given = next((value for key, value in context.invocation_metadata() or () if key == REQUEST_ID_KEY), "")
    return request_id_or_new(given)


def request_scope(method):
    """Servicer-method decorator: the call's log lines carry its request id (and session id once
    known), error statuses included."""
    if inspect.isgeneratorfunction(method):

        @functools.wraps(method)
        def stream_wrapper(self, request, context):
            with log_context(request_id_of(context)):
                yield from method(self, request, context)

        return stream_wrapper

    @functools.wraps(method)
    def wrapper(self, request, context):
        with log_context(request_id_of(context)):
            return method(self, request, context)

    return wrapper


class CoordinatorServicer(coordinator_pb2_grpc.CoordinatorServicer):
    def __init__(
        self,
        settings: CoordinatorSettings,
        store: SessionStore,
        draft: DraftClient | LocalDraft,
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
        self.decode = TokenizerText(tokenizer)
        verifier = BatchingVerifier(target, settings.verify_batch_wait_ms / 1000, settings.sample_batch_size)
        engine = SpeculativeEngine(draft, verifier, self.decode)
        self.generator = Generator(settings, engine, self.pools.info, tokenizer, store)

    def use_registry(self, registry) -> None:
        """Generation metrics next to the per-call ones the interceptor keeps."""
        self.generator.metrics = GenerationMetrics(registry, self.generator.settings.max_num_speculative_tokens)

    def tenant(self, context) -> str:
        """The caller's tenant from its API key (UNAUTHENTICATED without a valid one; "" with keys off)."""
        return self.api_keys.tenant_of(context.invocation_metadata())

    @request_scope
    @grpc_errors
    def Generate(self, request, context):
        tenant = self.tenant(context)
        return self.generator.generate(request, deadline_of(context), context.is_active, tenant=tenant)

    @request_scope
    @grpc_errors
    def GenerateStream(self, request, context):
        tenant = self.tenant(context)
        yield from self.generator.stream(request, deadline_of(context), context.is_active, tenant=tenant)

    @grpc_errors
    def GetSession(self, request, context):
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
    def DeleteSession(self, request, context):
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


def session_store(settings: CoordinatorSettings) -> SessionStore:
    """The sessions' Redis, with a connection for every thread that may use one at once."""
    # redis-py's pool opens at most 100 connections, then refuses commands (MaxConnectionsError:
    # UNAVAILABLE to the caller, seen at 128 streams): each worker thread and each stream's lease
    # heartbeat may hold one at a time. Connections open lazily: an unused bound costs nothing.
    return SessionStore.from_url(
        settings.redis_url,
        settings.session_key_prefix,
        settings.session_ttl_s,
        settings.session_lock_ttl_s,
        max_connections=2 * settings.max_workers + 8,
    )


def create_server(settings: CoordinatorSettings, tokenizer=None) -> tuple[GrpcServer, int]:
    """Start the coordinator; SERVING once the tokenizer has loaded. Redis need not answer yet:
    until it does, session calls fail with UNAVAILABLE (a warning says so at start)."""
    configure_observability("specdec-coordinator", settings)  # before the channels and the server
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(settings.tokenizer)
    store = session_store(settings)
    pool_options = {
        "credentials": pool_channel_credentials(settings),
        "attempts": settings.call_attempts,
        "keepalive_s": settings.keepalive_s,
    }
    draft = (
        load_local_draft(settings.local_draft, settings, settings.tokenizer, tokenizer)
        if settings.local_draft
        else DraftClient(
            settings.draft_address,
            settings.draft_timeout_s,
            settings.info_timeout_s,
            settings.max_message_mb,
            backoff_s=settings.draft_backoff_s,
            **pool_options,
        )
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
    if isinstance(draft, LocalDraft):
        draft.observe(grpc_server.registry)
    observe_draft_records(grpc_server.registry, servicer.generator.engine.records)
    observe_call_batching(grpc_server.registry, servicer.generator.engine.verifier.stats)
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
