"""The draft pool dies: streams finish at K = 0 (still the target's law), and speculation returns
when the draft is back. The law of the K = 0 fallback path is tested where it is built
(tests/unit/core/test_engine.py: a failing drafter gives exactly the K = 0 output, T = 0 and
seeded T = 1); here it is the real processes and what Redis holds."""

from __future__ import annotations

import itertools
import time

import pytest

from faults import fault_harness as harness
from specdec.v1 import coordinator_pb2

PREFIX = "specdec:faults-draft"
PROMPT = [3, 1, 4, 1, 5]
# K = 1 at T = 1 for 55 tokens: ~40 rounds, so the kill after the first chunk lands mid-stream.
LONG = {"max_new_tokens": 55, "num_speculative_tokens": 1, "seed": 7, "temperature": 1.0, "ignore_eos": True}
SHORT = {"max_new_tokens": 8, "num_speculative_tokens": 2, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def stack(tiny_model_dirs, pools, redis_url, fault_dir):
    """A draft of its own (this module kills it), the shared target, a coordinator without keys."""
    draft = harness.model_service("draft", tiny_model_dirs["draft"], fault_dir, name="draft-killed")
    coordinator = harness.coordinator(
        fault_dir,
        draft.address,
        pools.target.address,
        redis_url,
        tiny_model_dirs["target"],
        name="coordinator-draft",
        SESSION_KEY_PREFIX=PREFIX,
    )
    with harness.running(draft, coordinator):
        yield draft, coordinator


def test_draft_killed_mid_stream_the_stream_completes_at_k0(stack, redis_url):
    """Fault: SIGKILL of the only draft process right after a stream's first chunk.
    Expect: the stream completes (all 55 tokens, finish LENGTH) with its later rounds at K = 0
    (stats.draft_fallback_rounds > 0), and Redis holds exactly the prompt and the tokens received."""
    draft, coordinator = stack
    if not draft.running:
        draft.restart()
    with harness.client(coordinator) as client:
        warm = client.generate(PROMPT, **SHORT)  # the draft's Info is known and it is healthy
        assert warm.completions[0].token_ids and warm.stats.drafted_tokens > 0
        chunks, arrivals, killed_at = [], [], None
        for chunk in client.stream(PROMPT, **LONG):
            chunks.append(chunk)
            arrivals.append(time.monotonic())
            if killed_at is None:
                draft.kill()
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


def test_speculation_returns_once_the_draft_is_back(stack):
    """Fault: the draft process is down, then started again on the same port.
    Expect: meanwhile every request succeeds at K = 0 (every round a fallback round); once the
    draft serves again, requests speculate again within the back-off (DRAFT_BACKOFF_S = 2) plus
    gRPC's reconnection back-off."""
    draft, coordinator = stack
    draft.kill()
    with harness.client(coordinator) as client:
        for _ in range(3):
            down = client.generate(PROMPT, **SHORT)
            assert down.stats.drafted_tokens == 0
            # Every round but a last one with a single token left (K = 0 anyway) is a fallback.
            assert down.stats.draft_fallback_rounds >= down.stats.rounds - 1 > 0
        startup_s = draft.restart()
        serving_at = time.monotonic()
        attempts, stats = 0, None
        while time.monotonic() - serving_at < 90:
            attempts += 1
            stats = client.generate(PROMPT, **SHORT).stats
            if stats.drafted_tokens > 0 and stats.draft_fallback_rounds == 0:
                break
            time.sleep(0.25)
        recovered_s = time.monotonic() - serving_at
    print(
        f"draft restart took {startup_s:.1f} s to serve; speculation back {recovered_s:.2f} s after it served "
        f"({attempts} requests, all succeeded)"
    )
    assert stats.drafted_tokens > 0 and stats.draft_fallback_rounds == 0, "never speculated again"
