"""Shared fixtures: a real Redis, tiny models (loaded once), and the three real gRPC services."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import redis

sys.path.insert(0, str(Path(__file__).parent))

from redis_server import real_redis  # noqa: E402
from service_stack import start_stack, stop_stack  # noqa: E402
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
    from specdec.rpc.model_service import load_model
    from specdec.settings import load_settings
    from target_service.settings import TargetSettings

    # No start-up curve: whether auto K drafts at all with these must not hang on how two ~1 ms
    # forwards happened to time (kpolicy.MIN_CEILING); the law tests count on it drafting. float32
    # products (not a draft's default int8): tests compare its cached forwards with plain ones
    # (test_int8_law serves the int8 draft).
    draft_settings = load_settings(
        DraftSettings, [], {}, model=tiny_model_dirs["draft"], calibrate_max_rows=0, matmul_dtype="float32"
    )
    draft = load_model(draft_settings, "draft")
    target = load_model(load_settings(TargetSettings, [], {}, model=tiny_model_dirs["target"]), "target")
    return {"draft": draft, "target": target}


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
