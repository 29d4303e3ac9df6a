"""gRPC clients of the draft and target pools: the engine's Drafter and Verifier over the wire,
with deadlines, load balancing and status mapping."""

from __future__ import annotations

import json
import logging
import random
import re
import ssl
import threading
import time
from collections.abc import Callable, Sequence
from functools import partial

import grpc

from specdec.core.draft_health import DraftHealth
from specdec.core.errors import DeadlineExceeded, InvalidArgument, ServiceError, Unavailable
from specdec.core.protocols import Deadline, DraftProposal, DraftRequest, VerifyRequest, VerifyResult
from specdec.core.sampling import Sampling
from specdec.rpc import tracing, wire
from specdec.rpc.errors import REASON_KEY, error_from_reason
from specdec.rpc.metrics import AT_CAPACITY
from specdec.rpc.server import grpc_message_options
from specdec.rpc.tls import ChannelCertificateFiles
from specdec.v1 import common_pb2, draft_pb2_grpc, target_pb2_grpc

log = logging.getLogger(__name__)


# Client-side round_robin: with a DNS name resolving to many pods (a headless Service) each call
# picks the next pod, instead of pinning one HTTP/2 connection; under outlier detection, which
# stops choosing a pod whose calls keep failing (a hung pod's calls time out) for 30 s, then
# longer each time it fails again. At most half the pods are ejected, never the only one.
# No retryPolicy: gRPC retries by status code alone (a message-size RESOURCE_EXHAUSTED would be
# computed again), does not retry a request larger than its 256 KiB retry buffer, and its
# per-attempt timeout (perAttemptRecvTimeout) has open bugs in C-core (grpc/grpc#39935): attempts
# are made here instead (ModelClient.call). Transparent retries (a call that never left) remain.
def _service_config(call_timeout_s: float) -> str:
    # Failures are counted per interval: one long enough to see a few timed-out calls.
    interval_s = min(10.0, max(1.0, 2 * call_timeout_s))
    outlier_detection = {
        "interval": f"{interval_s:.3f}s",
        "baseEjectionTime": "30s",
        "maxEjectionTime": "300s",
        "maxEjectionPercent": 50,
        "failurePercentageEjection": {
            "threshold": 80,
            "enforcementPercentage": 100,
            "minimumHosts": 2,
            "requestVolume": 2,
        },
        "childPolicy": [{"round_robin": {}}],
    }
    return json.dumps({"loadBalancingConfig": [{"outlier_detection_experimental": outlier_detection}]})


def channel_target(address: str) -> str:
    """`host:port`, `dns:///name:port`, or a comma list of `ip:port` (static pool) -> gRPC target."""
    address = address.strip()
    if "," not in address:
        return address
    parts = [p.strip() for p in address.split(",") if p.strip()]
    scheme = "ipv6" if any(p.startswith("[") for p in parts) else "ipv4"
    return f"{scheme}:{','.join(p.replace('localhost', '127.0.0.1') for p in parts)}"


def open_channel(
    address: str,
    max_message_mb: int,
    credentials: grpc.ChannelCredentials | None = None,
    keepalive_s: float = 0.0,
    call_timeout_s: float = 5.0,
) -> grpc.Channel:
    """A channel to a pool; TLS with `credentials` (specdec.rpc.tls), keepalive pings every
    `keepalive_s` (a pod that stops answering them is dropped before its calls time out)."""
    options = [*grpc_message_options(max_message_mb), ("grpc.service_config", _service_config(call_timeout_s))]
    if keepalive_s > 0:
        options += [("grpc.keepalive_time_ms", int(keepalive_s * 1000)), ("grpc.keepalive_permit_without_calls", 1)]
    if credentials is None:
        channel = grpc.insecure_channel(channel_target(address), options=options)
    else:
        channel = grpc.secure_channel(channel_target(address), credentials, options=options)
    # With tracing on, each call is a client span whose context travels in its metadata.
    interceptors = tracing.client_interceptors()
    return grpc.intercept_channel(channel, *interceptors) if interceptors else channel


# host:port, [v6]:port, with an optional gRPC scheme: what transport errors may name.
_ADDRESS = re.compile(
    r"(?:ipv[46]:|dns:/*|unix:)?(?:\d{1,3}(?:\.\d{1,3}){3}|\[[0-9A-Fa-f:.]+\]|localhost|[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)+)"
    r":\d{1,5}"
)


def scrubbed(details: str | None) -> str:
    """A status's details without network addresses: they reach the coordinator's clients."""
    return _ADDRESS.sub("<address>", details or "")


def _reason(exc: grpc.RpcError) -> str:
    return next((value for key, value in exc.trailing_metadata() or () if key == REASON_KEY), "")


def retryable(exc: grpc.RpcError) -> bool:
    """Whether another attempt, on the next pod, can succeed: the pod was unreachable, did not
    answer in time, or refused the call at capacity. A RESOURCE_EXHAUSTED for a message over the
    size limit would be the same again."""
    code = exc.code()
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return True
    return code == grpc.StatusCode.RESOURCE_EXHAUSTED and _reason(exc) == AT_CAPACITY


def back_off_s(attempt: int) -> float:
    """Seconds before attempt `attempt + 1`: 0.1, 0.2, 0.4 ... up to 1 s, with jitter (so that
    requests refused together do not come back together)."""
    return min(_MAX_BACKOFF_S, _FIRST_BACKOFF_S * 2 ** (attempt - 1)) * random.uniform(0.5, 1.0)


_FIRST_BACKOFF_S = 0.1
_MAX_BACKOFF_S = 1.0


class ModelClient:
    """One pool (draft or target): a channel, the per-attempt deadline, attempts and the pool's ModelInfo.

    Each call makes up to `attempts` attempts, each bounded by its own deadline (the call's
    `call_timeout_s`, or less when the request has less left); round_robin sends each to the next
    pod. Propose, Verify and Info are pure functions of the request, so a repeat is safe.
    """

    def __init__(
        self,
        role: str,
        address: str,
        stub,
        call_timeout_s: float,
        info_timeout_s: float,
        max_message_mb: int,
        credentials: grpc.ChannelCredentials | ChannelCertificateFiles | None = None,
        attempts: int = 3,
        keepalive_s: float = 0.0,
    ):
        self.role = role
        self.address = address
        self.attempts = max(1, attempts)
        self.call_timeout_s = call_timeout_s
        self.info_timeout_s = info_timeout_s
        self._open = partial(
            open_channel, address, max_message_mb, keepalive_s=keepalive_s, call_timeout_s=call_timeout_s
        )
        self._stub_class = stub
        self._tls_files = credentials if isinstance(credentials, ChannelCertificateFiles) else None
        self._lock = threading.Lock()
        self.channel = self._open(credentials=self._tls_files.credentials() if self._tls_files else credentials)
        self._stub = stub(self.channel)

    @property
    def stub(self):
        """The pool's stub, on a channel rebuilt first when its TLS files were rotated."""
        if self._tls_files is not None and self._tls_files.changed():
            self._rebuild_channel()
        return self._stub

    def _rebuild_channel(self) -> None:
        with self._lock:
            try:
                credentials = self._tls_files.credentials()
            except (OSError, ssl.SSLError) as exc:  # mid-rotation: keep the channel we have, retry later
                log.warning("%s pool: TLS files unreadable, keeping the current channel: %s", self.role, exc)
                return
            old, self.channel = self.channel, self._open(credentials=credentials)
            self._stub = self._stub_class(self.channel)
        log.info("%s pool: TLS files rotated, new calls use a new channel", self.role)
        # Calls in flight on the old channel may take every attempt's deadline to finish.
        linger_s = self.attempts * max(self.call_timeout_s, self.info_timeout_s) + 5.0
        closer = threading.Timer(linger_s, old.close)
        closer.daemon = True
        closer.start()

    def call(self, method: Callable, request, deadline: Deadline, timeout_s: float | None = None):
        timeout_s = self.call_timeout_s if timeout_s is None else timeout_s
        for attempt in range(1, self.attempts + 1):
            try:
                return method(request, timeout=deadline.timeout(timeout_s))
            except grpc.RpcError as exc:
                if attempt == self.attempts or not retryable(exc):
                    raise self._mapped(exc, attempt, deadline) from exc
                log.info("%s service at %s, attempt %d: %s", self.role, self.address, attempt, exc.details())
            pause = back_off_s(attempt)
            if deadline.at is not None:
                pause = min(pause, max(0.0, deadline.at - time.monotonic()))
            time.sleep(pause)
        raise AssertionError("unreachable")

    def _mapped(self, exc: grpc.RpcError, attempts: int, deadline: Deadline) -> ServiceError:
        """The failure as a typed error whose message names the pool, never its address (logged)."""
        code = exc.code()
        log.warning("%s service at %s failed after %d attempt(s): %s", self.role, self.address, attempts, exc.details())
        message = f"{self.role} service: {scrubbed(exc.details())}"
        typed = error_from_reason(exc.trailing_metadata(), message)
        if typed is not None:
            return typed
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            try:
                deadline.check()
            except DeadlineExceeded as expired:  # the request's own deadline
                return expired
            # Only the attempts' deadlines passed: every pod tried is hung or overloaded.
            return Unavailable(f"{self.role} service: no answer within the per-call deadline ({attempts} attempts)")
        if code == grpc.StatusCode.UNAVAILABLE:
            return Unavailable(f"{message} ({attempts} attempts)")
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            return InvalidArgument(message)
        return ServiceError(message, code.name)

    def info(self, deadline: Deadline) -> common_pb2.ModelInfo:
        return self.call(self.stub.Info, common_pb2.InfoRequest(), deadline, self.info_timeout_s)

    def close(self) -> None:
        self.channel.close()


class DraftClient(ModelClient):
    """The draft pool as the engine's Drafter, with the pool's health (`specdec.core.draft_health`)
    that the engine reads: after a failed Propose, requests run at K = 0 for `backoff_s`."""

    # The draft service keeps the hidden-state rows it was sent (per hidden_key): a relay may send
    # only new ones, and gets HiddenStatesMiss when this call's replica does not hold the rest.
    keeps_hidden_states = True

    def __init__(
        self,
        address: str,
        call_timeout_s: float,
        info_timeout_s: float,
        max_message_mb: int,
        backoff_s: float = 30.0,
        **options,
    ):
        super().__init__(
            "draft", address, draft_pb2_grpc.DraftServiceStub, call_timeout_s, info_timeout_s, max_message_mb, **options
        )
        self.health = DraftHealth(backoff_s)

    def propose(self, requests: Sequence[DraftRequest], sampling: Sampling, deadline: Deadline) -> list[DraftProposal]:
        response = self.call(self.stub.Propose, wire.propose_request(list(requests), sampling), deadline)
        try:
            return wire.proposals_from_proto(response)
        except ValueError as exc:
            raise ServiceError(f"draft service: {exc}") from exc


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
            raise ServiceError(f"target service: {exc}") from exc
