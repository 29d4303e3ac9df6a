"""Iteration-level batching through the real services: concurrent calls share steps of the model
(`specdec.models.scheduler`) and compute what they compute alone.

Draft and target are the tiny random models of conftest (draft and target disagree, alpha ~0.4).
"""

from __future__ import annotations

import dataclasses
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
from law import exact_sequence_law, fit_to_law, sample_counts
from service_stack import start_stack, stop_stack

from specdec.core.sampling import Sampling
from specdec.models.scheduler import scheduler_for
from specdec.rpc.wire import decode_probs
from specdec.v1 import coordinator_pb2_grpc, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc

SIGNIFICANCE = 0.001
PROMPT = [3, 1, 4]
LENGTH = 3
PREFIXES = [[3, 1, 4], [2, 7], [5, 5, 5, 1, 2, 6], [1], [6, 2, 3, 4], [7, 7, 1]]


def _hold(runner, seconds: float) -> threading.Thread:
    """Occupy the model's thread for `seconds`: calls made meanwhile queue."""
    thread = threading.Thread(target=runner.on_model_thread, args=(time.sleep, seconds))
    thread.start()
    time.sleep(0.05)
    return thread


def _hold_until_queued(runner, calls: int, timeout_s: float = 20.0) -> threading.Thread:
    """Occupy the model's thread until `calls` sequences have queued (not a fixed time: on a busy
    machine six calls took longer than 0.45 s to arrive), so that they share a step."""

    def hold() -> None:
        until = time.monotonic() + timeout_s
        while scheduler_for(runner).queued < calls and time.monotonic() < until:
            time.sleep(0.005)

    thread = threading.Thread(target=runner.on_model_thread, args=(hold,))
    thread.start()
    time.sleep(0.05)
    return thread


def _propose(stub, key: str, prefix: list[int], seed: int):
    sequence = draft_pb2.DraftSequence(cache_key=key, prefix_token_ids=prefix, num_draft_tokens=3, seed=seed)
    (proposal,) = stub.Propose(draft_pb2.ProposeRequest(sequences=[sequence]), timeout=60).proposals
    return list(proposal.draft_token_ids), np.array(decode_probs(proposal.draft_probs))


def _verify(stub, key: str, prefix: list[int], drafts: list[int]):
    sequence = target_pb2.VerifySequence(cache_key=key, prefix_token_ids=prefix, draft_token_ids=drafts)
    (result,) = stub.Verify(target_pb2.VerifyRequest(sequences=[sequence]), timeout=60).verifications
    return np.array(decode_probs(result.target_probs))


def _rounds(draft, target, key: str, prefix: list[int], seed: int) -> list:
    """Two rounds of one session: propose and verify, then a rollback (one drafted token kept,
    another token after it) that both caches must crop."""
    tokens, q = _propose(draft, key, prefix, seed)
    p = _verify(target, key, prefix, tokens)
    longer = prefix + tokens[:1] + [(tokens[1] + 1) % 8]
    tokens2, q2 = _propose(draft, key, longer, seed + 1)
    p2 = _verify(target, key, longer, tokens2)
    return [tokens, q, p, tokens2, q2, p2]


def test_concurrent_calls_share_steps_and_equal_serial_ones(tiny_stack, tiny_loaded):
    runners = [tiny_loaded["draft"].runner, tiny_loaded["target"].runner]
    shared_before = [scheduler_for(r).stats.shared for r in runners]
    with (
        grpc.insecure_channel(tiny_stack.draft_address) as d,
        grpc.insecure_channel(tiny_stack.target_address) as t,
    ):
        draft, target = draft_pb2_grpc.DraftServiceStub(d), target_pb2_grpc.TargetServiceStub(t)
        serial = [_rounds(draft, target, f"serial-{i}", p, 100 + i) for i, p in enumerate(PREFIXES)]
        holds = [_hold_until_queued(r, len(PREFIXES)) for r in runners]
        with ThreadPoolExecutor(len(PREFIXES)) as pool:
            batched = list(
                pool.map(lambda a: _rounds(draft, target, f"batched-{a[0]}", a[1], 100 + a[0]), enumerate(PREFIXES))
            )
        for hold in holds:
            hold.join()
    for alone, together in zip(serial, batched, strict=True):
        assert alone[0] == together[0] and alone[3] == together[3]  # seeded drafts: the same tokens
        for a, b in zip(alone[1:3] + alone[4:], together[1:3] + together[4:], strict=True):
            np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-6)  # laws within float noise
    for runner, before in zip(runners, shared_before, strict=True):
        stats = scheduler_for(runner).stats
        assert stats.shared > before, stats
        assert max(stats.sizes) >= len(PREFIXES), stats  # the held-back first calls: one step
    metrics = tiny_stack.servers[2].registry.render()
    assert 'specdec_shared_steps_total{service="target"}' in metrics


def test_a_full_scheduler_queue_is_at_capacity_for_the_caller(tiny_stack, tiny_loaded):
    from specdec.rpc.errors import REASON_KEY
    from specdec.rpc.metrics import AT_CAPACITY

    runner = tiny_loaded["target"].runner
    scheduler = scheduler_for(runner)
    limits = scheduler.limits
    scheduler.configure(dataclasses.replace(limits, max_queued_sequences=2))
    try:
        with grpc.insecure_channel(tiny_stack.target_address) as t:
            target = target_pb2_grpc.TargetServiceStub(t)
            hold = _hold(runner, 0.5)
            first = target.Verify.future(
                target_pb2.VerifyRequest(
                    sequences=[target_pb2.VerifySequence(prefix_token_ids=[1, 2]) for _ in range(2)]
                ),
                timeout=30,
            )
            time.sleep(0.1)
            with pytest.raises(grpc.RpcError) as err:
                target.Verify(
                    target_pb2.VerifyRequest(sequences=[target_pb2.VerifySequence(prefix_token_ids=[3])]), timeout=30
                )
            hold.join()
            assert len(first.result().verifications) == 2
    finally:
        scheduler.configure(limits)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert (REASON_KEY, AT_CAPACITY) in tuple(err.value.trailing_metadata())


@pytest.fixture(scope="module")
def merging_stack(tiny_loaded, tiny_model_dirs, redis_url):
    """A stack whose coordinator waits up to 200 ms for the other requests' Verify calls: at the
    default 4 ms whether two clients' 500-sequence rounds meet is chance (one run merged none of 84)."""
    stack = start_stack(tiny_loaded, tiny_model_dirs["target"], redis_url, verify_batch_wait_ms=200)
    channel = stack.channel()
    yield stack, coordinator_pb2_grpc.CoordinatorStub(channel)
    channel.close()
    stop_stack(stack)


@pytest.mark.parametrize("k", [1, 3])
def test_concurrent_streams_batched_together_follow_target_law(merging_stack, tiny_loaded, k, record_property):
    """Four clients at once, each a series of num_samples requests: their Propose calls share the
    draft's steps, the coordinator sends several requests' Verify calls to the target as one
    (`call_batching`; both asserted; calls it sent apart may share the target's steps too), and the
    first 3 tokens of all 14000 samples are chi-squared against the target's exact law at
    significance 0.001.

    Power: at n = 14000 this law has ~270 bins with expected counts >= 5 (the rest pooled); a law
    at total-variation distance 0.05 from it has chi-square divergence >= 4 * 0.05^2 = 0.01, so
    noncentrality >= 140, and the test rejects it with probability >= 0.9 from n = 11830 on
    (`law.samples_to_detect`, asserted below as total >= needed).
    """
    stack, coordinator_stub = merging_stack
    total, clients, sampling = 14_000, 4, Sampling(1.0)
    draft, target = tiny_loaded["draft"].runner, tiny_loaded["target"].runner
    shared_before = scheduler_for(draft).stats.shared
    registry = stack.servers[0].registry
    verify_before = [registry.value(f"specdec_verify_{n}_total") for n in ("calls", "batches")]
    seed = zlib.crc32(f"batched-K{k}".encode()) % 997

    def client(i: int):
        return sample_counts(
            coordinator_stub, PROMPT, LENGTH, k, sampling, total // clients, LENGTH, seed * 10 + i, chunk=500
        )

    with ThreadPoolExecutor(clients) as pool:
        parts = list(pool.map(client, range(clients)))
    counts = sum(p[0] for p in parts)
    drafted, accepted, recovered = (sum(p[j] for p in parts) for j in (1, 2, 3))
    law = exact_sequence_law(target.model, PROMPT, LENGTH, sampling)
    fit = fit_to_law(f"batched-K{k}", counts, law, SIGNIFICANCE, drafted, accepted, recovered)
    record_property("summary", fit.summary)
    assert scheduler_for(draft).stats.shared > shared_before  # several clients' Proposes ran in one step
    names = ("calls", "batches")
    after = [registry.value(f"specdec_verify_{n}_total") for n in names]
    calls, batches = (a - b for a, b in zip(after, verify_before, strict=True))
    assert batches < calls, (calls, batches)  # several requests' rounds went as one Verify call
    assert total >= fit.needed, fit.summary
    assert recovered > total * 0.1, fit.summary
    assert fit.p_value > SIGNIFICANCE, fit.summary
