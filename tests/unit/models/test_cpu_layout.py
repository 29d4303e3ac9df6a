"""PlannedLinear gives nn.Linear's result in every layout and row count; swapping keeps tied
weights tied; calibration leaves the plan on a measured layout per row count."""

from __future__ import annotations

import pytest
import torch

from specdec.models.calibration import forward_costs, plan_layouts, tune_layouts
from specdec.models.cpu_layout import (
    LayoutPlan,
    PlannedLinear,
    drop_unused_copies,
    packing_available,
    planned_linears,
    round_to_q8_blocks,
    use_layout_plans,
)
from specdec.models.layouts import LAYOUTS, LINEAR, PACKED, PANELS, TRANSPOSED, WEIGHT_MAJOR
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
    with torch.no_grad():
        before = model(input_ids=ids).logits
        plans = use_layout_plans(model, TRANSPOSED)
        transposed = model(input_ids=ids).logits
        for plan in plans.values():
            plan.default = WEIGHT_MAJOR
        weight_major = model(input_ids=ids).logits
    # one plan per weight shape: q/o 16->16, k/v 16->8, gate/up 16->32, down 32->16, the head 16->16 (shared with q/o)
    assert set(plans) == {(16, 16), (16, 8), (16, 32), (32, 16)}
    assert sum(len(group) for group in planned_linears(model).values()) == 2 * 7 + 1
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert model.get_output_embeddings().out_features == 16
    torch.testing.assert_close(transposed, before, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(weight_major, before, rtol=1e-5, atol=1e-5)
    # no plan uses the transposed, packed or panels copies now
    assert drop_unused_copies(model) == 3 * (2 * 7 + 1) and drop_unused_copies(model) == 0


def test_a_drafts_weights_round_to_8_bit_blocks_except_those_that_are_blocks_already():
    from specdec.models import panels

    model = _tiny_llama()  # hidden 16: no linear reads inputs in blocks of 32 but down (32 -> 16)
    assert round_to_q8_blocks(model) == 2
    downs = [layer.mlp.down_proj.weight for layer in model.model.layers]
    assert all(panels.pack_q8(w) is not None for w in downs)
    assert panels.pack_compact(model.model.layers[0].mlp.up_proj.weight) is None
    assert round_to_q8_blocks(model) == 0  # blocks already


def test_a_vocabulary_subset_head_is_planned_as_any_linear():
    from specdec.models.draft_artifact import apply_head_subset

    model = _tiny_llama()
    apply_head_subset(model, torch.tensor([3, 5, 7]))
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        before = model(input_ids=ids).logits
        use_layout_plans(model, TRANSPOSED)
        head = model.get_output_embeddings()
        planned_rows = []  # the planned product runs the head's rows, not a product of its own
        head.product.register_forward_hook(lambda module, args, out: planned_rows.append(args[0].shape[-2]))
        after = model(input_ids=ids).logits
    assert isinstance(head.product, PlannedLinear) and head.weight.shape == (3, 16) and planned_rows == [3]
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)
    assert bool(torch.isinf(after[..., [0, 1, 2, 4, 6]]).all()) and bool(torch.isfinite(after[..., [3, 5, 7]]).all())


def test_copies_are_dropped_only_where_no_plan_uses_them():
    model = _tiny_llama()
    plans = use_layout_plans(model, LINEAR)
    plans[(32, 16)].set(2, TRANSPOSED)
    plans[(16, 32)].set(3, PACKED)
    plans[(16, 8)].set(5, PANELS)
    # all but the two down projections' transposed, the four gate/up projections' packed and the
    # four k/v projections' panels copies
    assert drop_unused_copies(model) == 3 * (2 * 7 + 1) - 2 - 4 - 4
    assert all(m.weight_t is not None for m in planned_linears(model)[(32, 16)])
    assert all(m.weight_packed is not None and m.weight_t is None for m in planned_linears(model)[(16, 32)])
    assert all(m.weight_panels is not None and m.weight_packed is None for m in planned_linears(model)[(16, 8)])


def test_the_packed_layout_is_there_and_a_missing_copy_runs_as_linear():
    assert packing_available()  # the pinned CPU torch has oneDNN: tuning must be able to choose it
    torch.manual_seed(0)
    linear = torch.nn.Linear(24, 40, bias=False)
    planned = PlannedLinear(linear, LayoutPlan(PACKED), copies=())
    x = torch.randn(3, 24)
    assert torch.equal(planned(x), linear(x))


def test_tuning_sets_a_measured_layout_per_shape_and_row_count():
    model = _tiny_llama()
    plans = use_layout_plans(model, LINEAR)
    tune_layouts(model, plans, 4, repeats=1)
    for plan in plans.values():
        assert set(plan.by_rows) == {1, 2, 3, 4} and set(plan.by_rows.values()) <= set(LAYOUTS)


def test_forward_costs_cover_every_row_count_and_leave_no_trace_in_the_cache():
    runner = ModelRunner(_tiny_llama(), SessionKVCache(4, 1000))
    runner.last_logits("client", [1, 2, 3], 1)
    hits, misses = runner.cache.hits, runner.cache.misses
    seconds = forward_costs(runner, 5, prefix_len=8, repeats=2)
    assert len(seconds) == 5 and all(0 < s < 10 for s in seconds)
    assert len(runner.cache) == 1 and (runner.cache.hits, runner.cache.misses) == (hits, misses)


@pytest.mark.parametrize("layout", ["auto", WEIGHT_MAJOR, TRANSPOSED])
def test_plan_layouts_keeps_the_logits_and_reports_the_curve(layout):
    runner = ModelRunner(_tiny_llama(), SessionKVCache(4, 1000))
    with torch.no_grad():
        before = runner.model(input_ids=torch.tensor([[1, 2, 3]])).logits
    costs = plan_layouts(runner, layout, 3)
    assert len(costs.milliseconds()) == 3 and set(costs.layouts) == {"16->16", "16->8", "16->32", "32->16"}
    if layout != "auto":
        assert all(chosen == (layout,) * 3 for chosen in costs.layouts.values())
    used = {any(TRANSPOSED == c for c in chosen) for chosen in costs.layouts.values()}
    kept = {m.weight_t is not None for m in runner.model.modules() if isinstance(m, PlannedLinear)}
    assert kept <= used
    with torch.no_grad():
        after = runner.model(input_ids=torch.tensor([[1, 2, 3]])).logits
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)
    assert plan_layouts(ModelRunner(_tiny_llama(), SessionKVCache(4, 1000)), "auto", 0) is None


def test_a_compiled_runner_runs_a_packed_plan():
    """Inductor cannot lower oneDNN's opaque weight: the compiled graph computes the product its own way."""
    from specdec.models.static_runner import make_runner

    eager = ModelRunner(_tiny_llama(), SessionKVCache(4, 1000))
    compiled = make_runner(_tiny_llama(), SessionKVCache(4, 1000), "on", 64)
    plan_layouts(compiled, PACKED, 2)
    expected = eager.last_logits("a", [1, 2, 3, 4], 2).logits
    torch.testing.assert_close(compiled.last_logits("a", [1, 2, 3, 4], 2).logits, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("panels_faster", [True, False])
def test_auto_keeps_the_tuned_plans_or_panels_for_all_whichever_curve_is_faster(monkeypatch, panels_faster):
    from specdec.models import calibration

    runner = ModelRunner(_tiny_llama(), SessionKVCache(4, 1000))
    monkeypatch.setattr(runner, "fuses_layers", lambda: False)  # (a fusing model: the test below)
    timed: list[dict] = []  # per setup timed: each shape's layouts at 1..3 rows

    def plans_now():
        layers = planned_linears(runner.model).items()
        return {shape: tuple(group[0].plan.layout(r) for r in (1, 2, 3)) for shape, group in layers}

    def curves(runner, max_rows, setups, *args):
        for setup in setups:
            setup()
            timed.append(plans_now())
        tuned, all_panels = (0.010, 0.012, 0.014), (0.011, 0.011, 0.013)
        return [tuned, all_panels] if panels_faster else [(0.010, 0.010, 0.010), all_panels]

    monkeypatch.setattr(calibration, "compare_forward_costs", curves)
    costs = plan_layouts(runner, "auto", 3)
    assert set(timed[1].values()) == {(PANELS,) * 3}  # the second setup timed: panels for every shape
    expected = timed[1] if panels_faster else timed[0]
    assert plans_now() == expected
    assert costs.layouts == {f"{i}->{o}": layouts for (i, o), layouts in expected.items()}
    assert costs.milliseconds() == ([11.0, 11.0, 13.0] if panels_faster else [10.0, 10.0, 10.0])
    for shape, group in planned_linears(runner.model).items():  # copies stay where the plan uses them
        assert all((m.weight_panels is not None) == (PANELS in expected[shape]) for m in group)


def test_auto_puts_a_model_with_fused_layers_on_panels_for_all(monkeypatch):
    """Its short forwards run the fused layers on the panels whatever the plans say: the curves of
    two plans would time the same forwards, so none is compared, and the panels copies stay."""
    from specdec.models import calibration, panels

    if not panels.available():
        pytest.skip("the compiled kernels are not built here")
    runner = ModelRunner(_tiny_llama(), SessionKVCache(4, 1000))
    monkeypatch.setattr(calibration, "compare_forward_costs", lambda *a: pytest.fail("curves compared"))
    monkeypatch.setattr(calibration, "forward_costs", lambda runner, max_rows: (0.01,) * max_rows)
    costs = plan_layouts(runner, "auto", 3)
    assert set(costs.layouts.values()) == {(PANELS,) * 3} and runner.on_model_thread(runner.fuses_layers)
    assert all(m.weight_panels is not None for group in planned_linears(runner.model).values() for m in group)
    runner.close()


def test_a_prompts_many_rows_go_to_mkl_even_on_a_panels_plan(monkeypatch):
    from specdec.models import panels

    torch.manual_seed(0)
    linear = torch.nn.Linear(24, 40, bias=True)
    planned = PlannedLinear(linear, LayoutPlan(PANELS))
    calls: list[int] = []
    product = panels.product
    monkeypatch.setattr(panels, "product", lambda x, *args: calls.append(x.shape[0]) or product(x, *args))
    for rows in (1, panels.MAX_ROWS, panels.MAX_ROWS + 1):
        x = torch.randn(rows, 24)
        torch.testing.assert_close(planned(x), linear(x), rtol=1e-5, atol=1e-5)
    assert calls == [1, panels.MAX_ROWS]


def test_the_heap_the_dropped_copies_held_is_handed_back(monkeypatch):
    from specdec.models import calibration

    trimmed: list[bool] = []
    monkeypatch.setattr(calibration, "return_freed_memory", lambda: trimmed.append(True))
    plan_layouts(ModelRunner(_tiny_llama(), SessionKVCache(4, 1000)), "auto", 0)
    assert trimmed == [True]  # the transposed, packed and panels copies went
    monkeypatch.undo()
    calibration.return_freed_memory()  # glibc here: the real call runs
