"""CPU models run masked grouped-query attention without copying key/value heads, same output."""

from __future__ import annotations

import os

import pytest
import torch


def _gqa_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=32,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def _cached_rows(model, prefix: list[int], rows: list[int]) -> torch.Tensor:
    """Logits of `rows` new tokens after a cached prefix: the masked multi-row case of a Verify."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=torch.tensor([prefix]), cache=cache, use_cache=True)
        return model(input_ids=torch.tensor([rows]), cache=cache, use_cache=True).logits


def test_loading_a_cpu_model_turns_on_masked_gqa_and_the_logits_do_not_change(monkeypatch, tiny_model_dirs):
    from specdec.models.loading import load_causal_lm

    monkeypatch.delenv("TRANSFORMERS_SDPA_FORCE_GQA", raising=False)
    model = _gqa_llama()
    prefix, rows = list(range(1, 20)), [3, 5, 7]
    copied = _cached_rows(model, prefix, rows)  # transformers' default: repeat_kv under a mask
    load_causal_lm(tiny_model_dirs["target"])
    assert os.environ["TRANSFORMERS_SDPA_FORCE_GQA"] == "1"
    assert torch.equal(_cached_rows(model, prefix, rows), copied)


@pytest.mark.parametrize("value", ["0", "1"])
def test_an_environment_value_wins(monkeypatch, value):
    from specdec.models.loading import _cpu_attention_defaults

    monkeypatch.setenv("TRANSFORMERS_SDPA_FORCE_GQA", value)
    _cpu_attention_defaults()
    assert os.environ["TRANSFORMERS_SDPA_FORCE_GQA"] == value
