"""16 concurrent clients for 60 s against the process stack: no errors, and every stored history
is exactly what its client sent and received."""

from __future__ import annotations

import os
import random
import threading
import time
from dataclasses import dataclass, field

import grpc

from faults import fault_harness as harness

KEYS, PREFIX = harness.KEYS, harness.SHARED_PREFIX
STREAMS = 16
SOAK_S = float(os.environ.get("SPECDEC_SOAK_S", "60"))
# The tiny models have 64 positions: a session is continued while its next turn fits in these.
MAX_CONTEXT = 60


@dataclass
class Client:
    """One soak client: its sessions' expected histories (prompt + tokens received, per turn)."""

    index: int
    key: str
    histories: dict[str, list[int]] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    tokens: int = 0
    streams: int = 0
    continues: int = 0
    drafted: int = 0
    accepted: int = 0
    fallback_rounds: int = 0


def _params(rng: random.Random) -> dict:
    """Mixed sampling: greedy and sampled, top-k / top-p, auto K mostly, sometimes a stop string."""
    params = {
        "max_new_tokens": rng.randint(4, 20),
        "temperature": rng.choice([0.0, 0.7, 1.0, 1.0]),
        "top_k": rng.choice([0, 0, 3]),
        "top_p": rng.choice([1.0, 1.0, 0.9]),
        "ignore_eos": rng.random() < 0.5,
    }
    if rng.random() < 0.7:
        params["seed"] = rng.randrange(1 << 32)
    if rng.random() < 0.25:
        params["num_speculative_tokens"] = rng.choice([0, 2, 4])
    if rng.random() < 0.15:
        params["stop"] = ["g"]
    return params


def _turn(client, state: Client, rng: random.Random, session_id: str) -> str:
    """One request (a new session or a continued one); returns the session to continue next."""
    params = _params(rng)
    history = state.histories.get(session_id, [])
    prompt = [rng.randint(1, 7) for _ in range(rng.randint(1, 3) if history else rng.randint(2, 6))]
    if history and len(history) + len(prompt) + params["max_new_tokens"] <= MAX_CONTEXT:
        params["session_id"] = session_id
        state.continues += 1
    else:
        history = []
    if rng.random() < 0.75:
        chunks = list(client.stream(prompt, **params))
        session_id, stats = chunks[-1].session_id, chunks[-1].stats
        tokens = [t for c in chunks for t in c.token_ids]
        state.streams += 1
    else:
        response = client.generate(prompt, **params)
        session_id, stats = response.session_id, response.stats
        tokens = list(response.completions[0].token_ids)
    state.histories[session_id] = history + prompt + tokens
    state.tokens += len(tokens)
    state.drafted += stats.drafted_tokens
    state.accepted += stats.accepted_tokens
    state.fallback_rounds += stats.draft_fallback_rounds
    return session_id


def _run(coordinator: harness.Service, state: Client, until: float) -> None:
    rng = random.Random(state.index)
    session_id = ""
    with harness.client(coordinator, api_key=state.key) as client:
        while time.monotonic() < until:
            started = time.monotonic()
            try:
                session_id = _turn(client, state, rng, session_id)
            except grpc.RpcError as exc:
                state.errors.append(f"{exc.code()}: {exc.details()}")
                session_id = ""
            state.latencies.append(time.monotonic() - started)


def test_sixteen_streams_for_a_minute_keep_every_history_exact(shared_coordinator, pools, redis_url):
    """Fault: load: 16 clients (two tenants) for 60 s, each running streamed and unary requests
    back to back, greedy and sampled, auto K and fixed K, some with stop strings, continuing
    their sessions while they fit the tiny models' context.
    Expect: no error at all; every session's stored history (in Redis and through GetSession)
    equals its prompts plus the tokens its client received, turn by turn; all processes up."""
    states = [Client(i, KEYS["tenant-a" if i % 2 else "tenant-b"]) for i in range(STREAMS)]
    started = time.monotonic()
    threads = [threading.Thread(target=_run, args=(shared_coordinator, s, started + SOAK_S)) for s in states]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.monotonic() - started
    errors = [e for s in states for e in s.errors]
    mismatched = []
    for state in states:
        with harness.client(shared_coordinator, api_key=state.key) as client:
            for session_id, expected in state.histories.items():
                stored = harness.stored_tokens(redis_url, PREFIX, session_id)
                if stored != expected or list(client.get_session(session_id).token_ids) != expected:
                    mismatched.append(session_id)
    latencies = sorted(x for s in states for x in s.latencies)
    requests, tokens = len(latencies), sum(s.tokens for s in states)
    drafted, accepted = sum(s.drafted for s in states), sum(s.accepted for s in states)
    print(
        f"soak: {STREAMS} clients, {elapsed:.0f} s: {requests} requests ({sum(s.streams for s in states)} streamed, "
        f"{sum(s.continues for s in states)} continued sessions), {tokens} tokens ({tokens / elapsed:.0f}/s), "
        f"{sum(len(s.histories) for s in states)} sessions; latency p50 {latencies[len(latencies) // 2]:.2f} s, "
        f"p99 {latencies[int(len(latencies) * 0.99)]:.2f} s, max {latencies[-1]:.2f} s; "
        f"acceptance {accepted / max(drafted, 1):.2f}, K=0 fallback rounds {sum(s.fallback_rounds for s in states)}; "
        f"{len(errors)} errors, {len(mismatched)} mismatched histories"
    )
    assert not errors, errors[:10]
    assert not mismatched, mismatched[:10]
    assert requests >= STREAMS and shared_coordinator.running and pools.draft.running and pools.target.running
