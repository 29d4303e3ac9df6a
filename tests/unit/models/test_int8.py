"""The int8 products (kernels/int8.cpp, MATMUL_DTYPE=int8): llama.cpp's arithmetic for 4- and 8-bit
weights, computed as stated (x rounded per block of 32, exact integer sums, the scales applied
block by block), each row's result independent of the rows and threads beside it, and a model
whose every such product runs so gives a batched step and a Verify the bits of its solo decodes.
The product tests need AVX2 (AVX-512 VNNI where the CPU has it: the same bits) and skip elsewhere."""

from __future__ import annotations

import pytest
import torch

from specdec.models import panels
from tests.unit.models.test_panels import (
    _q4_weight,
    _q8_weight,
    assert_a_batched_step_gives_solo_logits,
    assert_rows_alone,
)

needs_int8 = pytest.mark.skipif(not panels.int8_available(), reason="no int8 products on this CPU (AVX2)")
Q4_TOPS, Q8_TOPS = tuple(range(15, 0, -1)), (127, 126, 128, 125)
FORMS = {"q4": (_q4_weight, dict(offset=True, tops=Q4_TOPS, low=0, high=15)), "q8": (_q8_weight, {})}


def _levels(form: str, weight: torch.Tensor):
    if form == "q4":
        return panels._block_levels(weight, offset=True, tops=Q4_TOPS, low=0, high=15)
    return panels._block_levels(weight, offset=False, tops=Q8_TOPS, low=-128, high=127)


def stated_arithmetic(x: torch.Tensor, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """What the kernel says it computes, in float64 from the same roundings of x: per block of 32,
    dx = max|x| / 127, qx = round(x / dx), y += d * dx * sum(q qx) + m * dx * sum(qx)."""
    rows, k = x.shape
    blocks = x.reshape(rows, k // 32, 32)
    top = blocks.abs().amax(-1)
    inverse = torch.where(top > 0, torch.tensor(127.0) / top, torch.zeros_like(top))  # float32, as the kernel
    qx = torch.round(blocks * inverse[..., None]).double()
    dx = (top / 127.0).double()
    sums = torch.einsum("rbi,nbi->rnb", qx, q.double().reshape(q.shape[0], k // 32, 32))
    return (d.double() * (dx[:, None, :] * sums) + m.double() * (dx * qx.sum(-1))[:, None, :]).sum(-1)


@needs_int8
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize(("n", "k"), [(100, 64), (1536, 576), (40, 1536), (33, 64)])
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 7, 9, 13])  # (AVX2: whole panels up to 4 rows, halves past)
def test_the_product_is_the_stated_arithmetic(form, n, k, rows):
    """Within float32 rounding of the stated sums (a wrong layout, sign offset, scale or block
    order is off by orders of magnitude), and within int8 rounding of the float32 product."""
    weight = FORMS[form][0](n, k, rows + n)
    q, d, m = _levels(form, weight)
    torch.manual_seed(rows + k)
    x = torch.randn(rows, k)
    x[0, :32] = 0  # a block of zeros: dx = 0, nothing added
    got = panels.product(x, panels.to_int8(panels.pack_compact(weight)), n)
    assert got.shape == (rows, n) and got.dtype == torch.float32
    stated = stated_arithmetic(x, q, d, m)
    assert float((got.double() - stated).abs().max() / stated.abs().max()) < 1e-6
    exact = x.double() @ weight.double().T
    assert float((got.double() - exact).abs().max() / exact.abs().max()) < 0.03


@needs_int8
def test_an_8_bit_weights_sign_survives_the_unsigned_levels():
    """VPDPBUSD multiplies unsigned bytes: 8-bit levels go as q + 128, and each row's block sums
    of its levels take 128 * sum(qx) back off."""
    weight = -_q8_weight(32, 64, 1).abs()  # every weight negative, so 128 * sum(q) is large
    x = torch.ones(1, 64)
    got = panels.product(x, panels.to_int8(panels.pack_q8(weight)), 32)
    torch.testing.assert_close(got, x @ weight.T, rtol=1e-5, atol=1e-6)


@needs_int8
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("rows", [3, 5])  # (AVX2: a whole panel a pass, then half a panel)
def test_the_largest_sums_do_not_saturate(form, rows):
    """AVX2 sums byte products in 16-bit pairs (a 4-bit block's 8 groups there too): at the extreme
    levels, 15 (4-bit) and -128 and 127 (8-bit: as |q| and as the stored q + 128 = 255) against
    qx = +-127, every sum is still exact."""
    n, k = 32, 64
    x = torch.ones(rows, k)
    if form == "q4":
        q = torch.full((n, k), 15.0)
        q[:, 5] = 0  # (a span that only these levels reproduce)
    else:  # each block's first half -128, its second 127; x's signs make every product positive
        q = torch.full((n, k // 32, 32), 127.0)
        q[:, :, :16] = -128
        q = q.reshape(n, k)
        x[:, (torch.arange(k) % 32) < 16] = -1
    x[1] *= -1  # (and a row of negative products)
    d = torch.full((n, k // 32, 1), 2.0**-7)
    weight = (q.reshape(n, k // 32, 32) * d).reshape(n, k)
    levels, scale, offset = _levels(form, weight)
    assert levels.max() == 15 if form == "q4" else (levels.min(), levels.max()) == (-128, 127)
    # (Two levels a block would also pack as 4-bit levels with an offset: the 8-bit form is asked for.)
    compact = panels.pack_compact(weight) if form == "q4" else panels.pack_q8(weight)
    got = panels.product(x, panels.to_int8(compact), n)
    stated = stated_arithmetic(x, levels, scale, offset)
    assert float((got.double() - stated).abs().max() / stated.abs().max()) < 1e-6


@pytest.mark.skipif(
    not (panels.int8_available() and panels.VNNI_FLAGS <= panels._cpu_flags()), reason="no AVX-512 VNNI here"
)
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 13])
def test_avx2_and_vnni_give_the_same_bits(form, rows):
    """Which instructions sum the levels changes no bit of any row (AVX2's passes of up to 4 rows
    over a whole panel or 6 over half of it, VNNI's of 6), float16 and float32 scales alike."""
    lib = panels.kernel_library()
    weight = FORMS[form][0](100, 576, rows)
    torch.manual_seed(rows)
    x = torch.randn(rows, 576)
    compact, nudge = panels.pack_compact(weight), 1 + 2.0**-13  # (scales that are no float16)
    if form == "q4":
        nudged = panels.Q4Panels(compact.nibbles, compact.scale * nudge, compact.offset)
    else:
        nudged = panels.Q8Panels(compact.levels, compact.scale * nudge)
    for copy in (compact, nudged):
        int8 = panels.to_int8(copy)
        try:
            lib.int8_use_vnni(0)
            avx2 = panels.product(x, int8, 100)
        finally:
            lib.int8_use_vnni(1)
        assert torch.equal(avx2, panels.product(x, int8, 100))


@needs_int8
@pytest.mark.parametrize("form", FORMS)
def test_a_rows_result_does_not_depend_on_the_rows_or_threads_beside_it(form):
    """Bit for bit: so a Verify's rows equal their one-row decodes in every product."""
    weight = FORMS[form][0](1536, 576, 2)
    packed = panels.to_int8(panels.pack_compact(weight))
    torch.manual_seed(0)
    assert_rows_alone(lambda rows: panels.product(rows, packed, 1536), torch.randn(19, 576))


@needs_int8
def test_the_int8_copy_keeps_gguf_scales_in_float16():
    """A sixth fewer bytes a 4-bit weight: d and m are float16 exactly, as GGUF stores them (each
    block's least weight at level 0, as GGUF's quantizer puts it; the packaged target's 211 linears
    all are)."""
    torch.manual_seed(0)
    q = torch.randint(0, 16, (100, 18, 32)).float()
    q[..., 0] = 0
    d, m = (torch.rand(100, 18, 1) * 0.01).half().float(), (-torch.rand(100, 18, 1) * 0.05).half().float()
    compact = panels.pack_q4((q * d + m).reshape(100, 576))
    int8 = panels.to_int8(compact)
    assert int8.nibbles.numel() == compact.nibbles.numel() and int8.shape == compact.shape
    assert int8.scale.dtype == int8.offset.dtype == torch.float16
    assert panels.to_int8(panels.pack_q8(_q8_weight(64, 64, 0))).scale.dtype == torch.float16
    x = torch.randn(7, 576)
    stated = stated_arithmetic(x, q.reshape(100, 576), d[..., 0], m[..., 0])
    got = panels.product(x, int8, 100)
    assert float((got.double() - stated).abs().max() / stated.abs().max()) < 1e-6
    with pytest.raises(ValueError, match="int8 product"):
        panels.product(torch.randn(2, 575), int8, 100)


@needs_int8
@pytest.mark.parametrize("form", FORMS)
def test_scales_that_are_not_float16_stay_float32_and_give_the_stated_arithmetic(form):
    weight = FORMS[form][0](40, 96, 4)
    q, d, m = _levels(form, weight)
    compact = panels.pack_compact(weight)
    nudge = 1 + 2.0**-13  # below float16's resolution: such a d is no float16
    if form == "q4":
        compact = panels.Q4Panels(compact.nibbles, compact.scale * nudge, compact.offset)
    else:
        compact = panels.Q8Panels(compact.levels, compact.scale * nudge)
    int8 = panels.to_int8(compact)
    assert int8.scale.dtype == torch.float32
    x = torch.randn(7, 96)
    stated = stated_arithmetic(x, q, d * nudge, m)
    got = panels.product(x, int8, 40)
    assert float((got.double() - stated).abs().max() / stated.abs().max()) < 1e-6


def _compact_model(layers: int = 2):
    """A Llama of SmolLM2's widths whose every linear is exactly 4-bit blocks, its linears on int8."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from specdec.models.cpu_layout import use_layout_plans
    from specdec.models.layouts import PANELS
    from tests.tiny_models import as_q4_blocks

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=layers,
        num_attention_heads=9,
        num_key_value_heads=3,
    )
    torch.manual_seed(3)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.copy_(as_q4_blocks(module.weight))
    use_layout_plans(model, PANELS, int8=True)
    return model


@needs_int8
def test_every_linear_of_a_4_bit_model_multiplies_int8_rows_at_every_row_count():
    from specdec.models.cpu_layout import PlannedLinear, drop_unused_copies

    model = _compact_model()
    linears = [m for m in model.modules() if isinstance(m, PlannedLinear)]
    assert len(linears) == 2 * 7 + 1 and all(m.int8 for m in linears)
    drop_unused_copies(model)  # the plans name no layout it uses: its copy is its only one
    assert all(m.int8 for m in linears)
    head = model.lm_head
    x = torch.randn(200, 576)  # past panels.MAX_ROWS: no float32 layout takes over
    assert torch.equal(head(x)[150:151], head(x[150:151]))


@needs_int8
def test_batched_steps_verifies_and_prompts_give_each_row_its_solo_decode_bits():
    """The fused layers and the head on int8: a decode batched with others, a Verify's rows and a
    prompt's last rows all give what one-row decodes of the same positions give."""
    from specdec.models.fused import fused_layers

    model = _compact_model()
    assert fused_layers(model).int8 and not fused_layers(model).compact
    prompts = {"a": list(range(1, 30)), "b": [7, 8, 9], "c": [10, 11, 12, 13]}  # "a": past the short rows
    alone = assert_a_batched_step_gives_solo_logits(model, prompts)
    # One decode at a time along the Verify's tokens: the same bits as its rows.
    verify = alone.last_logits("v", [*prompts["b"], 21, 22, 23, 24], 5).logits
    for i in range(5):
        decode = alone.last_logits("d", [*prompts["b"], 21, 22, 23, 24][: len(prompts["b"]) + i], 1).logits
        assert torch.equal(decode[-1], verify[i])
    # A prompt's rows (the fused layers' prompt path) against decodes of the same positions.
    prompt = alone.last_logits("p", prompts["a"], 3).logits
    for i in range(3):
        decode = alone.last_logits("q", prompts["a"][: len(prompts["a"]) - 2 + i], 1).logits
        assert torch.equal(decode[-1], prompt[i])


@needs_int8
def test_the_fused_layers_compute_what_transformers_forward_computes_on_int8():
    """The fused layers' int8 forms (layers.cpp) against the same model's plain forward, whose
    PlannedLinears run the same products one by one: the same logits but for attention's float
    noise, which can move an 8-bit rounding of x (a wrong form or layout is off everywhere)."""
    from specdec.models.runner import ModelRunner, SessionKVCache

    model = _compact_model()
    runner = ModelRunner(model, SessionKVCache(8, 10_000))
    tokens = [5, 9, 2, 33, 17, 8]
    fused = torch.stack([runner.last_logits("s", tokens[: i + 1], 1).logits[-1] for i in range(len(tokens))])
    with torch.no_grad():
        plain = model(torch.tensor([tokens])).logits[0]
    assert float((fused - plain).abs().max() / plain.abs().max()) < 1e-2


@needs_int8
def test_a_prompt_of_an_int8_model_runs_in_the_fused_layers(monkeypatch):
    """Not in transformers' forward: its ~40 tensor ops a layer cost a third of a prompt's time."""
    from specdec.models import ragged
    from specdec.models.runner import ModelRunner, SessionKVCache

    calls = []
    fused_forward = ragged.fused_forward
    monkeypatch.setattr(ragged, "fused_forward", lambda *a, **kw: calls.append(kw["tiles"]) or fused_forward(*a, **kw))
    ModelRunner(_compact_model(1), SessionKVCache(8, 10_000)).last_logits("s", list(range(1, 40)), 1)
    assert calls == [False]  # fused, and never on AMX tiles (another arithmetic)


@needs_int8
@pytest.mark.parametrize("rows", [1, 5, 7, 13])
def test_products_of_one_x_in_one_call_give_each_products_own_bits(rows):
    """The fused layers' q / k / v and gate / up (`int8_products`: x rounded once, all panels in one
    loop): each result equal to its own `product`, whatever the forms and widths beside it."""
    copies = [
        (panels.to_int8(panels.pack_compact(_q4_weight(100, 576, 1))), 100),  # float16 scales, a partial panel
        (panels.to_int8(panels.pack_q8(_q8_weight(64, 576, 2))), 64),
        (panels.to_int8(panels.pack_compact(_q4_weight(33, 576, 3))), 33),
    ]
    torch.manual_seed(rows)
    x = torch.randn(rows, 576)
    together = panels.int8_products(x, copies)
    for (copy, out), got in zip(copies, together, strict=True):
        assert torch.equal(got, panels.product(x, copy, out))
    with pytest.raises(ValueError, match="int8 products"):
        panels.int8_products(x, [(panels.pack_compact(_q4_weight(32, 576, 4)), 32)])
