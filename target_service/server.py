"""gRPC servicer for the target: protobuf -> VerifyRequest -> verify -> protobuf."""

from __future__ import annotations

from dataclasses import replace

from specdec.core.errors import InvalidArgument, NoTargetLookup
from specdec.core.lookup import SuffixDrafter, lookup_drafter
from specdec.core.protocols import MAX_DECODE_STEPS, MAX_STOP_NGRAM, VerifyRequest
from specdec.rpc.errors import grpc_errors
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
from specdec.rpc.metrics import observe_suffix_cache
from specdec.rpc.wire import sampling_from_proto, verify_response
from specdec.v1 import common_pb2, target_pb2, target_pb2_grpc
from target_service.settings import TargetSettings
from target_service.verifier import verify_scheduled


def _rounds_of(seq: target_pb2.VerifySequence, vocab_size: int, max_lookup_k: int) -> dict:
    """A sequence's decode uniforms, stop tokens, stop n, lookup K, token bound and acceptance as
    VerifyRequest fields; InvalidArgument unless they can run, lookup_k up to `max_lookup_k`."""
    uniforms = tuple(seq.decode_uniforms)
    if seq.stop_ngram > MAX_STOP_NGRAM:
        raise InvalidArgument(f"stop_ngram must be in [0, {MAX_STOP_NGRAM}], got {seq.stop_ngram}")
    if not uniforms:
        if seq.stop_ngram or seq.lookup_k or seq.max_tokens or seq.lookup_acceptance:
            raise InvalidArgument("stop_ngram, lookup_k, max_tokens and lookup_acceptance go with decode_uniforms")
        return {}
    if seq.draft_token_ids or seq.HasField("hidden_states_from"):
        raise InvalidArgument("decode_uniforms run without draft tokens or hidden states")
    if seq.lookup_k > max_lookup_k:
        raise InvalidArgument(f"lookup_k must be in [0, {max_lookup_k}], got {seq.lookup_k}")
    block = seq.lookup_k + 1
    if len(uniforms) % block or len(uniforms) > MAX_DECODE_STEPS * block:
        raise InvalidArgument(
            f"{len(uniforms)} decode uniforms: lookup_k + 1 = {block} a round, at most {MAX_DECODE_STEPS} rounds"
        )
    if not all(0.0 <= u < 1.0 for u in uniforms):
        raise InvalidArgument("decode_uniforms must be in [0, 1)")
    acceptance = tuple(seq.lookup_acceptance)
    if acceptance and (len(acceptance) != seq.lookup_k or not all(0.0 <= c <= 1.0 for c in acceptance)):
        raise InvalidArgument(f"lookup_acceptance must be empty or lookup_k = {seq.lookup_k} values in [0, 1]")
    validate_token_ids(list(seq.stop_token_ids), vocab_size, "stop_token_ids")
    return dict(
        decode_uniforms=uniforms,
        stop_token_ids=frozenset(seq.stop_token_ids),
        stop_ngram=seq.stop_ngram,
        lookup_k=seq.lookup_k,
        max_tokens=seq.max_tokens,
        lookup_acceptance=acceptance,
    )


class TargetServicer(ModelServicerBase, target_pb2_grpc.TargetServiceServicer):
    role = "target"

    def __init__(self, settings: TargetSettings):
        super().__init__(settings)
        self.lookup = lookup_drafter(settings.lookup, settings) if settings.lookup else None

    def attach(self, loaded: LoadedModel) -> None:
        """The model, its Info naming this service's lookup draft (ModelInfo.lookup)."""
        info = common_pb2.ModelInfo()
        info.CopyFrom(loaded.info)
        info.lookup = self.settings.lookup
        super().attach(replace(loaded, info=info))

    def _requests(self, request: target_pb2.VerifyRequest) -> list[VerifyRequest]:
        runner = self.loaded.runner
        validate_sequence_count(len(request.sequences), self.settings.max_batch_sequences)
        parsed = []
        for seq in request.sequences:
            validate_key(seq.cache_key, "cache_key")
            prefix, drafts = list(seq.prefix_token_ids), list(seq.draft_token_ids)
            if not prefix:
                raise InvalidArgument("prefix_token_ids is empty")
            if len(drafts) > self.settings.max_draft_tokens:
                raise InvalidArgument(f"{len(drafts)} draft tokens, the limit is {self.settings.max_draft_tokens}")
            validate_token_ids(prefix, runner.vocab_size, "prefix_token_ids")
            validate_token_ids(drafts, runner.vocab_size, "draft_token_ids")
            validate_length(len(prefix) + len(drafts), runner.max_positions)
            hidden_from = seq.hidden_states_from if seq.HasField("hidden_states_from") else None
            if hidden_from is not None and not 0 <= hidden_from < len(prefix):
                raise InvalidArgument(f"hidden_states_from must be in [0, {len(prefix) - 1}], got {hidden_from}")
            request = VerifyRequest(seq.cache_key, prefix, drafts, hidden_from, **self._rounds(seq))
            validate_length(len(prefix) + max(0, request.most_tokens - 1), runner.max_positions)
            parsed.append(request)
        if self.lookup is None and any(r.lookup_k for r in parsed):  # (a valid call, for another replica)
            raise NoTargetLookup()
        return parsed

    def _rounds(self, seq: target_pb2.VerifySequence) -> dict:
        return _rounds_of(seq, self.loaded.runner.vocab_size, self.settings.max_draft_tokens)

    @grpc_errors
    def Verify(self, request, context):  # noqa: N802 - gRPC name
        try:
            sampling = sampling_from_proto(request.sampling)
        except ValueError as exc:
            raise InvalidArgument(str(exc)) from exc
        runner, requests = self.loaded.runner, self._requests(request)
        # The sequences join the model's scheduler (batched with other calls' sequences); none
        # runs once the caller has gone, even after waiting for its step.
        return verify_response(verify_scheduled(runner, requests, sampling, CallDeadline.of(context), self.lookup))

    @grpc_errors
    def Info(self, request, context):  # noqa: N802
        return self.loaded.info


def create_server(settings: TargetSettings, loaded: LoadedModel | None = None) -> tuple[GrpcServer, int]:
    """Start the target server; SERVING once the model is loaded (at once if `loaded` is given)."""
    servicer = TargetServicer(settings)
    grpc_server = start_model_server(
        settings,
        servicer,
        lambda server: target_pb2_grpc.add_TargetServiceServicer_to_server(servicer, server),
        target_pb2.DESCRIPTOR.services_by_name["TargetService"].full_name,
        loaded,
    )
    if isinstance(servicer.lookup, SuffixDrafter):
        observe_suffix_cache(grpc_server.registry, servicer.role, lambda: servicer.lookup.cached_tokens)
    return grpc_server, grpc_server.port
