"""What a model service's MATMUL_DTYPE setting applies to (`model_service.bf16_matmuls_wanted`)."""

from __future__ import annotations

import pytest
import torch

from specdec.models.bf16_matmul import bf16_supported
from specdec.models.runner import ModelRunner, SessionKVCache
from specdec.rpc.model_service import bf16_matmuls_wanted


def _runner(dtype=torch.float32) -> ModelRunner:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
    )
    return ModelRunner(LlamaForCausalLM(config).eval().to(dtype), SessionKVCache(2, 100))


def test_float32_products_leave_any_model_alone():
    assert not bf16_matmuls_wanted("float32", _runner())
    assert not bf16_matmuls_wanted("float32", _runner(torch.bfloat16))


@pytest.mark.skipif(not bf16_supported(), reason="this torch build has no oneDNN bfloat16 matmul")
def test_bfloat16_products_need_an_eager_float32_cpu_model():
    assert bf16_matmuls_wanted("bfloat16", _runner())
    with pytest.raises(ValueError, match="needs a float32 model running eagerly on CPU"):
        bf16_matmuls_wanted("bfloat16", _runner(torch.bfloat16))
