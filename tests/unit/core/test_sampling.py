"""The seed's math, checked exactly (algebra) and by sampling where it must be."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

from specdec.core.errors import InconsistentDraftError, NonFiniteLogitsError
from specdec.core.sampling import (
    Sampling,
    acceptance_probs,
    acceptance_rate,
    derive_seed,
    draw,
    greedy_round,
    normalize,
    output_law,
    recovered_probs,
    recovered_probs_point_mass,
    rng_for,
    sample_token,
    speculative_round,
)
from specdec.models.warping import greedy_tokens, to_wire, warp_logits, wire_laws


def test_seed_article_example_exactly():
    # shared/seed: q = (0.2, 0.4, 0.3, 0.1), p = (0.5, 0.1, 0.1, 0.3).
    q = np.array([0.2, 0.4, 0.3, 0.1])
    p = np.array([0.5, 0.1, 0.1, 0.3])
    assert acceptance_rate(q, p) == pytest.approx(0.5, abs=1e-15)
    np.testing.assert_allclose(acceptance_probs(q, p), [1.0, 0.25, 1 / 3, 1.0], atol=1e-15)
    np.testing.assert_allclose(recovered_probs(q, p), [0.6, 0.0, 0.0, 0.4], atol=1e-15)
    np.testing.assert_allclose(output_law(q, p), p, atol=1e-15)


def _random_pairs(rng: np.random.Generator):
    """(name, q, p) pairs covering the cases the issue names."""
    for vocab in (2, 5, 50, 1000):
        for _ in range(20):
            yield "dense", rng.dirichlet(np.ones(vocab)), rng.dirichlet(np.ones(vocab))
            yield "peaked", rng.dirichlet(np.full(vocab, 0.05)), rng.dirichlet(np.full(vocab, 0.05))
            q = rng.dirichlet(np.ones(vocab)) * (rng.random(vocab) < 0.3)
            p = rng.dirichlet(np.ones(vocab)) * (rng.random(vocab) < 0.3)
            q[0] += 1e-3  # keep at least one nonzero entry
            p[-1] += 1e-3
            yield "sparse", normalize(q), normalize(p)
        half = vocab // 2 or 1
        q = np.zeros(vocab)
        q[:half] = rng.dirichlet(np.ones(half))
        p = np.zeros(vocab)
        p[half:] = rng.dirichlet(np.ones(vocab - half)) if vocab > half else 1.0
        yield "disjoint", q, normalize(p)
        same = rng.dirichlet(np.ones(vocab))
        yield "equal", same, same.copy()
        yield "one-hot", np.eye(vocab)[0], np.eye(vocab)[vocab - 1]
        yield "one-hot-same", np.eye(vocab)[0], np.eye(vocab)[0]
        yield "q-zero-where-p-positive", normalize(np.r_[0.0, np.ones(vocab - 1)]), np.full(vocab, 1 / vocab)


def test_output_law_equals_target_for_many_pairs():
    """P(x) = q(x) A(x) + (1 - sum q A) p'(x) == p(x) to 1e-9, from the implementation's own functions."""
    rng = np.random.default_rng(1234)
    checked = 0
    for name, q, p in _random_pairs(rng):
        law = output_law(q, p)
        np.testing.assert_allclose(law, p, atol=1e-9, err_msg=name)
        assert np.all(law >= 0)
        checked += 1
    assert checked >= 260


def test_equal_laws_never_divide_by_zero():
    p = np.array([0.25, 0.25, 0.5])
    with np.errstate(all="raise"):
        assert acceptance_rate(p, p) == pytest.approx(1.0)
        np.testing.assert_array_equal(recovered_probs(p, p), p)  # the zero-mass fallback


def test_residual_that_rounds_to_zero_falls_back_to_target():
    p = np.array([0.5, 0.5])
    q = np.nextafter(p, 1.0)  # q >= p everywhere by rounding: max(0, p - q) is all zeros
    np.testing.assert_array_equal(recovered_probs(q, p), p)


def test_token_with_zero_target_prob_is_always_rejected():
    q = np.array([0.5, 0.5])
    p = np.array([1.0, 0.0])
    assert acceptance_probs(q, p)[1] == 0.0
    for seed in range(50):
        result = speculative_round([1], q[None].astype(np.float32), np.stack([p, p]).astype(np.float32), rng_for(seed))
        assert result.accepted_tokens == [] and result.recovered_token == 0


def test_draft_token_with_zero_draft_prob_is_an_error():
    q = np.array([[1.0, 0.0]], dtype=np.float32)
    p = np.array([[0.5, 0.5], [0.5, 0.5]], dtype=np.float32)
    with pytest.raises(InconsistentDraftError):
        speculative_round([1], q, p, rng_for(0))


def test_sample_token_never_draws_zero_probability_tokens():
    probs = normalize(np.array([0.0, 0.3, 0.0, 0.7, 0.0]))
    for u in [0.0, 1e-300, 0.3 - 1e-17, 0.3, 0.3 + 1e-17, 0.999999999999, np.nextafter(1.0, 0.0)]:
        assert sample_token(probs, u) in (1, 3)


@pytest.mark.parametrize("vocab", [4096, 49152, 600, 100])  # whole blocks, a partial last one, one partial block
def test_a_draw_is_the_inverse_cdf_draw_of_the_normalised_weights(vocab):
    """`draw` finds the interval in two levels (block sums, then one block): for any uniform, the
    token the one-level inverse CDF of the normalised weights gives, never a zero-weight one."""
    rng = np.random.default_rng(4)
    uniforms = [0.0, 1e-12, 0.3, 0.5, 0.999999, float(np.nextafter(1.0, 0.0))]
    for token in (0, 5, vocab - 1):  # point masses (greedy laws), in any block
        for scale in (1.0, 0.25, 3.0):  # a law, or weights normalize would scale
            one_hot = np.zeros(vocab, np.float32)
            one_hot[token] = scale
            for u in uniforms:
                assert draw(one_hot, u) == sample_token(normalize(one_hot), u) == token
    for density in (0.01, 0.5, 1.0):  # a few tokens (most blocks empty), half, dense
        for _ in range(20):
            weights = rng.random(vocab).astype(np.float32) * (rng.random(vocab) < density)
            weights[rng.integers(vocab)] += 0.5
            for u in [*uniforms, *rng.random(20)]:
                token = draw(weights, u)
                assert token == sample_token(normalize(weights), u) and weights[token] > 0
                assert draw(weights.astype(np.float64), u) == token  # float64 weights (a residual law)


def test_a_draw_never_lands_past_a_block_whose_cumulative_sum_rounds_below_its_block_sum():
    weights = np.zeros(512)
    weights[0], weights[1:256] = 1.0, 2.0**-53  # added one by one each rounds away; pairwise they add up
    assert np.cumsum(weights[:256])[-1] < weights[:256].sum()
    for u in (1 - 1e-15, float(np.nextafter(1.0, 0.0))):
        token = draw(weights, u)
        assert token < 256 and weights[token] > 0


def test_the_point_mass_residual_is_the_one_hot_residual_number_for_number():
    rng = np.random.default_rng(12)
    for _ in range(50):
        p = normalize(rng.random(300) * (rng.random(300) < 0.2))
        token = int(rng.choice(np.flatnonzero(p))) if rng.random() < 0.8 else 7
        one_hot = np.zeros(300)
        one_hot[token] = 1.0
        assert np.array_equal(recovered_probs_point_mass(token, p), recovered_probs(one_hot, p))
    point = np.zeros(300)
    point[4] = 1.0  # p is the point mass on x: a rejection can only come from rounding
    assert np.array_equal(recovered_probs_point_mass(4, point), point)


def test_a_point_mass_round_is_the_one_hot_round_number_for_number():
    """draft_probs None (a model-free draft) takes the same uniforms to the same tokens as the
    one-hot laws: accepted with p(x), recovered from p without x, the bonus from p_{K+1}."""
    rng = np.random.default_rng(11)
    vocab = 700
    for case in range(300):
        k = int(rng.integers(0, 5))
        if case % 3 == 0:  # greedy: the target's laws are point masses too
            target = np.zeros((k + 1, vocab), np.float32)
            target[np.arange(k + 1), rng.integers(0, 4, k + 1)] = 1.0
        else:  # a few likely tokens, so drafts are often accepted and sometimes p(x) = 0 or 1
            target = rng.random((k + 1, vocab)).astype(np.float32) * (rng.random((k + 1, vocab)) < 0.01)
            target[:, :4] += rng.random((k + 1, 4)).astype(np.float32) * (case % 5 != 0)
            target[:, 4] += 1e-3
        tokens = [int(t) for t in rng.integers(0, 6, k)]
        if case % 3:  # often most of p on the drafted token; and weights, not laws (normalised alike)
            target[np.arange(k), tokens] += 3.0 * (rng.random(k) < 0.5)
            target *= rng.uniform(0.5, 2.0, (k + 1, 1)).astype(np.float32)
        one_hot = np.zeros((k, vocab), np.float32)
        one_hot[np.arange(k), tokens] = 1.0
        seed = int(rng.integers(1 << 30))
        dense = speculative_round(tokens, one_hot, target, np.random.default_rng(seed))
        assert speculative_round(tokens, None, target, np.random.default_rng(seed)) == dense


def test_a_greedy_round_is_the_one_hot_round_token_for_token():
    """Point masses against greedy laws: `greedy_round` on the laws' tokens gives what
    `speculative_round` gives on the one-hot laws, whatever the uniforms."""
    rng = np.random.default_rng(13)
    vocab = 50
    for case in range(400):
        k = int(rng.integers(0, 6))
        target_tokens = rng.integers(0, 3, k + 1)  # few tokens, so drafts often match
        laws = np.zeros((k + 1, vocab), np.float32)
        laws[np.arange(k + 1), target_tokens] = 1.0
        tokens = [int(t) for t in rng.integers(0, 3, k)]
        one_hot = speculative_round(tokens, None, laws, np.random.default_rng(case))
        assert greedy_round(tokens, target_tokens) == one_hot
        assert all(type(t) is int for t in greedy_round(tokens, target_tokens).tokens)
    with pytest.raises(ValueError, match="shape mismatch"):
        greedy_round([1, 2], np.array([1, 2]))


def test_round_emits_between_one_and_k_plus_one_tokens():
    rng = np.random.default_rng(0)
    vocab, k = 6, 4
    for seed in range(200):
        q = rng.dirichlet(np.ones(vocab), size=k).astype(np.float32)
        p = rng.dirichlet(np.ones(vocab), size=k + 1).astype(np.float32)
        drafts = [sample_token(normalize(row), rng.random()) for row in q]
        result = speculative_round(drafts, q, p, rng_for(seed))
        assert 1 <= len(result.tokens) <= k + 1
        assert result.accepted_tokens == drafts[: len(result.accepted_tokens)]
        assert (result.bonus_token is None) != (result.recovered_token is None)
        if result.bonus_token is not None:
            assert len(result.accepted_tokens) == k


def test_round_is_reproducible_from_its_seed():
    rng = np.random.default_rng(5)
    q = rng.dirichlet(np.ones(5), size=3).astype(np.float32)
    p = rng.dirichlet(np.ones(5), size=4).astype(np.float32)
    first = speculative_round([0, 1, 2], q, p, rng_for(42, 0, 7, 1))
    again = speculative_round([0, 1, 2], q, p, rng_for(42, 0, 7, 1))
    assert first == again
    assert derive_seed(42, 0, 7, 0) != derive_seed(42, 0, 7, 1) != derive_seed(43, 0, 7, 1)


def test_one_position_by_sampling_matches_target_chi_square():
    """The round as a sampler (draft draw + accept/recover) against p, alpha = 0.001."""
    q = np.array([0.2, 0.4, 0.3, 0.1], dtype=np.float32)
    p = np.array([0.5, 0.1, 0.1, 0.3], dtype=np.float32)
    rng = np.random.default_rng(2024)
    n = 40_000
    counts = np.zeros(4)
    for _ in range(n):
        x = sample_token(normalize(q), rng.random())
        # K = 1 and keep only the first emitted token: the law of position 1.
        counts[speculative_round([x], q[None], np.stack([p, p]), rng).tokens[0]] += 1
    _, p_value = stats.chisquare(counts, n * normalize(p))
    assert p_value > 0.001, (counts / n, p_value)


# ---------------------------------------------------------------- warping


def test_warp_temperature_top_k_top_p():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, -3.0]])
    base = warp_logits(logits, Sampling(1.0))
    assert base.dtype == torch.float32 and logits.equal(torch.tensor([[2.0, 1.0, 0.5, -1.0, -3.0]]))  # (in place: no)
    np.testing.assert_allclose(base.numpy(), torch.softmax(logits.double(), -1).numpy(), rtol=1e-6, atol=0)
    hot = warp_logits(logits, Sampling(0.5))
    assert logits.equal(torch.tensor([[2.0, 1.0, 0.5, -1.0, -3.0]]))
    np.testing.assert_allclose(hot.numpy(), torch.softmax(logits.double() / 0.5, -1).numpy(), rtol=1e-6, atol=0)
    top2 = warp_logits(logits, Sampling(1.0, top_k=2)).numpy()[0]
    assert np.count_nonzero(top2) == 2 and top2[:2].sum() == pytest.approx(1.0)
    nucleus = warp_logits(logits, Sampling(1.0, top_p=0.7)).numpy()[0]
    # softmax = .61, .22, .14, ...: the smallest prefix with mass >= 0.7 is the top two.
    assert np.count_nonzero(nucleus) == 2
    assert nucleus.sum() == pytest.approx(1.0)
    tiny_p = warp_logits(logits, Sampling(1.0, top_p=1e-6)).numpy()[0]
    np.testing.assert_array_equal(tiny_p, [1, 0, 0, 0, 0])


def test_greedy_is_one_hot_argmax_first_on_ties():
    logits = torch.tensor([[0.0, 3.0, 3.0, 1.0]])
    np.testing.assert_array_equal(warp_logits(logits, Sampling(0.0)).numpy(), [[0, 1, 0, 0]])


def test_greedy_round_accepts_while_draft_is_target_argmax():
    vocab = 5
    one_hot = np.eye(vocab, dtype=np.float32)
    draft_tokens = [1, 2, 3]
    target_argmax = [1, 2, 4, 0]
    result = speculative_round(draft_tokens, one_hot[draft_tokens], one_hot[target_argmax], rng_for(0))
    assert result.accepted_tokens == [1, 2] and result.recovered_token == 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sampling", [Sampling(1.0), Sampling(0.0)], ids=["sampled", "greedy"])
def test_nonfinite_logits_are_a_clear_error(sampling, dtype):
    """(Greedy checks in its argmax's pass: numpy's argmax in float32, torch's in bfloat16.)"""
    nan, inf = float("nan"), float("inf")
    # A bad value anywhere, in any row (the second row here), alone or with the other kind.
    for bad in ([0.0, nan], [0.0, inf], [inf, nan], [nan, -inf], [nan, inf]):
        with pytest.raises(NonFiniteLogitsError, match="NaN or"):
            warp_logits(torch.tensor([[0.0, 1.0], bad], dtype=dtype), sampling)
    with pytest.raises(NonFiniteLogitsError, match="all -inf"):
        warp_logits(torch.tensor([[0.0, 1.0], [-inf, -inf]], dtype=dtype), sampling)
    masked = warp_logits(torch.tensor([[0.0, -inf]], dtype=dtype), sampling)  # -inf alone is a legal mask
    np.testing.assert_array_equal(masked.numpy(), [[1.0, 0.0]])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_greedy_takes_the_first_argmax_in_any_dtype(dtype):
    logits = torch.tensor([[0.5, 2.0, 2.0, -1.0], [3.0, 1.0, 3.0, 3.0]], dtype=dtype)
    probs = warp_logits(logits, Sampling(0.0))
    assert probs.dtype == torch.float32
    np.testing.assert_array_equal(probs.numpy(), [[0, 1, 0, 0], [1, 0, 0, 0]])
    # Rows of a vocabulary's size, ties planted, as a strided view: torch's own argmax rule.
    wide = torch.randn(6, 2 * 49152, generator=torch.Generator().manual_seed(5)).to(dtype)[:, ::2]
    wide[2, 100] = wide[2, 40000] = wide[2].max() + 1
    expected = torch.zeros(wide.shape, dtype=torch.float32).scatter_(-1, wide.argmax(-1, keepdim=True), 1.0)
    assert torch.equal(warp_logits(wide, Sampling(0.0)), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_greedy_tokens_are_the_greedy_laws_tokens(dtype):
    """What the target's own rounds read at T = 0 instead of the one-hot laws: the same tokens, the
    same errors."""
    logits = torch.randn(6, 2 * 4099, generator=torch.Generator().manual_seed(9)).to(dtype)[:, ::2]
    logits[2, 10] = logits[2, 4000] = logits[2].max() + 1  # a tie: the first index wins
    tokens = greedy_tokens(logits)
    assert tokens.shape == (6,) and tokens[2] == 10
    np.testing.assert_array_equal(tokens, np.argmax(wire_laws(logits, Sampling(0.0)), axis=-1))
    for bad, message in (([0.0, float("nan")], "NaN or"), ([-float("inf")] * 2, "all -inf")):
        with pytest.raises(NonFiniteLogitsError, match=message):
            greedy_tokens(torch.tensor([[0.0, 1.0], bad], dtype=dtype))


@pytest.mark.parametrize(
    "sampling", [Sampling(0.0), Sampling(1.0), Sampling(0.7, top_k=3), Sampling(1.0, top_p=0.8)], ids=str
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_laws_as_sent_are_the_warped_laws_bit_for_bit(sampling, dtype):
    """`wire_laws` (what both services send) is the warped laws as float32 arrays: the same bits."""
    logits = torch.randn(5, 300, generator=torch.Generator().manual_seed(3)).to(dtype)
    logits[1, 7] = logits[1, 200] = logits[1].max() + 1  # a tie: the first index wins
    sent = wire_laws(logits, sampling)
    assert sent.dtype == np.float32 and sent.flags.c_contiguous
    np.testing.assert_array_equal(sent, to_wire(warp_logits(logits, sampling)))
    with pytest.raises(NonFiniteLogitsError, match="NaN or"):
        wire_laws(torch.tensor([[0.0, 1.0], [float("nan"), 0.0]]), sampling)
    with pytest.raises(NonFiniteLogitsError, match="all -inf"):
        wire_laws(torch.tensor([[0.0, 1.0], [-float("inf"), -float("inf")]]), sampling)


def test_nucleus_fast_path_equals_full_sort():
    from specdec.models.warping import _nucleus

    def reference(probs, top_p):
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        mass_before = torch.cumsum(sorted_probs, -1) - sorted_probs
        keep_sorted = mass_before < top_p
        keep_sorted[..., 0] = True
        keep = torch.zeros_like(probs, dtype=torch.bool).scatter(-1, order, keep_sorted)
        out = probs.masked_fill(~keep, 0.0)
        return out / out.sum(-1, keepdim=True)

    gen = torch.Generator().manual_seed(0)
    for scale in (0.1, 1.0, 5.0, 20.0):  # flat laws take the full-sort fallback, peaked ones the top-k path
        probs = torch.softmax(torch.randn(3, 5000, generator=gen, dtype=torch.float64) * scale, -1)
        for top_p in (0.05, 0.5, 0.9, 0.999):
            torch.testing.assert_close(_nucleus(probs, top_p), reference(probs, top_p), rtol=0, atol=0)
