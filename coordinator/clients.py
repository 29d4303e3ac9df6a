"""gRPC clients of the draft and target pools: deadlines, load balancing, status mapping."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from specdec.errors import DeadlineExceeded, FailedPrecondition, InvalidArgument, ServiceError, Unavailable
from specdec.serving import grpc_message_options
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc

# Client-side round_robin: with a DNS name resolving to many pods (a headless
# Service) each call picks the next pod, instead of pinning one HTTP/2 connection.
_SERVICE_CONFIG = json.dumps(
    {
        "loadBalancingConfig": [{"round_robin": {}}],
        "methodConfig": [
            {
                # Propose / Verify / Info are pure functions of the request (seeded): safe to retry,
                # on another pod when one is down or at capacity.
                "name": [
                    {"service": "grpc.health.v1.Health"},
                    {"service": "specdec.v1.DraftService"},
                    {"service": "specdec.v1.TargetService"},
                ],
                "retryPolicy": {
                    "maxAttempts": 3,
                    "initialBackoff": "0.1s",
                    "maxBackoff": "1s",
                    "backoffMultiplier": 2,
                    "retryableStatusCodes": ["UNAVAILABLE", "RESOURCE_EXHAUSTED"],
                },
            }
        ],
    }
)


def channel_target(address: str) -> str:
    """`host:port`, `dns:///name:port`, or a comma list of `ip:port` (static pool) -> gRPC target."""
    address = address.strip()
    if "," not in address:
        return address
    parts = [p.strip() for p in address.split(",") if p.strip()]
    scheme = "ipv6" if any(p.startswith("[") for p in parts) else "ipv4"
    return f"{scheme}:{','.join(p.replace('localhost', '127.0.0.1') for p in parts)}"


def open_channel(address: str, max_message_mb: int) -> grpc.Channel:
    options = [*grpc_message_options(max_message_mb), ("grpc.service_config", _SERVICE_CONFIG)]
    return grpc.insecure_channel(channel_target(address), options=options)


@dataclass(frozen=True)
class Deadline:
    """An absolute deadline (from the client's, when it set one)."""

    at: float | None  # time.monotonic() value, None = no client deadline

    def timeout(self, cap_s: float) -> float:
        if self.at is None:
            return cap_s
        left = self.at - time.monotonic()
        if left <= 0:
            raise DeadlineExceeded("the request's deadline passed")
        return min(cap_s, left)


def _mapped(service: str, address: str, exc: grpc.RpcError) -> ServiceError:
    code, details = exc.code(), exc.details()
    message = f"{service} service at {address}: {details}"
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return DeadlineExceeded(message)
    if code == grpc.StatusCode.UNAVAILABLE:
        return Unavailable(message)
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return InvalidArgument(message)
    return ServiceError(message, code)


class ModelClient:
    """One pool (draft or target): a channel, the call deadline and the pool's ModelInfo."""

    def __init__(
        self, role: str, address: str, stub, call_timeout_s: float, info_timeout_s: float, max_message_mb: int
    ):
        self.role = role
        self.address = address
        self.channel = open_channel(address, max_message_mb)
        self.stub = stub(self.channel)
        self.call_timeout_s = call_timeout_s
        self.info_timeout_s = info_timeout_s

    def call(self, method: Callable, request, deadline: Deadline):
        try:
            return method(request, timeout=deadline.timeout(self.call_timeout_s))
        except grpc.RpcError as exc:
            raise _mapped(self.role, self.address, exc) from exc

    def info(self, deadline: Deadline) -> common_pb2.ModelInfo:
        try:
            return self.stub.Info(common_pb2.InfoRequest(), timeout=deadline.timeout(self.info_timeout_s))
        except grpc.RpcError as exc:
            raise _mapped(self.role, self.address, exc) from exc

    def close(self) -> None:
        self.channel.close()


class DraftClient(ModelClient):
    def __init__(self, address: str, call_timeout_s: float, info_timeout_s: float, max_message_mb: int):
        super().__init__(
            "draft", address, draft_pb2_grpc.DraftServiceStub, call_timeout_s, info_timeout_s, max_message_mb
        )

    def propose(self, request: draft_pb2.ProposeRequest, deadline: Deadline) -> draft_pb2.ProposeResponse:
        return self.call(self.stub.Propose, request, deadline)


class TargetClient(ModelClient):
    def __init__(self, address: str, call_timeout_s: float, info_timeout_s: float, max_message_mb: int):
        super().__init__(
            "target", address, target_pb2_grpc.TargetServiceStub, call_timeout_s, info_timeout_s, max_message_mb
        )

    def verify(self, request: target_pb2.VerifyRequest, deadline: Deadline) -> target_pb2.VerifyResponse:
        return self.call(self.stub.Verify, request, deadline)


def check_compatible(draft: common_pb2.ModelInfo, target: common_pb2.ModelInfo) -> None:
    """FailedPrecondition unless the draft's token ids mean what the target's do."""
    problems = []
    if draft.vocab_size != target.vocab_size:
        problems.append(f"vocab size {draft.vocab_size} vs {target.vocab_size}")
    if draft.tokenizer_fingerprint != target.tokenizer_fingerprint:
        problems.append("tokenizer fingerprints differ")
    if draft.needs_target_hidden_states and draft.hidden_size != target.hidden_size:
        problems.append(f"the draft reads hidden states of width {draft.hidden_size}, the target's are {target.hidden_size}")
    if problems:
        raise FailedPrecondition(
            f"draft model {draft.model_id!r} and target model {target.model_id!r} are incompatible "
            f"({'; '.join(problems)}): speculative rounds are refused; use num_speculative_tokens=0 "
            "or pair models that share a tokenizer"
        )
