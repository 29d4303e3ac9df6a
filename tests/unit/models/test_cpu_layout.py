"""DualLayoutLinear gives nn.Linear's result for every row count; swapping keeps tied weights tied."""

from __future__ import annotations

import pytest
import torch

from specdec.models.cpu_layout import DualLayoutLinear, use_dual_layout


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 24), (3, 24), (4, 24), (2, 5, 24), (1, 17, 24)])
def test_dual_layout_matches_linear(shape, bias):
    torch.manual_seed(0)
    linear = torch.nn.Linear(24, 40, bias=bias)
    dual = DualLayoutLinear(linear, min_rows=4)
    x = torch.randn(shape)
    torch.testing.assert_close(dual(x), linear(x), rtol=1e-5, atol=1e-5)
    assert dual(x).shape == (*shape[:-1], 40)


def test_use_dual_layout_swaps_linears_and_keeps_the_tied_head_tied():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    model = LlamaForCausalLM(config).eval()
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        before = model(input_ids=ids).logits
        swapped = use_dual_layout(model, 4)
        after = model(input_ids=ids).logits
    assert swapped == 2 * 7 + 1  # q, k, v, o, gate, up, down per layer, and the head
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert model.get_output_embeddings().out_features == 16
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)
    assert use_dual_layout(model, 0) == 0
