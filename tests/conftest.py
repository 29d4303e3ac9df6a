"""Shared fixtures: a real Redis, tiny models (loaded once), and the three real gRPC services."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import redis

sys.path.insert(0, str(Path(__file__).parent))

from redis_server import real_redis  # noqa: E402
from tiny_models import build_tiny_model  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

TARGET_LOGIT_SCALE = 15.0
DRAFT_LOGIT_SCALE = 15.0


@pytest.fixture(scope="session")
def redis_url():
    with real_redis() as url:
        yield url


@pytest.fixture()
def redis_client(redis_url):
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-models")
    target = build_tiny_model(root / "target", seed=0, logit_scale=TARGET_LOGIT_SCALE)
    draft = build_tiny_model(root / "draft", seed=1, logit_scale=DRAFT_LOGIT_SCALE)
    return {"target": str(target), "draft": str(draft)}


@pytest.fixture(scope="session")
def tiny_loaded(tiny_model_dirs):
    """LoadedModel for the tiny draft and target, loaded once per test session."""
    from draft_service.settings import DraftSettings
    from specdec.serving import load_model
    from specdec.settings import load_settings
    from target_service.settings import TargetSettings

    draft = load_model(load_settings(DraftSettings, [], {}, model=tiny_model_dirs["draft"]), "draft")
    target = load_model(load_settings(TargetSettings, [], {}, model=tiny_model_dirs["target"]), "target")
    return {"draft": draft, "target": target}


@dataclass
class Stack:
    coordinator_address: str
    draft_address: str
    target_address: str
    redis_url: str
    servers: list
    settings: object

    def channel(self) -> grpc.Channel:
        size = 256 * 1024 * 1024
        return grpc.insecure_channel(
            self.coordinator_address,
            options=[("grpc.max_receive_message_length", size), ("grpc.max_send_message_length", size)],
        )


def start_stack(loaded, tokenizer_dir: str, redis_url: str, draft_loaded=None, **coordinator_overrides) -> Stack:
    """Draft, target and coordinator as real gRPC servers on free loopback ports."""
    from coordinator.server import create_server as create_coordinator
    from coordinator.settings import CoordinatorSettings
    from draft_service.server import create_server as create_draft
    from draft_service.settings import DraftSettings
    from specdec.models import load_tokenizer
    from specdec.settings import load_settings
    from target_service.server import create_server as create_target
    from target_service.settings import TargetSettings

    draft_server, draft_port = create_draft(
        load_settings(DraftSettings, [], {}, host="127.0.0.1", port=0, metrics_port=0), draft_loaded or loaded["draft"]
    )
    target_server, target_port = create_target(load_settings(TargetSettings, [], {}, host="127.0.0.1", port=0, metrics_port=0), loaded["target"])
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
    )


def stop_stack(stack: Stack) -> None:
    for server in stack.servers:
        server.server.stop(0)


@pytest.fixture(scope="session")
def tiny_stack(tiny_loaded, tiny_model_dirs, redis_url):
    stack = start_stack(tiny_loaded, tiny_model_dirs["target"], redis_url)
    yield stack
    stop_stack(stack)


@pytest.fixture(scope="session")
def coordinator_stub(tiny_stack):
    from specdec.v1 import coordinator_pb2_grpc

    channel = tiny_stack.channel()
    yield coordinator_pb2_grpc.CoordinatorStub(channel)
    channel.close()
