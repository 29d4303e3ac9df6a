"""The law through the REAL services with int8 products (MATMUL_DTYPE=int8 on the target, a draft's
default on the draft): a tiny target whose every linear is exactly 4-bit blocks, so every product
rounds its rows to 8-bit blocks (kernels/int8.cpp) and a Verify's rows and batched sessions must
still compute what one-token decodes compute for the coordinator's output to follow the target's
law; the draft's weights are rounded to 8-bit blocks, and its q must still be what it samples
from. The exact law is enumerated from the served (swapped) target with plain full forwards, as in
test_lossless_law; same significance, power stated by the fit."""

from __future__ import annotations

import zlib

import pytest
import torch
from law import assert_draft_follows_law, assert_greedy_speculation_equals_k0
from service_stack import start_stack, stop_stack
from tiny_models import build_tiny_model

from specdec.models import panels

pytestmark = pytest.mark.skipif(not panels.int8_available(), reason="no int8 products on this CPU (AVX2)")

SIGNIFICANCE = 0.001
PROMPT = [3, 1, 4]
LENGTH = 3
LOGIT_SCALE = 15.0  # peaked laws, as the session's tiny target (conftest)


@pytest.fixture(scope="module")
def int8_loaded(tiny_model_dirs, tmp_path_factory):
    from draft_service.settings import DraftSettings
    from specdec.rpc.model_service import load_model
    from specdec.settings import load_settings
    from target_service.settings import TargetSettings

    target = build_tiny_model(tmp_path_factory.mktemp("q4") / "target", 0, LOGIT_SCALE, q4_blocks=True)
    settings = load_settings(TargetSettings, [], {}, model=str(target), matmul_dtype="int8")
    # The draft as served by default: int8 products, its weights rounded to 8-bit blocks.
    draft = load_model(load_settings(DraftSettings, [], {}, model=tiny_model_dirs["draft"]), "draft")
    return {"draft": draft, "target": load_model(settings, "target"), "target_dir": str(target)}


@pytest.fixture(scope="module")
def int8_stub(int8_loaded, redis_url):
    from specdec.v1 import coordinator_pb2_grpc

    stack = start_stack(int8_loaded, int8_loaded["target_dir"], redis_url)
    channel = stack.channel()
    yield coordinator_pb2_grpc.CoordinatorStub(channel)
    channel.close()
    stop_stack(stack)


def test_the_target_reports_and_runs_int8_products_and_float16_caches(int8_loaded):
    from specdec.models.cpu_layout import PlannedLinear

    from specdec.models.kv_cache import cache_dtype

    runner = int8_loaded["target"].runner
    assert int8_loaded["target"].info.matmul_dtype == "int8"
    linears = [m for m in runner.model.modules() if isinstance(m, PlannedLinear)]
    assert linears and all(m.int8 for m in linears)
    # KV_CACHE_DTYPE=auto: float16 caches with int8 products, so the law tests here cover them, and
    # uncached sequences run through those caches too (every law the target sends computed one way).
    assert cache_dtype(runner.model) == torch.float16 and not runner.pads_uncached


def test_pipeline_samples_follow_the_int8_target_law(int8_stub, int8_loaded, record_property):
    model = int8_loaded["target"].runner.model
    seed = zlib.crc32(b"int8-K3-T1") % 997
    fit = assert_draft_follows_law(int8_stub, model, "int8-K3-T1", PROMPT, LENGTH, 3, seed, significance=SIGNIFICANCE)
    record_property("summary", fit.summary)


def test_greedy_speculation_equals_k0_with_int8_products(int8_stub):
    assert_greedy_speculation_equals_k0(int8_stub)


def test_auto_takes_int8_only_where_the_weights_are_blocks(tiny_model_dirs, int8_loaded):
    from specdec.rpc.model_service import load_model
    from specdec.settings import load_settings
    from target_service.settings import TargetSettings

    for model, expected in ((int8_loaded["target_dir"], "int8"), (tiny_model_dirs["target"], "")):
        settings = load_settings(TargetSettings, [], {}, model=model, matmul_dtype="auto", calibrate_max_rows=0)
        assert load_model(settings, "target").info.matmul_dtype == expected


def test_a_float32_draft_takes_int8_products_by_default_with_its_weights_in_8_bit_blocks(tiny_model_dirs):
    """A draft's numerics never reach the output law: by default (MATMUL_DTYPE auto) its float32
    weights are rounded to 8-bit blocks and every product is int8 (the law tests through these
    services run such a draft); the same model as a target keeps its weights (above)."""
    from draft_service.settings import DraftSettings
    from specdec.models.cpu_layout import PlannedLinear
    from specdec.models.loading import load_causal_lm
    from specdec.rpc.model_service import load_model
    from specdec.settings import load_settings

    fields = {"model": tiny_model_dirs["draft"], "calibrate_max_rows": 0}
    loaded = load_model(load_settings(DraftSettings, [], {}, **fields), "draft")
    assert loaded.info.matmul_dtype == "int8"
    linears = [m for m in loaded.runner.model.modules() if isinstance(m, PlannedLinear)]
    assert linears and all(m.int8 for m in linears)
    original, _ = load_causal_lm(tiny_model_dirs["draft"])
    rounded = dict(loaded.runner.model.named_parameters())
    for name, weight in original.named_parameters():
        if name.endswith("proj.weight"):
            assert not torch.equal(rounded[name], weight) and torch.allclose(rounded[name], weight, atol=0.01)
    float32 = load_model(load_settings(DraftSettings, [], {}, **fields, matmul_dtype="float32"), "draft")
    assert float32.info.matmul_dtype == ""
