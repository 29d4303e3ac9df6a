"""Exact laws of the tiny target, and a chi-square goodness-of-fit helper with a stated power."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch
from scipy import stats

from specdec.core.sampling import Sampling, normalize
from specdec.models.warping import to_wire, warp_logits


@torch.inference_mode()
def exact_sequence_law(model, prompt: list[int], length: int, sampling: Sampling) -> np.ndarray:
    """law[x1, ..., x_length] = prod_i p(x_i | prompt, x_<i) under the target alone, for every sequence.

    Computed with plain full forwards (no cache, no padding) and the project's warping,
    as the float32 wire law the target service sends, normalised as the coordinator does.
    """
    vocab = model.config.vocab_size
    prefixes: list[tuple[int, ...]] = [()]
    law = np.ones(1)
    for _ in range(length):
        batch = torch.tensor([prompt + list(prefix) for prefix in prefixes])
        logits = model(input_ids=batch).logits[:, -1, :]
        step = normalize(to_wire(warp_logits(logits, sampling)))  # [len(prefixes), V]
        law = (law[:, None] * step).reshape(-1)
        prefixes = [prefix + (token,) for prefix in prefixes for token in range(vocab)]
    return law.reshape((vocab,) * length)


def chi_square_fit(counts: np.ndarray, law: np.ndarray, min_expected: float = 5.0):
    """Pearson chi-square of observed counts against an exact law.

    Cells with expected count < min_expected are pooled into one bin (into the
    smallest kept cell if the pool itself is too small). Returns (statistic,
    p_value, number of bins).
    """
    counts = counts.reshape(-1).astype(float)
    law = law.reshape(-1)
    n = counts.sum()
    expected = n * law
    keep = expected >= min_expected
    obs_bins = list(counts[keep])
    exp_bins = list(expected[keep])
    pooled_obs, pooled_exp = counts[~keep].sum(), expected[~keep].sum()
    if pooled_exp >= min_expected:
        obs_bins.append(pooled_obs)
        exp_bins.append(pooled_exp)
    elif pooled_exp > 0 or pooled_obs > 0:
        smallest = int(np.argmin(exp_bins))
        obs_bins[smallest] += pooled_obs
        exp_bins[smallest] += pooled_exp
    statistic, p_value = stats.chisquare(obs_bins, exp_bins)
    return float(statistic), float(p_value), len(obs_bins)


def samples_to_detect(tv: float, bins: int, significance: float, power: float) -> int:
    """Samples at which the chi-square test rejects a law at total-variation distance `tv`
    (on the binned space) with probability >= `power`.

    Any such law has chi-square divergence >= 4 tv^2 (Cauchy-Schwarz), so the
    statistic's noncentrality is at least n * 4 tv^2.
    """
    df = bins - 1
    critical = stats.chi2.ppf(1 - significance, df)
    low, high = 1, 10_000_000
    while low < high:
        mid = (low + high) // 2
        if stats.ncx2.sf(critical, df, mid * 4 * tv * tv) >= power:
            high = mid
        else:
            low = mid + 1
    return low


@dataclass(frozen=True)
class LawFit:
    """A chi-square fit of pipeline samples to the exact law, with its one-line summary."""

    p_value: float
    needed: int  # samples needed to detect TV 0.05 at power 0.9
    acceptance: float  # alpha-hat: accepted / examined positions (drafts after a rejection are never examined)
    summary: str


def fit_to_law(
    name: str, counts: np.ndarray, law: np.ndarray, significance: float, drafted: int, accepted: int, recovered: int
) -> LawFit:
    statistic, p_value, bins = chi_square_fit(counts, law)
    needed = samples_to_detect(tv=0.05, bins=bins, significance=significance, power=0.9)
    total = int(counts.sum())
    acceptance = accepted / max(1, accepted + recovered)
    summary = (
        f"{name}: n={total} bins={bins} chi2={statistic:.1f} p={p_value:.4f} "
        f"drafted={drafted} accepted={accepted} rejections={recovered} alpha-hat={acceptance:.3f} "
        f"(n for TV 0.05 at power 0.9: {needed})"
    )
    print(summary)
    return LawFit(p_value, needed, acceptance, summary)


def all_sequences(vocab: int, length: int):
    return itertools.product(range(vocab), repeat=length)


def sample_counts(
    stub,
    prompt: list[int],
    length: int,
    k: int | None,
    sampling: Sampling,
    total: int,
    max_new_tokens: int,
    seed: int,
    vocab: int = 8,
    chunk: int = 4096,
):
    """`total` pipeline samples (num_samples requests of `chunk`) -> counts of their first `length`
    tokens ([vocab] * length), and the drafted / accepted / recovered totals the stats report.
    k None leaves num_speculative_tokens unset: the coordinator's default K (auto by default)."""
    from specdec.client import build_request

    counts = np.zeros((vocab,) * length)
    drafted = accepted = recovered = done = call = 0
    while done < total:
        n = min(chunk, total - done)
        request = build_request(
            prompt,
            max_new_tokens=max_new_tokens,
            temperature=sampling.temperature,
            top_k=sampling.top_k,
            top_p=sampling.top_p,
            seed=seed * 1000 + call,
            num_speculative_tokens=k,
            ignore_eos=True,
            num_samples=n,
        )
        response = stub.Generate(request, timeout=600)
        for completion in response.completions:
            counts[tuple(completion.token_ids[:length])] += 1
        drafted += response.stats.drafted_tokens
        accepted += response.stats.accepted_tokens
        recovered += response.stats.recovered_tokens
        done += n
        call += 1
    return counts, drafted, accepted, recovered


T1 = Sampling(1.0)


def assert_draft_follows_law(
    stub,
    model,
    name: str,
    prompt: list[int],
    length: int,
    k: int | None,
    seed: int,
    total: int = 14_000,
    significance: float = 0.001,
    sampling: Sampling = T1,
) -> LawFit:
    """The pipeline's first `length` tokens against the target's exact law (chi-square at
    `significance`, enough samples to see a TV of 0.05 at power 0.9), for a draft that must have
    proposed tokens, some accepted and more than a tenth of the samples rejected: a law test in
    which no proposal is examined would pass for any drafter. k None: the coordinator's default K."""
    law = exact_sequence_law(model, prompt, length, sampling)
    counts, drafted, accepted, recovered = sample_counts(
        stub, prompt, length, k, sampling, total, max_new_tokens=length, seed=seed
    )
    fit = fit_to_law(name, counts, law, significance, drafted, accepted, recovered)
    assert total >= fit.needed, fit.summary  # the experiment can see what it rules out
    assert drafted > 0 and accepted > 0 and recovered > total * 0.1, fit.summary
    assert fit.p_value > significance, fit.summary
    return fit


def assert_greedy_speculation_equals_k0(stub, k: int = 4, max_new_tokens: int = 40) -> None:
    """At T = 0 a Verify's rows must give what one-token decodes give for speculation to emit the
    target alone's tokens; the draft must have proposed some (else nothing was compared)."""
    from specdec.client import build_request

    prompt = [(3 * i + 1) % 8 for i in range(12)]
    greedy = dict(max_new_tokens=max_new_tokens, temperature=0, ignore_eos=True)
    runs = {n: stub.Generate(build_request(prompt, num_speculative_tokens=n, **greedy), timeout=120) for n in (0, k)}
    assert list(runs[k].completions[0].token_ids) == list(runs[0].completions[0].token_ids)
    assert runs[k].stats.drafted_tokens > 0
