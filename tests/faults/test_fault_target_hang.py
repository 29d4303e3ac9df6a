"""One of two target replicas hangs (SIGSTOP: its sockets stay open, it answers nothing):
new requests still succeed, each after at most a few per-call timeouts."""

from __future__ import annotations

import signal
import time

import pytest

from faults import fault_harness as harness

PREFIX = "specdec:faults-target"
PROMPT = [3, 1, 4, 1, 5]
REQUEST = {"max_new_tokens": 8, "num_speculative_tokens": 2, "temperature": 1.0, "ignore_eos": True}
VERIFY_TIMEOUT_S = float(harness.COORDINATOR_ENV["VERIFY_TIMEOUT_S"])
# specdec.rpc.clients: outlier detection counts failures per interval of 2 x the call timeout; the
# interval that saw the SIGSTOP may hold too many successes, so ejection can take two.
EJECTION_INTERVAL_S = 2 * VERIFY_TIMEOUT_S


@pytest.fixture(scope="module")
def stack(tiny_model_dirs, pools, redis_url, fault_dir):
    """A second target of its own (this module stops it) next to the shared one, as a comma list."""
    second = harness.model_service("target", tiny_model_dirs["target"], fault_dir, name="target-hung")
    coordinator = harness.coordinator(
        fault_dir,
        pools.draft.address,
        f"{pools.target.address},{second.address}",
        redis_url,
        tiny_model_dirs["target"],
        name="coordinator-two-targets",
        SESSION_KEY_PREFIX=PREFIX,
    )
    with harness.running(second, coordinator):
        yield second, coordinator


def test_a_hung_target_replica_does_not_fail_new_requests(stack, redis_url):
    """Fault: SIGSTOP of one of the two target processes (SIGCONT in a finally).
    Expect: every new request succeeds and each stored session is what its client received.
    Until the hung replica is ejected (outlier detection, evaluated every 2 x VERIFY_TIMEOUT_S,
    within two intervals), a request's rounds each pay at most one timed-out attempt
    (VERIFY_TIMEOUT_S = 3) and are retried on the other replica; after that, requests run at
    their usual speed. The replica
    serves again after SIGCONT."""
    hung, coordinator = stack
    with harness.client(coordinator) as client:
        for seed in range(4):  # both replicas connected and in use
            client.generate(PROMPT, seed=seed, **REQUEST)
        hung.send(signal.SIGSTOP)
        stopped_at, latencies, ends = time.monotonic(), [], []
        try:
            for seed in range(12):
                started = time.monotonic()
                response = client.generate(PROMPT, seed=seed, **REQUEST)
                latencies.append(time.monotonic() - started)
                ends.append(time.monotonic() - stopped_at)
                tokens = list(response.completions[0].token_ids)
                assert len(tokens) == REQUEST["max_new_tokens"]
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
        after = [client.generate(PROMPT, seed=seed, **REQUEST) for seed in range(4)]
        assert all(len(r.completions[0].token_ids) == REQUEST["max_new_tokens"] for r in after)
