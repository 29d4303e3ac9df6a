"""gRPC clients of the draft and target pools: the engine's Drafter and Verifier over the wire,
with deadlines, load balancing and status mapping."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence

import grpc

from specdec.core.errors import DeadlineExceeded, InvalidArgument, ServiceError, Unavailable
from specdec.core.protocols import Deadline, DraftProposal, DraftRequest, VerifyRequest, VerifyResult
from specdec.core.sampling import Sampling
from specdec.rpc import wire
from specdec.rpc.errors import error_from_reason
from specdec.rpc.server import grpc_message_options
from specdec.v1 import common_pb2, draft_pb2_grpc, target_pb2_grpc

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


def open_channel(
    address: str, max_message_mb: int, credentials: grpc.ChannelCredentials | None = None, keepalive_s: float = 0.0
) -> grpc.Channel:
    """A channel to a pool; TLS with `credentials` (specdec.rpc.tls), keepalive pings every `keepalive_s`."""
    options = [*grpc_message_options(max_message_mb), ("grpc.service_config", _SERVICE_CONFIG)]
    if keepalive_s > 0:
        options += [("grpc.keepalive_time_ms", int(keepalive_s * 1000)), ("grpc.keepalive_permit_without_calls", 1)]
    if credentials is None:
        return grpc.insecure_channel(channel_target(address), options=options)
    return grpc.secure_channel(channel_target(address), credentials, options=options)


def _mapped(service: str, address: str, exc: grpc.RpcError) -> ServiceError:
    code, details = exc.code(), exc.details()
    message = f"{service} service at {address}: {details}"
    typed = error_from_reason(exc.trailing_metadata(), message)
    if typed is not None:
        return typed
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return DeadlineExceeded(message)
    if code == grpc.StatusCode.UNAVAILABLE:
        return Unavailable(message)
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return InvalidArgument(message)
    return ServiceError(message, code.name)


class ModelClient:
    """One pool (draft or target): a channel, the call deadline and the pool's ModelInfo."""

    def __init__(
        self,
        role: str,
        address: str,
        stub,
        call_timeout_s: float,
        info_timeout_s: float,
        max_message_mb: int,
        credentials: grpc.ChannelCredentials | None = None,
        attempts: int = 3,
        keepalive_s: float = 0.0,
    ):
        self.role = role
        self.address = address
        self.attempts = attempts
        self.channel = open_channel(address, max_message_mb, credentials, keepalive_s)
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
    """The draft pool as the engine's Drafter."""

    # The draft service keeps the hidden-state rows it was sent (per hidden_key): a relay may send
    # only new ones, and gets HiddenStatesMiss when this call's replica does not hold the rest.
    keeps_hidden_states = True

    def __init__(self, address: str, call_timeout_s: float, info_timeout_s: float, max_message_mb: int, **options):
        super().__init__(
            "draft", address, draft_pb2_grpc.DraftServiceStub, call_timeout_s, info_timeout_s, max_message_mb, **options
        )

    def propose(self, requests: Sequence[DraftRequest], sampling: Sampling, deadline: Deadline) -> list[DraftProposal]:
        response = self.call(self.stub.Propose, wire.propose_request(list(requests), sampling), deadline)
        try:
            return wire.proposals_from_proto(response)
        except ValueError as exc:
            raise ServiceError(f"draft service at {self.address}: {exc}") from exc


class TargetClient(ModelClient):
    """The target pool as the engine's Verifier."""

    def __init__(self, address: str, call_timeout_s: float, info_timeout_s: float, max_message_mb: int, **options):
        super().__init__(
            "target",
            address,
            target_pb2_grpc.TargetServiceStub,
            call_timeout_s,
            info_timeout_s,
            max_message_mb,
            **options,
        )

    def verify(self, requests: Sequence[VerifyRequest], sampling: Sampling, deadline: Deadline) -> list[VerifyResult]:
        response = self.call(self.stub.Verify, wire.verify_request(list(requests), sampling), deadline)
        try:
            return wire.verify_results_from_proto(response)
        except ValueError as exc:
            raise ServiceError(f"target service at {self.address}: {exc}") from exc
