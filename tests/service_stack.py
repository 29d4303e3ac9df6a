"""The three real gRPC services on free loopback ports, for integration tests."""

from __future__ import annotations

from dataclasses import dataclass

import grpc


@dataclass
class Stack:
    coordinator_address: str
    draft_address: str
    target_address: str
    redis_url: str
    servers: list
    settings: object
    # TLS to the coordinator (None = plaintext), for `channel`.
    credentials: grpc.ChannelCredentials | None = None

    def channel(self) -> grpc.Channel:
        size = 256 * 1024 * 1024
        options = [("grpc.max_receive_message_length", size), ("grpc.max_send_message_length", size)]
        if self.credentials is not None:
            return grpc.secure_channel(self.coordinator_address, self.credentials, options=options)
        return grpc.insecure_channel(self.coordinator_address, options=options)


def start_stack(
    loaded,
    tokenizer_dir: str,
    redis_url: str,
    draft_loaded=None,
    model_tls: dict | None = None,
    credentials: grpc.ChannelCredentials | None = None,
    target_overrides: dict | None = None,
    **coordinator_overrides,
) -> Stack:
    """Draft, target and coordinator as real gRPC servers on free loopback ports.

    `model_tls`: the draft's and target's tls_* settings (`target_overrides`: the target's others); TLS to the coordinator is its own
    tls_* settings (in `coordinator_overrides`), and `credentials` are what `Stack.channel` shows it.
    """
    model_tls = model_tls or {}
    from coordinator.server import create_server as create_coordinator
    from coordinator.settings import CoordinatorSettings
    from draft_service.server import create_server as create_draft
    from draft_service.settings import DraftSettings
    from specdec.models.sources import load_tokenizer
    from specdec.settings import load_settings
    from target_service.server import create_server as create_target
    from target_service.settings import TargetSettings

    draft_server, draft_port = create_draft(
        load_settings(DraftSettings, [], {}, host="127.0.0.1", port=0, metrics_port=0, **model_tls),
        draft_loaded or loaded["draft"],
    )
    target_server, target_port = create_target(
        load_settings(
            TargetSettings, [], {}, host="127.0.0.1", port=0, metrics_port=0, **model_tls, **(target_overrides or {})
        ),
        loaded["target"],
    )
    overrides = dict(
        host="127.0.0.1",
        port=0,
        metrics_port=0,
        draft_address=f"127.0.0.1:{draft_port}",
        target_address=f"127.0.0.1:{target_port}",
        redis_url=redis_url,
        tokenizer=tokenizer_dir,
        max_num_samples=20000,
        sample_batch_size=4096,
        # A 4096-sequence call (the law tests) is far bigger than the production batches these
        # per-call deadlines are set for; on a busy machine it would time out and fall back to K=0.
        draft_timeout_s=120.0,
        verify_timeout_s=120.0,
    )
    overrides.update(coordinator_overrides)
    settings = load_settings(CoordinatorSettings, [], {}, **overrides)
    coordinator_server, coordinator_port = create_coordinator(settings, load_tokenizer(tokenizer_dir))
    return Stack(
        f"127.0.0.1:{coordinator_port}",
        f"127.0.0.1:{draft_port}",
        f"127.0.0.1:{target_port}",
        redis_url,
        [coordinator_server, draft_server, target_server],
        settings,
        credentials,
    )


def stop_stack(stack: Stack) -> None:
    # Wait until each has stopped: its ports are then free for the next stack.
    for event in [server.server.stop(0) for server in stack.servers]:
        event.wait(10)
    # And until their closer threads have ended: a daemon thread that drops the last reference to a
    # model while the interpreter exits frees tensors then, and the process aborts in C++
    # ("terminate called without an active exception").
    for server in stack.servers:
        for closer in server.closers:
            closer.join(5)
