"""coordinator/sessions.py against a real Redis: histories, TTLs, the lease, and errors."""

from __future__ import annotations

import socket
import threading
import time
import uuid

import pytest

from coordinator.sessions import RoundSaves, SessionLease, SessionStore
from specdec.core.errors import Aborted, NotFound, Unavailable

TTL_S = 100
LOCK_TTL_S = 30


@pytest.fixture()
def store(redis_url):
    store = SessionStore.from_url(
        redis_url, prefix=f"specdec:test:{uuid.uuid4().hex}", ttl_s=TTL_S, lock_ttl_s=LOCK_TTL_S
    )
    yield store
    store.client.close()


def _saved(store: SessionStore, token_ids: list[int]) -> str:
    session_id = store.new_session_id()
    with store.lease(session_id) as lease:
        lease.save(token_ids)
    return session_id


def test_new_session_ids_are_unique_hex():
    ids = {SessionStore.new_session_id() for _ in range(100)}
    assert len(ids) == 100
    assert all(len(i) == 32 and int(i, 16) >= 0 for i in ids)


def test_ping(store):
    store.ping()


@pytest.mark.parametrize("token_ids", [[1, 2, 3], [], [0, 2**31 - 1, 70_000, 151_935]], ids=["short", "empty", "large"])
def test_save_then_get_round_trips_the_tokens(store, token_ids):
    before = time.time()
    session_id = _saved(store, token_ids)

    record = store.get(session_id)
    assert record.session_id == session_id
    assert record.token_ids == token_ids
    assert 0 < record.ttl_seconds <= TTL_S
    assert before - 1 <= record.created_at <= record.updated_at <= time.time() + 1


def test_a_later_save_replaces_the_history_keeps_created_at_and_refreshes_the_ttls(store, redis_client):
    session_id = _saved(store, [1, 2])
    first = store.get(session_id)
    redis_client.expire(store._key(session_id), 5)

    with store.lease(session_id) as lease:
        redis_client.expire(store._lock_key(session_id), 5)
        lease.save([1, 2, 3, 4])
        assert redis_client.ttl(store._lock_key(session_id)) > 5  # the lease is renewed too

    second = store.get(session_id)
    assert second.token_ids == [1, 2, 3, 4]
    assert second.ttl_seconds > 5
    assert second.created_at == first.created_at
    assert second.updated_at >= first.updated_at


def test_the_session_expires_after_its_ttl(redis_url):
    store = SessionStore.from_url(redis_url, prefix=f"specdec:test:{uuid.uuid4().hex}", ttl_s=1, lock_ttl_s=1)
    session_id = _saved(store, [5])
    assert store.get(session_id).token_ids == [5]
    time.sleep(1.2)
    with pytest.raises(NotFound):
        store.get(session_id)


def test_unknown_session_is_not_found(store):
    with pytest.raises(NotFound, match="not found") as info:
        store.get("no-such-session")
    assert info.value.code == "NOT_FOUND"


def test_a_second_concurrent_lease_is_aborted(store):
    session_id = _saved(store, [1])
    with store.lease(session_id):
        with pytest.raises(Aborted, match="busy") as info, store.lease(session_id):
            pass
        assert info.value.code == "ABORTED"
    # The first lease, once released, leaves the session free again.
    with store.lease(session_id) as lease:
        lease.save([1, 2])
    assert store.get(session_id).token_ids == [1, 2]


def test_only_one_of_many_simultaneous_leases_wins(store):
    session_id = store.new_session_id()
    barrier = threading.Barrier(8)
    outcomes: list[str] = []
    holding = threading.Event()

    def contend():
        barrier.wait()
        try:
            with store.lease(session_id):
                outcomes.append("won")
                holding.wait(2)
        except Aborted:
            outcomes.append("aborted")
            if outcomes.count("aborted") == 7:
                holding.set()

    threads = [threading.Thread(target=contend) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(5)
    assert sorted(outcomes) == ["aborted"] * 7 + ["won"]


def test_the_lease_is_released_on_exit_and_on_error(store, redis_client):
    session_id = store.new_session_id()
    with store.lease(session_id):
        assert redis_client.exists(store._lock_key(session_id))
    assert not redis_client.exists(store._lock_key(session_id))

    with pytest.raises(RuntimeError), store.lease(session_id):
        raise RuntimeError("boom")
    assert not redis_client.exists(store._lock_key(session_id))


@pytest.mark.parametrize("how", ["expired", "taken over"])
def test_a_lease_that_lost_ownership_writes_nothing(store, redis_client, how):
    session_id = _saved(store, [1, 2])
    lock_key = store._lock_key(session_id)
    with store.lease(session_id) as lease:
        if how == "expired":
            redis_client.delete(lock_key)
        else:
            redis_client.set(lock_key, "another-call")
        with pytest.raises(Aborted, match="lost the lease"):
            lease.save([9, 9, 9])
    assert store.get(session_id).token_ids == [1, 2]
    # Releasing the lost lease must not release someone else's.
    if how == "taken over":
        assert redis_client.get(lock_key) == b"another-call"


def test_a_lost_lease_on_a_new_session_creates_nothing(store, redis_client):
    session_id = store.new_session_id()
    with store.lease(session_id) as lease:
        redis_client.delete(store._lock_key(session_id))
        with pytest.raises(Aborted):
            lease.save([1])
    assert not redis_client.exists(store._key(session_id))
    with pytest.raises(NotFound):
        store.get(session_id)


def test_delete(store):
    session_id = _saved(store, [1, 2, 3])
    assert store.delete(session_id) is True
    with pytest.raises(NotFound):
        store.get(session_id)
    assert store.delete(session_id) is False


def test_delete_is_refused_while_a_call_owns_the_session(store):
    session_id = _saved(store, [1])
    with store.lease(session_id), pytest.raises(Aborted):
        store.delete(session_id)
    assert store.get(session_id).token_ids == [1]


@pytest.fixture()
def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize(
    "operation",
    [
        lambda s: s.ping(),
        lambda s: s.get("x"),
        lambda s: s.delete("x"),
        lambda s: s.lease("x").__enter__(),
        lambda s: SessionLease(s, "x", owner="me").save([1]),
    ],
    ids=["ping", "get", "delete", "lease", "save"],
)
def test_unreachable_redis_is_unavailable(closed_port, operation):
    store = SessionStore.from_url(f"redis://127.0.0.1:{closed_port}/0", prefix="specdec:test", ttl_s=10, lock_ttl_s=10)
    with pytest.raises(Unavailable, match="unavailable") as info:
        operation(store)
    assert info.value.code == "UNAVAILABLE"
    assert str(closed_port) not in str(info.value), "a client must not learn the store's address"


def test_a_session_exists_only_for_the_tenant_that_created_it(store):
    session_id = store.new_session_id()
    with store.lease(session_id, tenant="alice") as lease:
        lease.save([1, 2])
    assert store.get(session_id, "alice").token_ids == [1, 2]
    for other in ("", "bob"):
        with pytest.raises(NotFound):
            store.get(session_id, other)
        assert store.delete(session_id, other) is False
    with store.lease(session_id, tenant="bob") as lease:  # a later save never changes the owner
        lease.save([1, 2, 3])
    assert store.get(session_id, "alice").token_ids == [1, 2, 3]
    assert store.delete(session_id, "alice") is True


def test_the_generation_in_progress_is_saved_with_the_tokens_and_cleared_when_done(store):
    session_id = store.new_session_id()
    with store.lease(session_id) as lease:
        lease.save([1, 2], {"seed": 7, "generated": 1})
        assert store.get(session_id).generation == {"seed": 7, "generated": 1}
        lease.save([1, 2, 3])
    assert store.get(session_id).generation is None


def test_a_held_lease_is_renewed_past_its_ttl_and_a_released_one_frees_the_session(redis_url):
    store = SessionStore.from_url(redis_url, prefix=f"specdec:test:{uuid.uuid4().hex}", ttl_s=TTL_S, lock_ttl_s=1)
    session_id = store.new_session_id()
    with store.lease(session_id) as lease:
        time.sleep(2.5)  # 2.5 TTLs: only the heartbeat keeps it
        with pytest.raises(Aborted):
            store.lease(session_id).__enter__()
        lease.save([4])
    with store.lease(session_id):
        pass


def test_an_abandoned_lease_lapses_within_its_ttl(redis_url):
    store = SessionStore.from_url(redis_url, prefix=f"specdec:test:{uuid.uuid4().hex}", ttl_s=TTL_S, lock_ttl_s=1)
    session_id = store.new_session_id()
    store.client.set(store._lock_key(session_id), "a crashed coordinator", ex=1)
    with pytest.raises(Aborted):
        store.lease(session_id).__enter__()
    time.sleep(1.2)
    with store.lease(session_id):
        pass


def test_round_saves_save_behind_the_rounds_sent_and_never_ahead():
    saves, context = [], [1, 2]
    behind = RoundSaves(lambda ids, record: saves.append((list(ids), record)), context, interval_s=3600.0)
    context.append(3)
    behind.sent({"round": 1})  # within the interval: held
    context.append(4)  # the next round runs (not sent yet)
    assert saves == []
    behind.flush()  # the stream ends or fails: what was sent, not what was computed since
    assert saves == [([1, 2, 3], {"round": 1})]
    behind.flush()
    assert len(saves) == 1  # nothing new to save
    behind.sent(None)  # finished: saved at once, whatever the interval
    assert saves[-1] == ([1, 2, 3, 4], None)


def test_round_saves_save_each_round_once_the_interval_has_passed():
    saves, context = [], [7]
    every = RoundSaves(lambda ids, record: saves.append(list(ids)), context, interval_s=0.0)
    for token in (8, 9):
        context.append(token)
        every.sent({"round": token})
    assert saves == [[7, 8], [7, 8, 9]]
