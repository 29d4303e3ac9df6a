"""The fused decoder layers (kernels/layers.cpp, fused.py): transformers' logits and hidden states
for decode and Verify rows, from float32, 4-bit and 8-bit panels, with and without biases; each
row's bits independent of its company (batched, beside a prompt, a Verify row against its decode);
and the models the kernel cannot compute left to transformers."""

from __future__ import annotations

import pytest
import torch

from specdec.models import panels
from specdec.models.calibration import plan_layouts
from specdec.models.fused import fused_layers
from specdec.models.runner import ModelRunner, SessionKVCache, StepItem

pytestmark = pytest.mark.skipif(not panels.available(), reason="the compiled kernels are not built here")


def _runner(model) -> ModelRunner:
    runner = ModelRunner(model.eval(), SessionKVCache(16, 100_000))
    plan_layouts(runner, "panels", 0)  # every linear on the panels, as a calibrated service has them
    return runner


def _reference(model, token_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits [T, V], final hidden states [T, H]) of transformers' own forward, no cache."""
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([token_ids]), output_hidden_states=True)
    return out.logits[0], out.hidden_states[-1][0]


def _quantize(weight: torch.Tensor, bits: int, gen: torch.Generator) -> None:
    """Make `weight` exactly GGUF-style blocks of 32 inputs: 8-bit d * q, or 4-bit d * q + m."""
    n, k = weight.shape
    top = 15 if bits == 4 else 127
    q = torch.randint(0 if bits == 4 else -top, top + 1, (n, k // 32, 32), generator=gen).float()
    q[..., 0], q[..., 1] = (0 if bits == 4 else -top), top  # each block reaches both ends
    d = (torch.rand(n, k // 32, 1, generator=gen) * 0.02 + 0.01).half().float()
    m = (torch.rand(n, k // 32, 1, generator=gen) * -0.1).half().float() if bits == 4 else 0.0
    weight.copy_((q * d + m).reshape(n, k))


@pytest.fixture(scope="module")
def qwen2_blocks():
    """A tiny Qwen2 (biased q / k / v) whose attention products are 4-bit and MLP and head 8-bit blocks."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=50, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False,
    )
    torch.manual_seed(3)
    model = Qwen2ForCausalLM(config)
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for layer in model.model.layers:
            for linear in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                _quantize(linear.weight, 4, gen)
                linear.bias.normal_(0, 0.5, generator=gen)
            _quantize(layer.self_attn.o_proj.weight, 4, gen)
            for linear in (layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj):
                _quantize(linear.weight, 8, gen)
            layer.input_layernorm.weight.uniform_(0.5, 1.5, generator=gen)
        _quantize(model.lm_head.weight, 8, gen)  # as the packaged target's head,
        model.lm_head.weight.mul_(2.0**-6)  # scaled (exactly) to logits of a few units
    runner = _runner(model)
    yield runner
    runner.close()


def test_decode_and_verify_rows_are_transformers_logits(tiny_loaded):
    runner = tiny_loaded["target"].runner
    assert runner.on_model_thread(runner.fuses_layers)
    tokens = [(3 * t + 1) % runner.vocab_size for t in range(29)]
    runner.on_model_thread(runner.last_logits, "fused-ref", tokens[:24], 1)
    decode = runner.on_model_thread(runner.last_logits, "fused-ref", tokens[:25], 1)
    verify = runner.on_model_thread(runner.last_logits, "fused-ref", tokens, 4, hidden_from=25)
    logits, hidden = _reference(runner.model, tokens)
    torch.testing.assert_close(decode.logits[0], logits[24], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(verify.logits, logits[-4:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(verify.hidden, hidden[25:], rtol=1e-5, atol=1e-5)
    runner.on_model_thread(runner.cache.drop, "fused-ref")


def test_four_and_eight_bit_panels_and_biases_give_transformers_logits(qwen2_blocks):
    runner = qwen2_blocks
    layer = runner.model.model.layers[0]
    assert isinstance(layer.self_attn.q_proj.weight_panels, panels.Q4Panels)
    assert isinstance(layer.mlp.down_proj.weight_panels, panels.Q8Panels)
    assert runner.on_model_thread(runner.fuses_layers)
    tokens = [(7 * t + 2) % runner.vocab_size for t in range(40)]
    runner.on_model_thread(runner.last_logits, "blocks", tokens[:34], 1)
    verify = runner.on_model_thread(runner.last_logits, "blocks", tokens, 6)
    torch.testing.assert_close(verify.logits, _reference(runner.model, tokens)[0][-6:], rtol=1e-5, atol=1e-5)


def test_a_rows_bits_do_not_depend_on_its_company(qwen2_blocks):
    """Batched with others, beside a prompt, or as a Verify row: the bits of the row alone."""
    runner = qwen2_blocks
    vocab = runner.vocab_size
    a, b, c = ([(m * t + s) % vocab for t in range(30)] for m, s in ((3, 1), (5, 2), (11, 4)))
    for session, tokens in (("a", a), ("b", b)):
        runner.on_model_thread(runner.last_logits, session, tokens, 1)
    alone_a = runner.on_model_thread(runner.last_logits, "a", [*a, 3, 4, 5], 3)
    alone_b = runner.on_model_thread(runner.last_logits, "b", [*b, 6], 1)
    decode = runner.on_model_thread(runner.last_logits, "a", [*a, 3, 4], 1)  # the Verify's second row
    assert torch.equal(alone_a.logits[1], decode.logits[0])
    batched = runner.on_model_thread(runner.step, [StepItem("a", [*a, 3, 4, 5], 3), StepItem("b", [*b, 6], 1)])
    assert torch.equal(batched[0].logits, alone_a.logits) and torch.equal(batched[1].logits, alone_b.logits)
    # Many kept rows in one step (the head's product over 4 x 5 rows) give each Verify its solo bits.
    many = [(f"many-{s}", [(13 * t + s) % vocab for t in range(25)]) for s in range(4)]
    for session, tokens in many:
        runner.on_model_thread(runner.last_logits, session, tokens, 1)
    solo = [runner.on_model_thread(runner.last_logits, s, [*t, 1, 2, 3, 4, 5], 5).logits for s, t in many]
    step = runner.on_model_thread(runner.step, [StepItem(s, [*t, 1, 2, 3, 4, 5], 5) for s, t in many])
    assert all(torch.equal(result.logits, alone) for result, alone in zip(step, solo, strict=True))
    beside = runner.on_model_thread(runner.step, [StepItem("b", [*b, 6], 1), StepItem("c", c, 1)])
    assert torch.equal(beside[0].logits, alone_b.logits)
    prompt = _reference(runner.model, c)[0][-1]
    torch.testing.assert_close(beside[1].logits[0], prompt, rtol=1e-5, atol=1e-5)


def test_silu_of_any_width_and_any_gate_gives_transformers_logits():
    """An MLP width that is no whole number of vectors (the SiLU's tail) and gates from -100 to 100
    (its two branches and the exp's clamp): transformers' logits."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=40, hidden_size=32, intermediate_size=44, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )
    torch.manual_seed(5)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.model.layers[0].mlp.gate_proj.weight.mul_(400.0)  # gates of tens, both signs
    runner = _runner(model)
    try:
        assert runner.on_model_thread(runner.fuses_layers)
        tokens = [(5 * t + 3) % config.vocab_size for t in range(12)]
        runner.on_model_thread(runner.last_logits, "silu", tokens[:9], 1)
        verify = runner.on_model_thread(runner.last_logits, "silu", tokens, 3)
        torch.testing.assert_close(verify.logits, _reference(model, tokens)[0][-3:], rtol=1e-5, atol=1e-5)
    finally:
        runner.close()


def test_models_the_kernel_cannot_compute_keep_transformers():
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    shape = dict(vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4)
    qk_norms = Qwen3ForCausalLM(Qwen3Config(**shape, num_key_value_heads=2, head_dim=8))
    gelu = LlamaForCausalLM(LlamaConfig(**shape, hidden_act="gelu"))
    plain = LlamaForCausalLM(LlamaConfig(**shape))  # nn.Linear, no panels
    for model in (qk_norms, gelu):
        runner = _runner(model)
        try:
            assert fused_layers(model) is None and not runner.on_model_thread(runner.fuses_layers)
        finally:
            runner.close()
    assert fused_layers(plain) is None


@pytest.mark.skipif(not panels.amx_available(), reason="no AMX tiles on this CPU (or SPECDEC_AMX=off)")
def test_prompts_of_compact_models_run_fused_on_amx_tiles_apart_from_short_rows(qwen2_blocks, monkeypatch):
    """A prompt takes the fused layers with its products on the tiles (transformers' logits within
    float32 noise, at every row), alone or beside a decode, which keeps its solo bits; a decode
    after such a prompt is transformers' too. Without the tiles prompts keep transformers' forward."""
    from specdec.models import ragged

    runner, vocab = qwen2_blocks, qwen2_blocks.vocab_size
    calls = []
    real = ragged.fused_forward

    def spy(*args, tiles=False, **kwargs):
        calls.append((args[1].rows, tiles))
        return real(*args, tiles=tiles, **kwargs)

    monkeypatch.setattr(ragged, "fused_forward", spy)
    p, q = ([(m * t + s) % vocab for t in range(40)] for m, s in ((7, 3), (13, 5)))
    prompt = runner.on_model_thread(runner.last_logits, "tiles-p", p[:36], 36)
    assert calls == [(36, True)]
    reference = _reference(runner.model, p)[0]
    torch.testing.assert_close(prompt.logits, reference[:36], rtol=1e-5, atol=1e-5)
    decode = runner.on_model_thread(runner.last_logits, "tiles-p", p[:37], 1)
    torch.testing.assert_close(decode.logits[0], reference[36], rtol=1e-5, atol=1e-5)
    runner.on_model_thread(runner.cache.drop, "tiles-p")
    for _ in range(2):  # the same cached prompt, then its decode alone, then beside another prompt
        runner.on_model_thread(runner.last_logits, "tiles-p", p[:37], 1)
        alone = runner.on_model_thread(runner.last_logits, "tiles-p", p[:38], 1)
        runner.on_model_thread(runner.cache.drop, "tiles-p")
    runner.on_model_thread(runner.last_logits, "tiles-p", p[:37], 1)
    calls.clear()
    beside = runner.on_model_thread(runner.step, [StepItem("tiles-p", p[:38], 1), StepItem("tiles-q", q, 1)])
    assert sorted(calls) == [(1, False), (40, True)]
    assert torch.equal(beside[0].logits, alone.logits)
    torch.testing.assert_close(beside[1].logits[0], _reference(runner.model, q)[0][-1], rtol=1e-5, atol=1e-5)
    monkeypatch.setattr(panels, "amx_available", lambda: False)
    calls.clear()
    runner.on_model_thread(runner.last_logits, "tiles-r", [(17 * t + 6) % vocab for t in range(30)], 1)
    assert calls == []
    for session in ("tiles-p", "tiles-q", "tiles-r"):
        runner.on_model_thread(runner.cache.drop, session)


@pytest.mark.parametrize("which", ["tiny_loaded", "qwen2_blocks"])
def test_the_rotary_table_holds_what_the_model_computes_for_any_rows(which, request):
    """Every step's cos / sin come from a table of every position, built once by the model's own
    rotary embedding: the same values as computing them per step, wherever a row sits in it."""
    from specdec.models.fused import _ROTARY, _rotary

    fixture = request.getfixturevalue(which)
    model = (fixture["target"].runner if which == "tiny_loaded" else fixture).model
    inner = model.model
    gen = torch.Generator().manual_seed(3)
    limit = model.config.max_position_embeddings
    for rows in (1, 5, 17, 64):
        positions = torch.randint(0, limit, (1, rows), generator=gen)
        embeds = torch.zeros((1, rows, model.config.hidden_size))
        direct = [t[0].to(torch.float32) for t in inner.rotary_emb(embeds, positions)]
        assert all(torch.equal(a, b) for a, b in zip(_rotary(inner, embeds, positions), direct, strict=True))
    table = getattr(inner.rotary_emb, _ROTARY)
    _rotary(inner, torch.zeros((1, 1, model.config.hidden_size)), torch.tensor([[limit - 1]]))
    assert getattr(inner.rotary_emb, _ROTARY) is table and table[0].shape[0] == limit  # built once
