"""Session token histories in Redis, so any coordinator replica can continue a session.

Layout (prefix defaults to `specdec:v1`):
  {prefix}:session:{id}       hash: tokens (little-endian int32 bytes), created_at, updated_at
  {prefix}:session:{id}:lock  the id of the Generate call that owns the session (lease)

One Generate owns a session at a time (SET NX lease, renewed each round); a
second concurrent call is rejected with ABORTED instead of interleaving. Every
write is conditional on still owning the lease (a Lua script), so even an
expired lease cannot mix two histories.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import redis

from specdec.core.errors import Aborted, NotFound, Unavailable

_SAVE_IF_OWNER = """
if redis.call('GET', KEYS[2]) ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'tokens', ARGV[2], 'updated_at', ARGV[3])
redis.call('HSETNX', KEYS[1], 'created_at', ARGV[3])
redis.call('EXPIRE', KEYS[1], ARGV[4])
redis.call('EXPIRE', KEYS[2], ARGV[5])
return 1
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


def _encode_tokens(token_ids: list[int]) -> bytes:
    return np.asarray(token_ids, dtype="<i4").tobytes()


def _decode_tokens(data: bytes) -> list[int]:
    return np.frombuffer(data, dtype="<i4").tolist()


class SessionLease:
    """Ownership of one session for the duration of one Generate call."""

    def __init__(self, store: SessionStore, session_id: str, owner: str):
        self.store = store
        self.session_id = session_id
        self.owner = owner

    def save(self, token_ids: list[int]) -> None:
        """Store the whole token history; renews the session TTL and the lease."""
        self.store._save(self, token_ids)


class SessionStore:
    def __init__(self, client: redis.Redis, prefix: str, ttl_s: int, lock_ttl_s: int):
        self.client = client
        self.prefix = prefix
        self.ttl_s = ttl_s
        self.lock_ttl_s = lock_ttl_s
        self._save_script = client.register_script(_SAVE_IF_OWNER)
        self._release_script = client.register_script(_RELEASE_IF_OWNER)

    @classmethod
    def from_url(cls, url: str, prefix: str, ttl_s: int, lock_ttl_s: int) -> SessionStore:
        client = redis.Redis.from_url(url, socket_timeout=5.0, socket_connect_timeout=5.0)
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
            raise Unavailable(f"session store (Redis) unavailable: {exc}") from exc

    def ping(self) -> None:
        with self._redis_errors():
            self.client.ping()

    def get(self, session_id: str) -> SessionRecord:
        """The stored session; NotFound if it does not exist (or expired)."""
        with self._redis_errors():
            pipe = self.client.pipeline()
            pipe.hgetall(self._key(session_id))
            pipe.ttl(self._key(session_id))
            fields, ttl = pipe.execute()
        if not fields or b"tokens" not in fields:
            raise NotFound(f"session {session_id!r} not found (never created, deleted, or expired)")
        return SessionRecord(
            session_id=session_id,
            token_ids=_decode_tokens(fields[b"tokens"]),
            ttl_seconds=int(ttl),
            created_at=float(fields.get(b"created_at", 0.0)),
            updated_at=float(fields.get(b"updated_at", 0.0)),
        )

    @contextmanager
    def lease(self, session_id: str) -> Iterator[SessionLease]:
        """Own `session_id` for a block; Aborted if another call owns it."""
        owner = uuid.uuid4().hex
        with self._redis_errors():
            acquired = self.client.set(self._lock_key(session_id), owner, nx=True, ex=self.lock_ttl_s)
        if not acquired:
            raise Aborted(f"session {session_id!r} is busy with another request; retry when it has finished")
        try:
            yield SessionLease(self, session_id, owner)
        finally:
            try:
                self._release_script(keys=[self._lock_key(session_id)], args=[owner])
            except redis.RedisError:
                pass  # the lease expires on its own

    def _save(self, lease: SessionLease, token_ids: list[int]) -> None:
        with self._redis_errors():
            saved = self._save_script(
                keys=[self._key(lease.session_id), self._lock_key(lease.session_id)],
                args=[lease.owner, _encode_tokens(token_ids), f"{time.time():.6f}", self.ttl_s, self.lock_ttl_s],
            )
        if not saved:
            raise Aborted(f"lost the lease on session {lease.session_id!r} (expired or deleted meanwhile)")

    def delete(self, session_id: str) -> bool:
        """Delete a session not in use; Aborted while a Generate owns it. False if absent."""
        with self.lease(session_id):
            with self._redis_errors():
                return bool(self.client.delete(self._key(session_id)))
