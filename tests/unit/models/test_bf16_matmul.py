"""Bf16Linear multiplies in bfloat16 and gives each row the same bits batched or alone, so a
sequence computes the same logits in a Verify, a batched step or a decode; the head and tied
weights stay float32; the setting is applied only where it can be.

Tolerance for logits: rows get the same linear products whatever else runs, so what is left is
float32 noise of attention and norms (<= 1e-5 of |logit|, as test_ragged). Without the blocks
(`block` 1,024: one oneDNN call over every row) a 48-row Verify of the SmolLM2-shaped layer below
differs from the same positions decoded one by one by ~1e-2, and the row tests fail.
"""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch

from specdec.models import bf16_matmul
from specdec.models.bf16_matmul import (
    Bf16Linear,
    bf16_supported,
    decoder_linears,
    invariant_block,
    use_bf16_matmuls,
)
from specdec.models.runner import ModelRunner, SessionKVCache, StepItem

pytestmark = pytest.mark.skipif(not bf16_supported(), reason="this torch build has no oneDNN bfloat16 matmul")

SMOLLM2_SHAPES = [(576, 1536), (1536, 576), (576, 576), (576, 192)]  # (in, out) of its decoder linears


def _llama(hidden: int, intermediate: int, tie: bool = True, layers: int = 1, vocab: int = 64):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64 if hidden >= 64 else 2,
        num_key_value_heads=1,
        tie_word_embeddings=tie,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("shape", [(1, 24), (3, 24), (2, 5, 24), (70, 24)])
@pytest.mark.parametrize("bias", [False, True])
def test_the_product_is_linear_in_bfloat16(shape, bias):
    torch.manual_seed(0)
    linear = torch.nn.Linear(24, 40, bias=bias)
    x = torch.randn(shape)
    got = Bf16Linear(linear, block=32)(x)
    # bfloat16 inputs and weights, float32 accumulation, the output rounded to bfloat16.
    exact = (x.bfloat16().double() @ linear.weight.bfloat16().double().t()).bfloat16().float()
    expected = exact if not bias else exact + linear.bias
    assert got.dtype == torch.float32 and got.shape == (*shape[:-1], 40)
    torch.testing.assert_close(got, expected, rtol=2**-7, atol=1e-6)


@pytest.mark.parametrize("in_features, out_features", SMOLLM2_SHAPES)
def test_each_row_gets_the_same_bits_batched_or_alone(in_features, out_features):
    torch.manual_seed(0)
    layer = Bf16Linear(torch.nn.Linear(in_features, out_features, bias=False), invariant_block(SMOLLM2_SHAPES))
    x = torch.randn(100, in_features)
    alone = torch.cat([layer(x[i : i + 1]) for i in range(100)])
    for rows in (2, 7, 32, 33, 48, 100):
        assert torch.equal(layer(x[:rows]), alone[:rows]), rows


def test_the_block_halves_until_rows_do_not_depend_on_each_other(monkeypatch):
    product = bf16_matmul._product

    def kernel_switch_past_8_rows(rows, packed):
        out = product(rows, packed)
        return out + 1 if rows.shape[0] > 8 else out  # another kernel, other bits

    monkeypatch.setattr(bf16_matmul, "_product", kernel_switch_past_8_rows)
    assert invariant_block([(24, 40)]) == 8
    assert invariant_block([(24, 40)], largest=4) == 4


def test_no_row_is_multiplied_alone(monkeypatch):
    """A kernel that multiplies one row in another order than several (an AVX-512 EPYC, inner
    dimension 1,536) never runs: a lone row goes as one of two, so it gets its batched bits."""
    product = bf16_matmul._product
    calls = []

    def one_row_kernel_differs(rows, packed):
        calls.append(rows.shape[0])
        out = product(rows, packed)
        return out + 1 if rows.shape[0] == 1 else out

    monkeypatch.setattr(bf16_matmul, "_product", one_row_kernel_differs)
    assert invariant_block([(24, 40)]) == bf16_matmul.BLOCK_ROWS
    torch.manual_seed(0)
    layer = Bf16Linear(torch.nn.Linear(24, 40, bias=False), block=4)
    x = torch.randn(9, 24)  # blocks of 4, 4 and 1
    alone = torch.cat([layer(x[i : i + 1]) for i in range(9)])
    assert torch.equal(layer(x), alone)
    assert 1 not in calls


@pytest.mark.parametrize("tie", [True, False])
def test_the_head_and_tied_weights_stay_float32(tie):
    model = _llama(16, 32, tie=tie, layers=2, vocab=16)
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.inference_mode():
        before = model(ids).logits
    swapped = len(decoder_linears(model))
    assert swapped == 2 * 7  # q, k, v, o, gate, up, down per layer
    assert use_bf16_matmuls(model) >= 1
    assert type(model.lm_head) is torch.nn.Linear and model.lm_head.weight.dtype == torch.float32
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tie
    assert sum(isinstance(m, Bf16Linear) for m in model.modules()) == swapped
    with torch.inference_mode():
        after = model(ids).logits
    assert not torch.equal(before, after)  # it did change the products ...
    torch.testing.assert_close(after, before, rtol=0, atol=5e-2 * before.abs().max().item())  # ... by rounding


def test_a_verify_a_batched_step_and_decodes_give_the_same_logits():
    """A Verify of 48 rows (past the block), the same positions in a step beside other sessions,
    and the same positions decoded one by one, on one thread (the thread governor may pick one for
    some forwards and all CPUs for others): the logits a coordinator compares."""
    model = _llama(576, 1536)
    use_bf16_matmuls(model)
    prefix = [(5 * i + 1) % 64 for i in range(20)]
    drafted = [(7 * i + 3) % 64 for i in range(48)]
    verify = ModelRunner(model, SessionKVCache(8, 10_000))
    verify.last_logits("s", prefix, 1)
    verified = verify.last_logits("s", prefix + drafted, len(drafted)).logits  # [48, V]

    decode = ModelRunner(model, SessionKVCache(8, 10_000))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        decoded = torch.stack(
            [decode.last_logits("s", prefix + drafted[: i + 1], 1).logits[0] for i in range(len(drafted))]
        )
    finally:
        torch.set_num_threads(threads)
    batched = ModelRunner(model, SessionKVCache(8, 10_000))
    for other in ("a", "b"):
        batched.last_logits(other, prefix[::-1], 1)
    batched.last_logits("s", prefix, 1)
    items = [StepItem("s", prefix + drafted, len(drafted))]
    items += [StepItem(other, prefix[::-1] + drafted[:20], 20) for other in ("a", "b")]
    stepped = batched.step(items)[0].logits
    scale = decoded.abs().max().item()
    torch.testing.assert_close(verified, decoded, rtol=0, atol=1e-5 * scale)
    torch.testing.assert_close(stepped, decoded, rtol=0, atol=1e-5 * scale)


def test_rowwise_attention_is_attention_under_causal_and_padding_masks():
    """Row by row is the same attention (to float32 noise) whatever the mask: none (causal), a
    plain causal one (bool or additive), or left padding, which runs under each row's own mask."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups = True, 2
    setattr(module, bf16_matmul.ROWWISE, True)
    torch.manual_seed(0)
    past, rows = 5, 4
    q, k, v = torch.randn(2, 4, rows, 8), torch.randn(2, 2, past + rows, 8), torch.randn(2, 2, past + rows, 8)
    causal = torch.ones(rows, past + rows, dtype=torch.bool).tril(past).expand(2, 1, rows, past + rows)
    padded = causal.clone()
    padded[1, :, :, :3] = False  # the second sequence is left-padded by 3
    additive = torch.zeros(causal.shape).masked_fill(~causal, float("-inf"))
    attend = bf16_matmul.rowwise(sdpa_attention_forward)
    for mask, plain in ((None, True), (causal, True), (additive, True), (padded, False)):
        expected, _ = sdpa_attention_forward(module, q, k, v, causal if mask is None else mask)
        got, _ = attend(module, q, k, v, mask)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
        assert mask is None or bf16_matmul.plain_causal(mask, past, rows) == plain


@contextmanager
def _threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _cache_buffer(positions: int, spare: int, generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values as a cache layer holds them: views of a buffer with spare positions that
    hold stale rows (a rollback leaves them), which a row must not see."""
    keys = torch.randn(1, 3, positions + spare, 64, generator=generator)
    values = torch.randn(1, 3, positions + spare, 64, generator=generator)
    return keys[:, :, :positions], values[:, :, :positions]


@pytest.mark.parametrize("past, rows", [(0, 1), (0, 40), (20, 5), (30, 3), (100, 48), (505, 12)])
def test_exact_rows_give_each_row_its_decode_bits(past, rows):
    """Every row of a many-row call (a prompt, a Verify), across padded lengths and past stale
    spare positions, gets the bits of its own decode (a one-row call over the keys up to it), on
    the two threads a service runs: SmolLM2's heads (9 query heads over 3 key/value heads of 64)."""
    generator = torch.Generator().manual_seed(past + rows)
    keys, values = _cache_buffer(past + rows, 64, generator)
    query = torch.randn(1, 9, rows, 64, generator=generator)
    with _threads(2):
        together = bf16_matmul.exact_rows(query, keys, values, 0.125, True)  # [1, rows, 9, 64]
        alone = [
            bf16_matmul.exact_rows(query[:, :, i : i + 1], keys[:, :, : past + i + 1], values[:, :, : past + i + 1], 0.125, True)
            for i in range(rows)
        ]
    assert together.shape == (1, rows, 9, 64)
    assert all(torch.equal(together[:, i : i + 1], row) for i, row in enumerate(alone))
    # ... and it is attention over the row's own keys (to float32 noise).
    expected = torch.cat(
        [
            torch.nn.functional.scaled_dot_product_attention(
                query[:, :, i : i + 1], keys[:, :, : past + i + 1], values[:, :, : past + i + 1], scale=0.125, enable_gqa=True
            )
            for i in range(rows)
        ],
        dim=2,
    ).transpose(1, 2)
    torch.testing.assert_close(together, expected, rtol=1e-5, atol=1e-6)


def test_padded_keys_are_the_buffer_s_spare_positions_or_zeros():
    generator = torch.Generator().manual_seed(0)
    keys, _ = _cache_buffer(40, 24, generator)
    view = bf16_matmul._extended(keys, 64)
    assert view.shape == (1, 3, 64, 64) and view.data_ptr() == keys.data_ptr()  # no copy
    assert torch.equal(view[:, :, :40], keys)
    fresh = torch.randn(1, 40, 3, 64, generator=generator).transpose(1, 2)  # a projection's own keys: no room
    padded = bf16_matmul._extended(fresh, 64)
    assert torch.equal(padded[:, :, :40], fresh) and not padded[:, :, 40:].any()


def test_a_step_s_sessions_share_two_workers_and_keep_their_bits():
    """Decodes and Verifies of several sessions in one call (`exact_rows_many`, as a batched step
    runs them): the calls go to this thread and the helper, and each session's rows get the bits
    they get alone."""
    generator = torch.Generator().manual_seed(1)
    jobs = []
    for past, rows in ((400, 1), (31, 1), (96, 5), (0, 70), (200, 1)):
        keys, values = _cache_buffer(past + rows, 64, generator)
        jobs.append((torch.randn(1, 9, rows, 64, generator=generator), keys, values))
    with _threads(2):
        together = bf16_matmul.exact_rows_many(jobs, 0.125, True)
        with _threads(1):
            alone = [bf16_matmul.exact_rows(*job, 0.125, True) for job in jobs]  # one worker, no helper
    assert all(torch.equal(a, b) for a, b in zip(together, alone, strict=True))
