"""Session token histories in Redis, so any coordinator replica can continue a session.

Layout (prefix defaults to `specdec:v1`):
  {prefix}:session:{id}       hash: tokens (little-endian int32 bytes), created_at, updated_at,
                              tenant (who created it), generation (JSON: a stream in progress,
                              what `resume` continues; absent once it finished)
  {prefix}:session:{id}:lock  the id of the Generate call that owns the session (lease)

One Generate owns a session at a time (SET NX lease, renewed by a heartbeat every third of its
TTL, released on every exit); a second concurrent call is rejected with ABORTED instead of
interleaving, and a crashed owner's lease lapses within one TTL. Every write is conditional on
still owning the lease (a Lua script), so even an expired lease cannot mix two histories.
A session belongs to the tenant that created it: to any other it does not exist (NOT_FOUND).
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import redis

from specdec.core.errors import Aborted, NotFound, Unavailable

_SAVE_IF_OWNER = """
if redis.call('GET', KEYS[2]) ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'tokens', ARGV[2], 'updated_at', ARGV[3])
redis.call('HSETNX', KEYS[1], 'created_at', ARGV[3])
redis.call('HSETNX', KEYS[1], 'tenant', ARGV[6])
if ARGV[7] == '' then redis.call('HDEL', KEYS[1], 'generation')
else redis.call('HSET', KEYS[1], 'generation', ARGV[7]) end
redis.call('EXPIRE', KEYS[1], ARGV[4])
redis.call('EXPIRE', KEYS[2], ARGV[5])
return 1
"""

_RENEW_IF_OWNER = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('EXPIRE', KEYS[1], ARGV[2]) end
return 0
"""

_RELEASE_IF_OWNER = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


@dataclass(frozen=True)
class SessionRecord:
    session_id: str
    token_ids: list[int]
    ttl_seconds: int
    created_at: float
    updated_at: float
    # The stream in progress when the session was last saved (coordinator.generation's record of
    # what `resume` needs), None when the last generation finished.
    generation: dict | None = None


def _encode_tokens(token_ids: list[int]) -> bytes:
    return np.asarray(token_ids, dtype="<i4").tobytes()


def _decode_tokens(data: bytes) -> list[int]:
    return np.frombuffer(data, dtype="<i4").tolist()


class SessionLease:
    """Ownership of one session for the duration of one Generate call."""

    def __init__(self, store: SessionStore, session_id: str, owner: str, tenant: str = ""):
        self.store = store
        self.session_id = session_id
        self.owner = owner
        self.tenant = tenant

    def save(self, token_ids: list[int], generation: dict | None = None) -> None:
        """Store the whole token history and the generation in progress (None: none is);
        renews the session TTL and the lease."""
        self.store._save(self, token_ids, generation)


class RoundSaves:
    """A stream's saves, behind what it sent: each round's state is handed over once sent, and saved
    when `interval_s` has passed since the last save, when the generation has finished, and on
    `flush` (the stream's end or failure). So Redis never holds a token the client was not sent,
    and a coordinator that dies mid-stream loses at most `interval_s` of rounds, which a resume
    generates again (the client keeps its tokens up to the resumed chunk's offset)."""

    def __init__(self, save: Callable[[list[int], dict | None], None], context: list[int], interval_s: float):
        self._save, self._context, self._interval_s = save, context, interval_s
        self._pending: tuple[int, dict | None] | None = None  # (tokens of context, record) not saved yet
        self._saved_at = time.monotonic()

    def sent(self, generation: dict | None) -> None:
        """The round just sent left `context` and this record (None: the generation has finished)."""
        self._pending = (len(self._context), generation)
        if generation is None or time.monotonic() - self._saved_at >= self._interval_s:
            self.flush()

    def flush(self) -> None:
        if self._pending is not None:
            count, generation = self._pending
            self._save(self._context[:count], generation)  # context only grows between rounds
            self._pending, self._saved_at = None, time.monotonic()


class _Heartbeat:
    """Renews a lease every third of its TTL until stopped, so a live call never loses it
    however long a round takes, and a dead one's lapses within one TTL."""

    def __init__(self, store: SessionStore, session_id: str, owner: str):
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(store, session_id, owner), name="session-lease", daemon=True
        )
        self._thread.start()

    def _run(self, store: SessionStore, session_id: str, owner: str) -> None:
        while not self._stop.wait(store.lock_ttl_s / 3):
            try:
                if not store._renew_script(keys=[store._lock_key(session_id)], args=[owner, store.lock_ttl_s]):
                    return  # lost (deleted, expired): the next save reports it
            except redis.RedisError:
                pass  # Redis stalled: try again next beat; saves fail on their own

    def stop(self) -> None:
        self._stop.set()


class SessionStore:
    def __init__(self, client: redis.Redis, prefix: str, ttl_s: int, lock_ttl_s: int):
        self.client = client
        self.prefix = prefix
        self.ttl_s = ttl_s
        self.lock_ttl_s = lock_ttl_s
        self._save_script = client.register_script(_SAVE_IF_OWNER)
        self._release_script = client.register_script(_RELEASE_IF_OWNER)
        self._renew_script = client.register_script(_RENEW_IF_OWNER)

    @classmethod
    def from_url(
        cls, url: str, prefix: str, ttl_s: int, lock_ttl_s: int, max_connections: int | None = None
    ) -> SessionStore:
        """`max_connections`: the pool's bound (redis-py's default, 100, refuses commands past it)."""
        client = redis.Redis.from_url(
            url, socket_timeout=5.0, socket_connect_timeout=5.0, max_connections=max_connections
        )
        return cls(client, prefix, ttl_s, lock_ttl_s)

    def _key(self, session_id: str) -> str:
        return f"{self.prefix}:session:{session_id}"

    def _lock_key(self, session_id: str) -> str:
        return f"{self.prefix}:session:{session_id}:lock"

    @staticmethod
    def new_session_id() -> str:
        return uuid.uuid4().hex

    @contextmanager
    def _redis_errors(self) -> Iterator[None]:
        try:
            yield
        except redis.RedisError as exc:
            # The class only: redis-py's messages name the server's address, which clients must not see.
            raise Unavailable(f"session store unavailable ({type(exc).__name__}); retry shortly") from exc

    def ping(self) -> None:
        with self._redis_errors():
            self.client.ping()

    def get(self, session_id: str, tenant: str = "") -> SessionRecord:
        """The stored session; NotFound if it does not exist (or expired) or is another tenant's."""
        with self._redis_errors():
            pipe = self.client.pipeline()
            pipe.hgetall(self._key(session_id))
            pipe.ttl(self._key(session_id))
            fields, ttl = pipe.execute()
        if not fields or b"tokens" not in fields or fields.get(b"tenant", b"").decode() != tenant:
            raise NotFound(f"session {session_id!r} not found (never created, deleted, or expired)")
        generation = fields.get(b"generation")
        return SessionRecord(
            session_id=session_id,
            token_ids=_decode_tokens(fields[b"tokens"]),
            ttl_seconds=int(ttl),
            created_at=float(fields.get(b"created_at", 0.0)),
            updated_at=float(fields.get(b"updated_at", 0.0)),
            generation=json.loads(generation) if generation else None,
        )

    @contextmanager
    def lease(self, session_id: str, tenant: str = "") -> Iterator[SessionLease]:
        """Own `session_id` for a block (for `tenant`, whose saves it records on a new session);
        Aborted if another call owns it."""
        owner = uuid.uuid4().hex
        with self._redis_errors():
            acquired = self.client.set(self._lock_key(session_id), owner, nx=True, ex=self.lock_ttl_s)
        if not acquired:
            raise Aborted(f"session {session_id!r} is busy with another request; retry when it has finished")
        heartbeat = _Heartbeat(self, session_id, owner)
        try:
            yield SessionLease(self, session_id, owner, tenant)
        finally:
            heartbeat.stop()
            try:
                self._release_script(keys=[self._lock_key(session_id)], args=[owner])
            except redis.RedisError:
                pass  # the lease expires on its own

    def _save(self, lease: SessionLease, token_ids: list[int], generation: dict | None) -> None:
        record = json.dumps(generation, separators=(",", ":")) if generation is not None else ""
        with self._redis_errors():
            saved = self._save_script(
                keys=[self._key(lease.session_id), self._lock_key(lease.session_id)],
                args=[
                    lease.owner,
                    _encode_tokens(token_ids),
                    f"{time.time():.6f}",
                    self.ttl_s,
                    self.lock_ttl_s,
                    lease.tenant,
                    record,
                ],
            )
        if not saved:
            raise Aborted(f"lost the lease on session {lease.session_id!r} (expired or deleted meanwhile)")

    def delete(self, session_id: str, tenant: str = "") -> bool:
        """Delete a session not in use; Aborted while a Generate owns it. False if absent or
        another tenant's (to whom it does not exist)."""
        try:
            self.get(session_id, tenant)
        except NotFound:
            return False
        with self.lease(session_id, tenant), self._redis_errors():
            return bool(self.client.delete(self._key(session_id)))
