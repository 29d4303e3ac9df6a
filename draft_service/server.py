"""gRPC servicer for the draft: protobuf -> DraftRequest -> propose -> protobuf."""

from __future__ import annotations

from functools import partial

import numpy as np

from draft_service.hidden_rows import HiddenRowStore
from draft_service.loading import load_draft
from draft_service.served import ServedDraft, served
from draft_service.settings import SUFFIX_MODEL, DraftSettings
from specdec.core.errors import InvalidArgument
from specdec.core.protocols import DraftRequest
from specdec.rpc.errors import grpc_errors
from specdec.rpc.metrics import observe_suffix_cache
from specdec.rpc.model_service import (
    CallDeadline,
    GrpcServer,
    LoadedModel,
    ModelServicerBase,
    start_model_server,
    validate_key,
    validate_length,
    validate_sequence_count,
    validate_token_ids,
)
from specdec.rpc.wire import decode_probs, propose_response, sampling_from_proto
from specdec.v1 import draft_pb2, draft_pb2_grpc


class DraftServicer(ModelServicerBase, draft_pb2_grpc.DraftServiceServicer):
    role = "draft"

    def __init__(self, settings: DraftSettings):
        super().__init__(settings)
        # Bounded as the KV cache is: a session's rows are one per token it holds.
        self.hidden_rows = HiddenRowStore(settings.cache_max_entries, settings.cache_max_tokens)

    def _requests(self, request: draft_pb2.ProposeRequest) -> list[DraftRequest]:
        info = self.loaded.info  # a model's Info reports its runner's limits; the ngram draft's too
        validate_sequence_count(len(request.sequences), self.settings.max_batch_sequences)
        parsed = []
        for seq in request.sequences:
            validate_key(seq.cache_key, "cache_key")
            validate_key(seq.hidden_states_key, "hidden_states_key")
            prefix = list(seq.prefix_token_ids)
            if not prefix:
                raise InvalidArgument("prefix_token_ids is empty")
            validate_token_ids(prefix, info.vocab_size, "prefix_token_ids")
            if not 1 <= seq.num_draft_tokens <= self.settings.max_draft_tokens:
                raise InvalidArgument(
                    f"num_draft_tokens must be in [1, {self.settings.max_draft_tokens}], got {seq.num_draft_tokens}"
                )
            validate_length(len(prefix) + seq.num_draft_tokens, info.max_position_embeddings)
            # A hybrid's lookup reads no hidden states: a lookup-only sequence needs none.
            reads_hidden = info.needs_target_hidden_states and not (seq.lookup_only and info.lookup)
            target_hidden = self._target_hidden(seq, prefix) if reads_hidden else None
            parsed.append(
                DraftRequest(
                    seq.cache_key,
                    prefix,
                    seq.num_draft_tokens,
                    seq.seed,
                    target_hidden,
                    hidden_key=seq.hidden_states_key,
                    lookup_only=seq.lookup_only,
                )
            )
        # Kept only once every sequence is valid: a request refused (a miss too) stores nothing.
        for r in parsed:
            if r.target_hidden is not None:
                self.hidden_rows.keep(r.hidden_key, r.prefix_token_ids, r.target_hidden)
        return parsed

    def _target_hidden(self, seq: draft_pb2.DraftSequence, prefix: list[int]) -> np.ndarray:
        """The [len(prefix) - 1, H] hidden states a hidden-state-conditioned draft reads: the rows
        sent, after those kept under hidden_states_key when they start at hidden_states_offset > 0."""
        offset = seq.hidden_states_offset
        if not 0 <= offset <= len(prefix) - 1:
            raise InvalidArgument(f"hidden_states_offset must be in [0, {len(prefix) - 1}], got {offset}")
        expected = (len(prefix) - 1 - offset, self.loaded.info.hidden_size)
        if not seq.HasField("target_hidden_states"):
            raise InvalidArgument(
                f"this draft is conditioned on the target's hidden states: target_hidden_states {list(expected)} is required"
            )
        try:
            hidden = decode_probs(seq.target_hidden_states)
        except ValueError as exc:
            raise InvalidArgument(f"target_hidden_states: {exc}") from exc
        if hidden.shape != expected:
            raise InvalidArgument(f"target_hidden_states has shape {list(hidden.shape)}, expected {list(expected)}")
        if not np.isfinite(hidden).all():
            raise InvalidArgument("target_hidden_states holds non-finite values")
        return self.hidden_rows.join(seq.hidden_states_key, prefix, offset, hidden)

    @grpc_errors
    def Propose(self, request, context):  # noqa: N802 - gRPC name
        try:
            sampling = sampling_from_proto(request.sampling)
        except ValueError as exc:
            raise InvalidArgument(str(exc)) from exc
        requests, drafter = self._requests(request), self.loaded.drafter
        # A model's drafter runs on the model's thread; a model-free one here (draft_service.served).
        # It stops between draft steps once the caller has gone (CallDeadline).
        return propose_response(drafter.propose(requests, sampling, CallDeadline.of(context)))

    @grpc_errors
    def Info(self, request, context):  # noqa: N802
        return self.loaded.info

    def attach(self, loaded: LoadedModel | ServedDraft) -> None:
        super().attach(served(loaded))

    def suffix_cached_tokens(self) -> int:
        """Tokens the suffix draft (alone, or a hybrid's lookup) keeps indexed; 0 before it loads."""
        drafter = None if self._loaded is None else self._loaded.drafter
        return getattr(getattr(drafter, "lookup", drafter), "cached_tokens", 0)


def create_server(settings: DraftSettings, loaded: LoadedModel | ServedDraft | None = None) -> tuple[GrpcServer, int]:
    """Start the draft server; SERVING once the draft is loaded (at once if `loaded` is given).

    `model=ngram` / `suffix` serve a model-free draft: SERVING once the tokenizer loads; a model
    with `lookup` set serves the hybrid draft (`draft_service.loading.load_draft`).
    """
    servicer = DraftServicer(settings)
    load = partial(load_draft, settings)
    grpc_server = start_model_server(
        settings,
        servicer,
        lambda server: draft_pb2_grpc.add_DraftServiceServicer_to_server(servicer, server),
        draft_pb2.DESCRIPTOR.services_by_name["DraftService"].full_name,
        loaded,
        load,
    )
    if SUFFIX_MODEL in (settings.model, settings.lookup):
        observe_suffix_cache(grpc_server.registry, servicer.role, servicer.suffix_cached_tokens)
    return grpc_server, grpc_server.port
