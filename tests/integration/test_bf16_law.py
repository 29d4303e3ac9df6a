"""The law through the REAL services with bfloat16 products (MATMUL_DTYPE=bfloat16): both tiny
models' decoder linears in bfloat16, so every target Verify row and batched session must compute
what a one-token decode computes (`specdec.models.bf16_matmul`) for the target's law to be the one
the coordinator's output follows (the draft's attention stays multi-row: it needs no exactness). The exact law is enumerated from the served (swapped) target with
plain full forwards, as in test_lossless_law; same significance, power stated by the fit."""

from __future__ import annotations

import zlib

import pytest
from law import assert_greedy_speculation_equals_k0, exact_sequence_law, fit_to_law, sample_counts
from service_stack import start_stack, stop_stack

from specdec.core.sampling import Sampling
from specdec.models.bf16_matmul import ROWWISE, Bf16Linear, bf16_supported

pytestmark = pytest.mark.skipif(not bf16_supported(), reason="this torch build has no oneDNN bfloat16 matmul")

SIGNIFICANCE = 0.001
PROMPT = [3, 1, 4]
LENGTH = 3


@pytest.fixture(scope="module")
def bf16_loaded(tiny_model_dirs):
    from draft_service.settings import DraftSettings
    from specdec.rpc.model_service import load_model
    from specdec.settings import load_settings
    from target_service.settings import TargetSettings

    def load(settings, role):
        return load_model(load_settings(settings, [], {}, model=tiny_model_dirs[role], matmul_dtype="bfloat16"), role)

    return {"draft": load(DraftSettings, "draft"), "target": load(TargetSettings, "target")}


@pytest.fixture(scope="module")
def bf16_stub(bf16_loaded, tiny_model_dirs, redis_url):
    from specdec.v1 import coordinator_pb2_grpc

    stack = start_stack(bf16_loaded, tiny_model_dirs["target"], redis_url)
    channel = stack.channel()
    yield coordinator_pb2_grpc.CoordinatorStub(channel)
    channel.close()
    stop_stack(stack)


def test_the_services_report_and_run_bfloat16_products(bf16_loaded):
    for loaded in bf16_loaded.values():
        assert loaded.info.matmul_dtype == "bfloat16"
        assert any(isinstance(m, Bf16Linear) for m in loaded.runner.model.modules())
    target, draft = bf16_loaded["target"].runner, bf16_loaded["draft"].runner
    assert not target.stores_prefixes_once and not target.pads_uncached  # exact: as decodes compute
    assert draft.stores_prefixes_once and draft.pads_uncached  # a draft needs no exactness
    assert not any(getattr(m, ROWWISE, False) for m in draft.model.modules())


def test_pipeline_samples_follow_the_bfloat16_target_law(bf16_stub, bf16_loaded, record_property):
    total, sampling = 14_000, Sampling(1.0)
    law = exact_sequence_law(bf16_loaded["target"].runner.model, PROMPT, LENGTH, sampling)
    counts, drafted, accepted, recovered = sample_counts(
        bf16_stub, PROMPT, LENGTH, 3, sampling, total, LENGTH, seed=zlib.crc32(b"bf16-K3-T1") % 997
    )
    fit = fit_to_law("bf16-K3-T1", counts, law, SIGNIFICANCE, drafted, accepted, recovered)
    record_property("summary", fit.summary)
    assert total >= fit.needed, fit.summary
    assert recovered > total * 0.1, fit.summary
    assert fit.p_value > SIGNIFICANCE, fit.summary


def test_greedy_speculation_equals_k0_with_bfloat16_products(bf16_stub):
    assert_greedy_speculation_equals_k0(bf16_stub)
