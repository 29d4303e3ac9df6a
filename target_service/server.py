"""gRPC servicer for the target: protobuf -> VerifyRequest -> verify -> protobuf."""

from __future__ import annotations

from specdec.core.errors import InvalidArgument
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
from specdec.rpc.wire import sampling_from_proto, verify_response
from specdec.v1 import target_pb2, target_pb2_grpc
from target_service.settings import TargetSettings
from target_service.verifier import verify_scheduled


def _decode_steps_of(seq: target_pb2.VerifySequence, vocab_size: int) -> tuple[tuple[float, ...], frozenset[int]]:
    """A sequence's decode uniforms and stop tokens, InvalidArgument unless they can run."""
    uniforms = tuple(seq.decode_uniforms)
    if seq.stop_ngram > MAX_STOP_NGRAM:
        raise InvalidArgument(f"stop_ngram must be in [0, {MAX_STOP_NGRAM}], got {seq.stop_ngram}")
    if not uniforms:
        if seq.stop_ngram:
            raise InvalidArgument("stop_ngram goes with decode_uniforms")
        return (), frozenset()
    if seq.draft_token_ids or seq.HasField("hidden_states_from"):
        raise InvalidArgument("decode_uniforms run at K = 0 without hidden states")
    if len(uniforms) > MAX_DECODE_STEPS:
        raise InvalidArgument(f"{len(uniforms)} decode steps, the limit is {MAX_DECODE_STEPS}")
    if not all(0.0 <= u < 1.0 for u in uniforms):
        raise InvalidArgument("decode_uniforms must be in [0, 1)")
    validate_token_ids(list(seq.stop_token_ids), vocab_size, "stop_token_ids")
    return uniforms, frozenset(seq.stop_token_ids)


class TargetServicer(ModelServicerBase, target_pb2_grpc.TargetServiceServicer):
    role = "target"

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
            uniforms, stops = _decode_steps_of(seq, runner.vocab_size)
            validate_length(len(prefix) + len(uniforms) - 1, runner.max_positions)
            parsed.append(VerifyRequest(seq.cache_key, prefix, drafts, hidden_from, 0, uniforms, stops, seq.stop_ngram))
        return parsed

    @grpc_errors
    def Verify(self, request, context):  # noqa: N802 - gRPC name
        try:
            sampling = sampling_from_proto(request.sampling)
        except ValueError as exc:
            raise InvalidArgument(str(exc)) from exc
        runner, requests = self.loaded.runner, self._requests(request)
        # The sequences join the model's scheduler (batched with other calls' sequences); none
        # runs once the caller has gone, even after waiting for its step.
        return verify_response(verify_scheduled(runner, requests, sampling, CallDeadline.of(context)))

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
    return grpc_server, grpc_server.port
