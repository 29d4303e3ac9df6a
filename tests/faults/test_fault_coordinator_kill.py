"""A coordinator dies mid-stream: another replica resumes the session within a few seconds, and
the finished session is the uncut stream's."""

from __future__ import annotations

import signal
import time

import grpc
import pytest

from coordinator.settings import CoordinatorSettings
from faults import fault_harness as harness
from specdec.client import reassembled
from specdec.v1 import coordinator_pb2

PROMPT = [3, 1, 4, 1, 5]
# A fixed K and a seed at T = 1: a resumed stream gives the uncut stream's very tokens.
LONG = {"max_new_tokens": 55, "num_speculative_tokens": 1, "seed": 23, "temperature": 1.0, "ignore_eos": True}
KEYS, PREFIX = harness.KEYS, harness.SHARED_PREFIX
LOCK_TTL_S = float(harness.COORDINATOR_ENV["SESSION_LOCK_TTL_S"])
ROUND_SLACK_S = 1.0  # a round of the tiny pair on two busy cores, with room


@pytest.fixture(scope="module")
def doomed(shared_settings, shared_coordinator, fault_dir):
    """A second replica of the shared coordinator (same Redis, prefix and keys): the one killed."""
    service = harness.coordinator(fault_dir, name="coordinator-killed", **shared_settings)
    with harness.running(service):
        yield service


def _cut_stream(
    coordinator: harness.Service, key: str, redis_url: str, arrivals: list[float]
) -> tuple[list[int], str, float, grpc.StatusCode]:
    """(tokens received, session id, when it was killed, the stream's status) of a stream whose
    coordinator is SIGKILLed once it has stored a few tokens more than the client has read: chunks
    in flight, which may or may not arrive. `arrivals` gets each received token's arrival time."""
    received, session_id, killed_at = [], "", None
    with harness.client(coordinator, api_key=key) as client:
        client.generate(PROMPT, max_new_tokens=2)  # warm: pool info known
        try:
            for chunk in client.stream(PROMPT, **LONG):
                received += chunk.token_ids
                arrivals += [time.monotonic()] * len(chunk.token_ids)
                session_id = chunk.session_id
                if killed_at is None:
                    harness.wait_stored(redis_url, PREFIX, session_id, at_least=len(PROMPT + received) + 3)
                    coordinator.kill()
                    killed_at = time.monotonic()
        except grpc.RpcError as exc:
            return received, session_id, killed_at, exc.code()
    return received, session_id, killed_at, grpc.StatusCode.OK


def _resume(client, session_id: str, received: list[int]) -> tuple[list[int], int, coordinator_pb2.GenerateChunk]:
    """Resume on a live replica, retried while it answers ABORTED (the dead one's lease has not
    lapsed): (the tokens the client holds then, attempts, last chunk)."""
    for attempt in range(1, 200):
        try:
            chunks = list(client.resume(session_id, received_tokens=len(received)))
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.ABORTED:
                raise
            time.sleep(0.1)
            continue
        return reassembled(received, chunks), attempt, chunks[-1]
    raise AssertionError("the session stayed busy")


def test_another_coordinator_resumes_a_stream_whose_coordinator_was_killed(doomed, shared_coordinator, redis_url):
    """Fault: SIGKILL of the coordinator serving a stream, as soon as its session is stored.
    Expect: the client's stream fails (UNAVAILABLE); what Redis holds and what the client received
    agree (chunks gRPC had sent can die on the wire with the process, so Redis may hold more; the
    client more by at most the rounds sent in the last SESSION_SAVE_INTERVAL_S, saved behind the
    stream); the other replica resumes the session
    (GenerateRequest.resume with received_tokens, retried while ABORTED) within about one lease
    (SESSION_LOCK_TTL_S = 3); afterwards the client holds, and Redis stores, exactly the uncut
    stream's tokens (same seed, fixed K), and nothing is left to resume."""
    key = KEYS["tenant-a"]
    with harness.client(shared_coordinator, api_key=key) as live:
        reference = [t for c in live.stream(PROMPT, **LONG) for t in c.token_ids]
        arrivals: list[float] = []
        received, session_id, killed_at, code = _cut_stream(doomed, key, redis_url, arrivals)
        assert code == grpc.StatusCode.UNAVAILABLE, code
        assert session_id and 0 < len(received) < LONG["max_new_tokens"], "the kill did not land mid-stream"
        at_kill = harness.stored_tokens(redis_url, PREFIX, session_id)
        left = live.get_session(session_id).resumable_tokens
        held, attempts, last = _resume(live, session_id, received)
        resumed_s = time.monotonic() - killed_at
        session = live.get_session(session_id)
    unsaved = len(PROMPT) + len(received) - len(at_kill)
    print(
        f"coordinator killed after {len(received)} of {LONG['max_new_tokens']} tokens were received "
        f"({max(0, unsaved)} received but not yet stored, {max(0, -unsaved)} stored but lost on the wire); "
        f"resumed {resumed_s:.2f} s after the kill (lease {LOCK_TTL_S:.0f} s, {attempts} attempts)"
    )
    shorter = min(len(at_kill), len(PROMPT) + len(received))
    assert at_kill[:shorter] == (PROMPT + received)[:shorter], "Redis and the client disagree"
    # Saved behind the stream: every token that reached the client an interval (and a slow round's
    # slack) before the kill was stored.
    due = killed_at - CoordinatorSettings.session_save_interval_s - ROUND_SLACK_S
    assert len(at_kill) >= len(PROMPT) + sum(t < due for t in arrivals), "rounds older than the interval were lost"
    assert left == LONG["max_new_tokens"] - (len(at_kill) - len(PROMPT))
    assert last.done and last.stats.generated_tokens == left
    assert resumed_s < LOCK_TTL_S + 3
    assert held == reference, "the client's resumed stream is not the uncut stream"
    stored = harness.stored_tokens(redis_url, PREFIX, session_id)
    assert stored == list(session.token_ids) == PROMPT + reference, "the resumed session is not the uncut stream"
    assert session.resumable_tokens == 0


def test_sigterm_drains_a_running_stream_to_its_end(shared_settings, fault_dir, redis_url):
    """Fault: SIGTERM (a rolling update) to the coordinator serving a stream.
    Expect: it stops taking new calls but lets the stream run to its end within GRACE_S, stores
    all of it, releases the session, and exits 0."""
    service = harness.coordinator(fault_dir, name="coordinator-drained", GRACE_S="30", **shared_settings)
    key = KEYS["tenant-a"]
    with harness.running(service), harness.client(service, api_key=key) as client:
        client.generate(PROMPT, max_new_tokens=2)  # warm: pool info known
        received, session_id, last, sent_at, at_signal = [], "", None, None, 0
        for chunk in client.stream(PROMPT, **LONG):
            received += chunk.token_ids
            session_id, last = chunk.session_id, chunk
            if sent_at is None:
                harness.wait_stored(redis_url, PREFIX, session_id)
                service.send(signal.SIGTERM)
                sent_at, at_signal = time.monotonic(), len(received)
        drained_s = time.monotonic() - sent_at
        assert service.proc.wait(30) == 0
    print(f"SIGTERM after {at_signal} tokens: the stream ran {drained_s:.2f} s more to its {len(received)}; exit 0")
    assert last.done and len(received) == LONG["max_new_tokens"]
    assert harness.stored_tokens(redis_url, PREFIX, session_id) == PROMPT + received
