"""PlannedLinear gives nn.Linear's result in every layout and row count; swapping keeps tied
weights tied; calibration leaves the plan on a measured layout per row count."""

from __future__ import annotations

import pytest
import torch

from specdec.models.calibration import calibrate, plan_layouts
from specdec.models.cpu_layout import LayoutPlan, PlannedLinear, drop_transposed, use_layout_plan
from specdec.models.layouts import LAYOUTS, LINEAR, TRANSPOSED, WEIGHT_MAJOR
from specdec.models.runner import ModelRunner, SessionKVCache


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 24), (3, 24), (4, 24), (2, 5, 24), (1, 17, 24)])
def test_every_layout_matches_linear(layout, shape, bias):
    torch.manual_seed(0)
    linear = torch.nn.Linear(24, 40, bias=bias)
    planned = PlannedLinear(linear, LayoutPlan(layout))
    x = torch.randn(shape)
    torch.testing.assert_close(planned(x), linear(x), rtol=1e-5, atol=1e-5)
    assert planned(x).shape == (*shape[:-1], 40)


def test_a_plan_picks_by_row_count_and_extends_its_largest():
    plan = LayoutPlan(LINEAR, {1: TRANSPOSED, 3: WEIGHT_MAJOR})
    assert [plan.layout(r) for r in (1, 2, 3, 9)] == [TRANSPOSED, LINEAR, WEIGHT_MAJOR, WEIGHT_MAJOR]
    assert plan.uses(TRANSPOSED) and not LayoutPlan(WEIGHT_MAJOR).uses(TRANSPOSED)
    with pytest.raises(ValueError, match="unknown linear layout 'fast'"):
        plan.set(2, "fast")


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=16,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def test_swapping_keeps_the_tied_head_tied_and_the_logits():
    model = _tiny_llama()
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    plan = LayoutPlan(TRANSPOSED)
    with torch.no_grad():
        before = model(input_ids=ids).logits
        swapped = use_layout_plan(model, plan)
        transposed = model(input_ids=ids).logits
        plan.default = WEIGHT_MAJOR
        weight_major = model(input_ids=ids).logits
    assert swapped == 2 * 7 + 1  # q, k, v, o, gate, up, down per layer, and the head
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert model.get_output_embeddings().out_features == 16
    torch.testing.assert_close(transposed, before, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(weight_major, before, rtol=1e-5, atol=1e-5)
    assert drop_transposed(model) == swapped and drop_transposed(model) == 0


def test_calibration_measures_every_row_count_and_leaves_no_trace_in_the_cache():
    runner = ModelRunner(_tiny_llama(), SessionKVCache(4, 1000))
    runner.last_logits("client", [1, 2, 3], 1)
    hits, misses = runner.cache.hits, runner.cache.misses
    plan = LayoutPlan(LINEAR)
    use_layout_plan(runner.model, plan)
    costs = calibrate(runner, 5, plan, prefix_len=8, repeats=2)
    assert len(costs.seconds) == len(costs.layouts) == 5 and all(s > 0 for s in costs.seconds)
    assert set(costs.measured) == set(LAYOUTS)
    for rows, layout in enumerate(costs.layouts, start=1):
        assert plan.layout(rows) == layout
        assert (
            costs.seconds[rows - 1]
            == costs.measured[layout][rows - 1]
            == min(times[rows - 1] for times in costs.measured.values())
        )
    assert len(runner.cache) == 1 and (runner.cache.hits, runner.cache.misses) == (hits, misses)


@pytest.mark.parametrize("layout", ["auto", WEIGHT_MAJOR])
def test_plan_layouts_keeps_the_transposed_copy_only_when_used(layout):
    runner = ModelRunner(_tiny_llama(), SessionKVCache(4, 1000))
    with torch.no_grad():
        before = runner.model(input_ids=torch.tensor([[1, 2, 3]])).logits
    costs = plan_layouts(runner, layout, 3)
    planned = [m for m in runner.model.modules() if isinstance(m, PlannedLinear)]
    kept = {m.weight_t is not None for m in planned}
    assert kept == {TRANSPOSED in costs.layouts}
    if layout != "auto":
        assert costs.layouts == ("as loaded",) * 3
    with torch.no_grad():
        after = runner.model(input_ids=torch.tensor([[1, 2, 3]])).logits
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)
    assert plan_layouts(ModelRunner(_tiny_llama(), SessionKVCache(4, 1000)), "auto", 0) is None
