"""The coordinators, reached over grpc.aio from the gateway's event loop.

The channel is opened on first use, inside the loop that serves requests (a grpc.aio channel
belongs to the loop it was made in), with the tracing interceptors configured by then. Calls go
round-robin over every address the target resolves to (a comma list, or `dns:///` a headless
Service): one long-lived HTTP/2 connection to one ClusterIP would pin all of a gateway's calls on
one coordinator.
"""

from __future__ import annotations

import json

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.rpc.clients import channel_target
from specdec.rpc.tls import read_file
from specdec.rpc.tracing import aio_client_interceptors
from specdec.v1 import coordinator_pb2, coordinator_pb2_grpc

MAX_MESSAGE_BYTES = 256 * 1024 * 1024  # the coordinator's default max_message_mb
ROUND_ROBIN = json.dumps({"loadBalancingConfig": [{"round_robin": {}}]})


def channel_options() -> list[tuple[str, object]]:
    return [
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.service_config", ROUND_ROBIN),
    ]


class CoordinatorClient:
    def __init__(self, address: str, tls_ca_file: str = "", timeout_s: float = 600.0):
        self.address, self.tls_ca_file, self.timeout_s = address, tls_ca_file, timeout_s
        self._channel: grpc.aio.Channel | None = None

    def _stubs(self) -> tuple[coordinator_pb2_grpc.CoordinatorStub, health_pb2_grpc.HealthStub]:
        if self._channel is None:
            target, options, interceptors = channel_target(self.address), channel_options(), aio_client_interceptors()
            if self.tls_ca_file:
                credentials = grpc.ssl_channel_credentials(root_certificates=read_file(self.tls_ca_file))
                self._channel = grpc.aio.secure_channel(target, credentials, options, interceptors=interceptors)
            else:
                self._channel = grpc.aio.insecure_channel(target, options, interceptors=interceptors)
            self._coordinator = coordinator_pb2_grpc.CoordinatorStub(self._channel)
            self._health = health_pb2_grpc.HealthStub(self._channel)
        return self._coordinator, self._health

    async def generate(
        self, request: coordinator_pb2.GenerateRequest, metadata: tuple
    ) -> coordinator_pb2.GenerateResponse:
        """grpc.aio.AioRpcError on a failed call."""
        return await self._stubs()[0].Generate(request, timeout=self.timeout_s, metadata=metadata)

    def stream(self, request: coordinator_pb2.GenerateRequest, metadata: tuple) -> grpc.aio.UnaryStreamCall:
        """The started call: `await call.read()` for each chunk (grpc.aio.EOF after the last); `call.cancel()` stops it."""
        return self._stubs()[0].GenerateStream(request, timeout=self.timeout_s, metadata=metadata)

    async def serving(self, timeout_s: float = 2.0) -> bool:
        """Whether the coordinator's health check answers SERVING."""
        try:
            reply = await self._stubs()[1].Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
        except grpc.aio.AioRpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    async def close(self) -> None:
        if self._channel is not None:
            channel, self._channel = self._channel, None
            await channel.close()
