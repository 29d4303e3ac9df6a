"""Redis faults, on a redis-server of this module's own (AOF, fsync on every write): a crash and
restart loses no session; a FLUSHALL gives clear errors and the coordinator keeps serving."""

from __future__ import annotations

import time

import grpc
import pytest
import redis

from faults import fault_harness as harness
from specdec.v1 import coordinator_pb2

PREFIX = "specdec:faults-redis"
PROMPT = [3, 1, 4, 1, 5]
REQUEST = {"max_new_tokens": 10, "num_speculative_tokens": 2, "ignore_eos": True}
LONG = {"max_new_tokens": 55, "num_speculative_tokens": 1, "seed": 3, "temperature": 1.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def stack(tiny_model_dirs, pools, fault_dir):
    server = harness.redis_server(fault_dir, name="redis-aof")
    url = f"redis://{server.address}/0"
    coordinator = harness.coordinator(
        fault_dir,
        pools.draft.address,
        pools.target.address,
        url,
        tiny_model_dirs["target"],
        name="coordinator-redis",
        SESSION_KEY_PREFIX=PREFIX,
    )
    with harness.running(server, coordinator):
        yield server, coordinator, url


def _sessions(client, count: int) -> dict[str, list[int]]:
    """{session id: stored tokens} of `count` new sessions, unary and streamed, T = 0 and 1."""
    histories = {}
    for seed in range(count):
        params = dict(REQUEST, seed=seed, temperature=float(seed % 2))
        if seed % 2:
            chunks = list(client.stream(PROMPT, **params))
            session_id, tokens = chunks[-1].session_id, [t for c in chunks for t in c.token_ids]
        else:
            response = client.generate(PROMPT, **params)
            session_id, tokens = response.session_id, list(response.completions[0].token_ids)
        histories[session_id] = PROMPT + tokens
    return histories


def test_redis_killed_and_restarted_with_aof_loses_no_session(stack):
    """Fault: SIGKILL of redis-server (appendonly yes, appendfsync always), then a restart on the
    same port and directory.
    Expect: while it is down a session call fails with UNAVAILABLE that names no address, and
    the coordinator stays up; after the restart every session created before is there with
    the same tokens (read through the coordinator and in Redis) and can be continued."""
    server, coordinator, url = stack
    with harness.client(coordinator) as client:
        histories = _sessions(client, 4)
        server.kill()
        code, details, down_s = harness.status_of(lambda: client.get_session(next(iter(histories))))
        assert code == grpc.StatusCode.UNAVAILABLE and "127.0.0.1" not in details, (code, details)
        code, details, _ = harness.status_of(lambda: client.generate(PROMPT, **REQUEST))
        assert code == grpc.StatusCode.UNAVAILABLE and "127.0.0.1" not in details, (code, details)
        restart_s = server.restart()
        restarted_at = time.monotonic()
        while harness.status_of(lambda: client.get_session(next(iter(histories))))[0] is not None:
            assert time.monotonic() - restarted_at < 30, "the coordinator never reached Redis again"
            time.sleep(0.1)
        back_s = time.monotonic() - restarted_at
        for session_id, history in histories.items():
            assert list(client.get_session(session_id).token_ids) == history
            assert harness.stored_tokens(url, PREFIX, session_id) == history
            more = client.generate([2], session_id=session_id, **REQUEST)
            expected = history + [2] + list(more.completions[0].token_ids)
            assert harness.stored_tokens(url, PREFIX, session_id) == expected
    assert coordinator.running
    print(
        f"Redis down: session calls UNAVAILABLE in {down_s:.2f} s; restarted in {restart_s:.2f} s; "
        f"coordinator served sessions again {back_s:.2f} s later; {len(histories)} of {len(histories)} "
        "sessions intact and continued"
    )


def test_flushall_gives_not_found_and_the_coordinator_keeps_serving(stack):
    """Fault: FLUSHALL while sessions exist, and while a stream runs.
    Expect: continuing, resuming, reading or deleting a flushed session gets NOT_FOUND with a
    clear message; the running stream fails with ABORTED (it lost its lease) and leaves nothing in
    Redis; the coordinator process stays up and serves new sessions."""
    _, coordinator, url = stack
    with harness.client(coordinator) as client:
        histories = _sessions(client, 2)
        stream_error, received, session_id = None, [], ""
        try:
            for chunk in client.stream(PROMPT, **LONG):
                received += chunk.token_ids
                session_id = chunk.session_id
                if len(received) == len(chunk.token_ids):
                    with redis.Redis.from_url(url) as r:
                        r.flushall()
        except grpc.RpcError as exc:
            stream_error = exc
        assert stream_error is not None, "the stream finished before the flush"
        assert stream_error.code() == grpc.StatusCode.ABORTED, stream_error
        assert harness.stored_tokens(url, PREFIX, session_id) is None
        for flushed in histories:
            calls = {
                "continue": lambda s=flushed: client.generate([2], session_id=s, **REQUEST),
                "continue stream": lambda s=flushed: list(client.stream([2], session_id=s, **REQUEST)),
                "resume": lambda s=flushed: list(client.resume(s)),
                "get": lambda s=flushed: client.get_session(s),
            }
            for name, call in calls.items():
                code, details, _ = harness.status_of(call)
                assert code == grpc.StatusCode.NOT_FOUND and "not found" in details, (name, code, details)
            assert client.delete_session(flushed) is False
        started = time.monotonic()
        fresh = client.generate(PROMPT, **REQUEST)
        served_s = time.monotonic() - started
        assert harness.stored_tokens(url, PREFIX, fresh.session_id) == PROMPT + list(fresh.completions[0].token_ids)
        assert client.get_session(fresh.session_id).session_id == fresh.session_id
    assert coordinator.running
    print(
        f"FLUSHALL: running stream ABORTED after {len(received)} tokens ({stream_error.details()!r}); "
        f"flushed sessions NOT_FOUND; a new session served in {served_s:.2f} s"
    )


def _cut_stream(client, url: str):
    """(session id, its state) of a stream the client cancels once its session is stored."""
    stream = client.stream(PROMPT, **LONG)
    session_id = next(stream).session_id
    harness.wait_stored(url, PREFIX, session_id)
    stream.cancel()
    with redis.Redis.from_url(url) as r:  # the cancelled call has ended: its lease is released
        deadline = time.monotonic() + 10
        while r.exists(f"{PREFIX}:session:{session_id}:lock"):
            assert time.monotonic() < deadline
            time.sleep(0.05)
    return session_id, client.get_session(session_id)


def test_a_resumable_session_survives_a_redis_restart(stack):
    """Fault: a stream cut off by the client (its session resumable), then Redis SIGKILLed and
    restarted. Expect: the generation record survives too: the session still resumes to its end."""
    server, coordinator, url = stack
    with harness.client(coordinator) as client:
        for _ in range(5):  # a busy machine may let the tiny pair finish all 55 tokens before the cancel lands
            session_id, before = _cut_stream(client, url)
            if before.resumable_tokens > 0:
                break
        server.restart()
        while harness.status_of(lambda: client.get_session(session_id))[0] is not None:
            time.sleep(0.1)
        after = client.get_session(session_id)
        assert list(after.token_ids) == list(before.token_ids)
        assert after.resumable_tokens == before.resumable_tokens > 0
        rest = [t for c in _resume_when_free(client, session_id) for t in c.token_ids]
        assert len(rest) == before.resumable_tokens
        assert harness.stored_tokens(url, PREFIX, session_id) == list(before.token_ids) + rest


def _resume_when_free(client, session_id: str) -> list[coordinator_pb2.GenerateChunk]:
    """The resumed stream's chunks, retried while the cancelled call still holds the lease."""
    for _ in range(100):
        try:
            return list(client.resume(session_id))
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.ABORTED:
                raise
            time.sleep(0.1)
    raise AssertionError("the session stayed busy")
