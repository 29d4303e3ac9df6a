"""Pool faults through one coordinator process on a draft of this module's own and two target
replicas (the shared one and one of its own, as a comma list):

- one target replica hangs (SIGSTOP): new requests still succeed;
- the draft hangs, then comes back: requests run at K = 0 meanwhile, then speculate again;
- the draft dies mid-stream (SIGKILL): the stream finishes at K = 0, Redis == what was received.

The law of the K = 0 fallback path is tested where it is built (tests/unit/core/test_engine.py:
a failing drafter gives exactly the K = 0 output, T = 0 and seeded T = 1; and
tests/integration/test_degradation.py: chi-square with a draft failing half its Proposes); here
it is the real processes, signals, and what Redis holds. The tests run in file order, the kill last.
"""

from __future__ import annotations

import itertools
import signal
import time

import pytest

from faults import fault_harness as harness
from specdec.v1 import coordinator_pb2

PREFIX = "specdec:faults-pools"
PROMPT = [3, 1, 4, 1, 5]
# K = 1 at T = 1 for 55 tokens: ~50 rounds, so a fault right after the first chunk lands mid-stream.
LONG = {"max_new_tokens": 55, "num_speculative_tokens": 1, "seed": 7, "temperature": 1.0, "ignore_eos": True}
SHORT = {"max_new_tokens": 8, "num_speculative_tokens": 2, "temperature": 1.0, "ignore_eos": True}
VERIFY_TIMEOUT_S = float(harness.COORDINATOR_ENV["VERIFY_TIMEOUT_S"])
# specdec.rpc.clients: outlier detection counts failures per interval of 2 x the call timeout; the
# interval that saw the SIGSTOP may hold too many successes, so ejection can take two.
EJECTION_INTERVAL_S = 2 * VERIFY_TIMEOUT_S


@pytest.fixture(scope="module")
def stack(tiny_model_dirs, pools, redis_url, fault_dir):
    """(draft, second target, coordinator): the draft and the second target are this module's to
    stop and kill; the coordinator has no API keys."""
    draft = harness.model_service("draft", tiny_model_dirs["draft"], fault_dir, name="draft-faulty")
    target = harness.model_service("target", tiny_model_dirs["target"], fault_dir, name="target-hung")
    coordinator = harness.coordinator(
        fault_dir,
        draft.address,
        f"{pools.target.address},{target.address}",
        redis_url,
        tiny_model_dirs["target"],
        name="coordinator-pools",
        SESSION_KEY_PREFIX=PREFIX,
    )
    with harness.running(draft, target, coordinator):
        yield draft, target, coordinator


@pytest.fixture()
def draft_up(stack):
    """The module's draft, serving (started again if a test before killed it)."""
    draft = stack[0]
    if not draft.running:
        draft.restart()
    return draft


def test_a_hung_target_replica_does_not_fail_new_requests(stack, draft_up, redis_url):
    """Fault: SIGSTOP of one of the two target processes (SIGCONT in a finally).
    Expect: every new request succeeds and each stored session is what its client received.
    Until the hung replica is ejected (outlier detection, evaluated every 2 x VERIFY_TIMEOUT_S,
    within two intervals), a request's rounds each pay at most one timed-out attempt
    (VERIFY_TIMEOUT_S = 3) and are retried on the other replica; after that, requests run at
    their usual speed. The replica serves again after SIGCONT."""
    _, hung, coordinator = stack
    with harness.client(coordinator) as client:
        for seed in range(4):  # both replicas connected and in use
            client.generate(PROMPT, seed=seed, **SHORT)
        hung.send(signal.SIGSTOP)
        stopped_at, latencies, ends = time.monotonic(), [], []
        try:
            for seed in range(12):
                started = time.monotonic()
                response = client.generate(PROMPT, seed=seed, **SHORT)
                latencies.append(time.monotonic() - started)
                ends.append(time.monotonic() - stopped_at)
                tokens = list(response.completions[0].token_ids)
                assert len(tokens) == SHORT["max_new_tokens"]
                assert harness.stored_tokens(redis_url, PREFIX, response.session_id) == PROMPT + tokens
        finally:
            hung.send(signal.SIGCONT)
        slow = [i for i, s in enumerate(latencies) if s > 1.0]
        recovered_s = ends[slow[-1]] if slow else 0.0
        print(
            f"target replica stopped: {len(latencies)} requests all succeeded; slowest {max(latencies):.2f} s "
            f"(~{max(latencies) / VERIFY_TIMEOUT_S:.1f} per-call timeouts), median "
            f"{sorted(latencies)[len(latencies) // 2]:.2f} s; requests fast again {recovered_s:.1f} s after the "
            f"SIGSTOP; latencies {[round(s, 2) for s in latencies]}"
        )
        assert max(latencies) <= 2 * EJECTION_INTERVAL_S + 2 * VERIFY_TIMEOUT_S
        assert recovered_s <= 2 * EJECTION_INTERVAL_S + 2 * VERIFY_TIMEOUT_S
        assert all(s < 1.5 for s in latencies[-6:]), "the hung replica was not ejected"
        after = [client.generate(PROMPT, seed=seed, **SHORT) for seed in range(4)]
        assert all(len(r.completions[0].token_ids) == SHORT["max_new_tokens"] for r in after)


def test_requests_run_at_k0_while_the_draft_hangs_and_speculate_again_after(stack, draft_up):
    """Fault: SIGSTOP of the only draft process, SIGCONT after a few requests.
    Expect: meanwhile every request succeeds at K = 0 (no drafted token, every round but a last
    single-token one a fallback round), the first one after paying the Propose attempts'
    deadlines (DRAFT_TIMEOUT_S = 1); once the draft answers again, requests speculate again
    within the back-off (DRAFT_BACKOFF_S = 2) and a probe."""
    _, _, coordinator = stack
    with harness.client(coordinator) as client:
        assert client.generate(PROMPT, **SHORT).stats.drafted_tokens > 0
        draft_up.send(signal.SIGSTOP)
        latencies = []
        try:
            for seed in range(4):
                started = time.monotonic()
                down = client.generate(PROMPT, seed=seed, **SHORT)
                latencies.append(time.monotonic() - started)
                assert len(down.completions[0].token_ids) == SHORT["max_new_tokens"]
                assert down.stats.drafted_tokens == 0
                assert down.stats.draft_fallback_rounds >= down.stats.rounds - 1 > 0
        finally:
            draft_up.send(signal.SIGCONT)
        continued_at, attempts = time.monotonic(), 0
        while True:
            attempts += 1
            stats = client.generate(PROMPT, **SHORT).stats
            if stats.drafted_tokens > 0 and stats.draft_fallback_rounds == 0:
                break
            assert time.monotonic() - continued_at < 30, "never speculated again"
            time.sleep(0.2)
        back_s = time.monotonic() - continued_at
    print(
        f"draft stopped: requests at K=0 took {[round(s, 2) for s in latencies]} s; speculation back "
        f"{back_s:.2f} s after SIGCONT ({attempts} requests, all succeeded)"
    )


def test_draft_killed_mid_stream_the_stream_completes_at_k0(stack, draft_up, redis_url):
    """Fault: SIGKILL of the only draft process right after a stream's first chunk.
    Expect: the stream completes (all 55 tokens, finish LENGTH) with its later rounds at K = 0
    (stats.draft_fallback_rounds > 0), and Redis holds exactly the prompt and the tokens received."""
    _, _, coordinator = stack
    with harness.client(coordinator) as client:
        warm = client.generate(PROMPT, **SHORT)  # the draft is healthy (not backing off)
        assert warm.completions[0].token_ids and warm.stats.drafted_tokens > 0
        chunks, arrivals, killed_at = [], [], None
        for chunk in client.stream(PROMPT, **LONG):
            chunks.append(chunk)
            arrivals.append(time.monotonic())
            if killed_at is None:
                draft_up.kill()
                killed_at = time.monotonic()
        session = client.get_session(chunks[0].session_id)
    final = chunks[-1]
    received = [t for c in chunks for t in c.token_ids]
    before_kill = len(chunks[0].token_ids)
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    print(
        f"draft killed after {before_kill} of {len(received)} tokens; stream done {arrivals[-1] - killed_at:.2f} s "
        f"after the kill; rounds {final.stats.rounds}, K=0 fallback rounds {final.stats.draft_fallback_rounds}, "
        f"drafted {final.stats.drafted_tokens}; longest pause between chunks {max(gaps, default=0):.2f} s"
    )
    assert final.done and final.finish_reason == coordinator_pb2.FINISH_REASON_LENGTH
    assert len(received) == LONG["max_new_tokens"] > before_kill, "the kill did not land mid-stream"
    assert final.stats.draft_fallback_rounds > 0
    assert final.stats.drafted_tokens > 0  # the first round(s) speculated
    assert harness.stored_tokens(redis_url, PREFIX, final.session_id) == PROMPT + received
    assert list(session.token_ids) == PROMPT + received and session.resumable_tokens == 0
