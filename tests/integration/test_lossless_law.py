"""Sequence-level losslessness through the REAL services (three gRPC servers + Redis).

Pipeline samples of the next 3 tokens are tested against the target's exact law,
enumerated from the target model alone. Draft and target are different tiny
random models that disagree on purpose (alpha ~0.4), so rejections and the
residual path happen often; each case reports its rejection count.
Chi-square at significance 0.001 with fixed seeds, so the outcome is deterministic.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest
from law import chi_square_fit, exact_sequence_law, fit_to_law, sample_counts, samples_to_detect

from specdec.client import build_request
from specdec.core.sampling import Sampling

SIGNIFICANCE = 0.001
PROMPT = [3, 1, 4]
LENGTH = 3

CASES = [
    # (id, K, sampling, samples, max_new_tokens)
    ("K3-T1", 3, Sampling(1.0), 20_000, LENGTH),
    ("K1-T1", 1, Sampling(1.0), 14_000, LENGTH),
    # K = 8 needs 9 new tokens for a full round; the first 3 are a marginal of that law.
    ("K8-T1", 8, Sampling(1.0), 14_000, 9),
    ("K3-T0.7-topk4", 3, Sampling(0.7, top_k=4), 14_000, LENGTH),
    ("K3-topp0.9", 3, Sampling(1.0, top_p=0.9), 14_000, LENGTH),
]


@pytest.mark.parametrize("case_id, k, sampling, total, max_new_tokens", CASES, ids=[c[0] for c in CASES])
def test_pipeline_samples_follow_target_law(
    coordinator_stub, tiny_loaded, case_id, k, sampling, total, max_new_tokens, record_property
):
    law = exact_sequence_law(tiny_loaded["target"].runner.model, PROMPT, LENGTH, sampling)
    assert law.sum() == pytest.approx(1.0, abs=1e-9)
    counts, drafted, accepted, recovered = sample_counts(
        coordinator_stub, PROMPT, LENGTH, k, sampling, total, max_new_tokens, seed=zlib.crc32(case_id.encode()) % 997
    )
    fit = fit_to_law(case_id, counts, law, SIGNIFICANCE, drafted, accepted, recovered)
    record_property("summary", fit.summary)
    # The experiment must be able to see what it claims to rule out.
    assert total >= fit.needed, fit.summary
    # The pair must disagree, or the residual path is never exercised.
    assert 0.2 <= fit.acceptance <= 0.7, fit.summary
    assert recovered > total * 0.1, fit.summary
    assert fit.p_value > SIGNIFICANCE, fit.summary


def test_single_sequence_path_with_kv_cache_follows_target_law(coordinator_stub, tiny_loaded, record_property):
    """The path real users take: one sample per request (per-session KV caches, rollbacks,
    Redis session writes), from concurrent clients. Fewer samples than the batched cases,
    so it claims less: the detectable total-variation distance is computed and reported."""
    _single_sequence_law(coordinator_stub, tiny_loaded, PROMPT, "single-sequence K3-T1", record_property)


def test_sessions_reading_a_shared_prefix_follow_target_law(
    coordinator_stub, tiny_loaded, record_property, monkeypatch
):
    """Every request a new session under one 20-token prompt: both services start each from a
    cached session's keys/values, here stored once and read through cascade attention
    (MIN_STORED_ONCE lowered to 16: the tiny models hold 64 positions)."""
    from specdec.models import runner

    monkeypatch.setattr(runner, "MIN_STORED_ONCE", 16)
    prompt = [(3 * i + 1) % 8 for i in range(20)]
    _single_sequence_law(coordinator_stub, tiny_loaded, prompt, "shared-prefix K3-T1", record_property)
    target = tiny_loaded["target"].runner
    assert target.cache.hits > 1_000 and target.cache.total_tokens < 20 * len(target.cache)  # read, not copied


def _single_sequence_law(stub, tiny_loaded, prompt: list[int], label: str, record_property) -> None:
    from concurrent.futures import ThreadPoolExecutor

    total = 4_000
    sampling = Sampling(1.0)
    law = exact_sequence_law(tiny_loaded["target"].runner.model, prompt, LENGTH, sampling)

    def one(i: int):
        request = build_request(
            prompt, max_new_tokens=LENGTH, seed=10_000 + i, num_speculative_tokens=3, ignore_eos=True
        )
        response = stub.Generate(request, timeout=120)
        return tuple(response.completions[0].token_ids), response.stats.recovered_tokens

    counts = np.zeros((8,) * LENGTH)
    rejections = 0
    with ThreadPoolExecutor(max_workers=4) as pool:
        for tokens, recovered in pool.map(one, range(total)):
            counts[tokens] += 1
            rejections += recovered
    statistic, p_value, bins = chi_square_fit(counts, law)
    detectable = next(
        tv for tv in np.arange(0.05, 0.3, 0.005) if samples_to_detect(tv, bins, SIGNIFICANCE, 0.9) <= total
    )
    summary = f"{label}: n={total} bins={bins} chi2={statistic:.1f} p={p_value:.4f} rejections={rejections} detects TV>={detectable:.3f}"
    print(summary)
    record_property("summary", summary)
    assert rejections > total * 0.3, summary
    assert detectable <= 0.1, summary
    assert p_value > SIGNIFICANCE, summary


def test_auto_k_samples_follow_target_law(coordinator_stub, tiny_loaded, record_property):
    """Requests that leave K unset under the coordinator's default "auto": K changes between rounds.

    The policy's first rounds are fixed (round 0 drafts its start K = 2, round 1 drafts nothing to
    measure a 1-row Verify), and with 3 new tokens any third round has no room to draft, so the
    run is the same whatever the timings: drafted == 2 * n exactly shows that the samples rejected
    in round 0 (which had room for another draft) ran a K = 0 round after a K = 2 one.
    """
    total, sampling = 14_000, Sampling(1.0)
    law = exact_sequence_law(tiny_loaded["target"].runner.model, PROMPT, LENGTH, sampling)
    counts, drafted, accepted, recovered = sample_counts(
        coordinator_stub, PROMPT, LENGTH, None, sampling, total, LENGTH, seed=zlib.crc32(b"auto-T1") % 997
    )
    fit = fit_to_law("auto-K-T1", counts, law, SIGNIFICANCE, drafted, accepted, recovered)
    record_property("summary", fit.summary)
    assert total >= fit.needed, fit.summary
    assert drafted == 2 * total, fit.summary  # K = 2 in round 0, K = 0 after it
    assert recovered > total * 0.3, fit.summary  # many samples had room to draft again, and did not
    assert fit.p_value > SIGNIFICANCE, fit.summary


def test_k0_decode_steps_follow_target_law(tiny_stack, coordinator_stub, tiny_loaded, record_property):
    """K = 0 through the services, where the target samples the rounds after the first itself
    (DECODE_STEPS, 4 by default: here rounds 1 and 2 in one call) from the coordinator's uniforms.

    Power as the batched law tests': ~270 bins with expected counts >= 5 at n = 14000, a law at
    total-variation distance 0.05 rejected with probability >= 0.9 from n = 11830 on (asserted as
    total >= needed)."""
    total, sampling = 14_000, Sampling(1.0)
    registry = tiny_stack.servers[0].registry
    calls_before = registry.value("specdec_verify_calls_total")
    law = exact_sequence_law(tiny_loaded["target"].runner.model, PROMPT, LENGTH, sampling)
    counts, drafted, accepted, recovered = sample_counts(
        coordinator_stub, PROMPT, LENGTH, 0, sampling, total, LENGTH, seed=zlib.crc32(b"K0-steps") % 997
    )
    fit = fit_to_law("K0-decode-steps", counts, law, SIGNIFICANCE, drafted, accepted, recovered)
    record_property("summary", fit.summary)
    requests = -(-total // 4096)
    assert registry.value("specdec_verify_calls_total") - calls_before == 2 * requests  # not 3: steps ran
    assert total >= fit.needed, fit.summary
    assert fit.p_value > SIGNIFICANCE, fit.summary
