"""Run the whole stack as local processes: Redis, target, draft, coordinator, and the
OpenAI-compatible gateway (HTTP, port 8000).

  python scripts/stack.py run    start everything, generate for a demo prompt, print text and stats,
                                 compare speculation with the target alone, stop
  python scripts/stack.py up     start everything and leave it running (state in .run/)
  python scripts/stack.py down   stop what `up` started

Environment: SPECDEC_TARGET_MODEL / SPECDEC_DRAFT_MODEL choose the pair (default: the
packaged SmolLM2-135M-Instruct as target, and the model-free `suffix` draft over the target's
tokenizer, the best measured configuration for a mixed workload: README "Speed, honestly"),
SPECDEC_TARGET_MATMUL_DTYPE its products (default auto: int8 where the CPU has AVX2 and the
weights are 4- or 8-bit blocks, as the packaged target's are; README "Configuration"), REDIS_URL
uses an existing Redis, SPECDEC_DEMO_PROMPT changes the demo prompt and SPECDEC_DEMO_K its K
(default: auto). Without SPECDEC_DEMO_PROMPT, `run` then compares speculation with the target
alone on an input-grounded prompt (`specdec compare`). Other SPECDEC_* variables reach the services
as their settings.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from draft_service.settings import MODEL_FREE, SUFFIX_MODEL
from specdec.local_redis import free_port, start_redis, wait_for_redis
from specdec.models.sources import DEFAULT_MODEL

RUN_DIR = ROOT / ".run"
STATE = RUN_DIR / "stack.json"
COORDINATOR_PORT = int(os.environ.get("SPECDEC_COORDINATOR_PORT", "50051"))
DRAFT_PORT = int(os.environ.get("SPECDEC_DRAFT_PORT", "50052"))
TARGET_PORT = int(os.environ.get("SPECDEC_TARGET_PORT", "50053"))
# 0: a free port chosen just before the gateway starts. Picked earlier, it stays unbound while the
# other services load, and a port the OS hands out meanwhile (a metrics server's port 0) can take it.
GATEWAY_PORT = int(os.environ.get("SPECDEC_GATEWAY_PORT", "8000"))
DEMO_PROMPT = os.environ.get("SPECDEC_DEMO_PROMPT", "Explain in two sentences why the sky is blue.")
DEFAULT_TARGET = DEFAULT_MODEL
# Model-free, so it serves any target that shares its tokenizer; in `make bench` on this CPU it beat
# the distilled model drafts (drafts/, docs/drafts.md) and ngram on every workload with auto K.
DEFAULT_DRAFT = SUFFIX_MODEL
# The target drafts every round itself with the same lookup (SPECDEC_TARGET_LOOKUP), several rounds a
# Verify, and the draft pool goes unasked: served on this CPU, one stream, auto K gave 1.33-1.38x of
# K = 0 against 1.21x with the suffix draft in the coordinator (two alternated pairs; README
# "Configuration"). Empty it to draft through the pool.
DEFAULT_TARGET_LOOKUP = SUFFIX_MODEL
# The target's products: int8 where the CPU and weights allow (the packaged target on an AVX-512 EPYC:
# in process 1.6x the tokens/s of float32 at K = 0, served 8 streams 1.4x; README "Speed, honestly").
MATMUL_DTYPE_ENV = "SPECDEC_TARGET_MATMUL_DTYPE"
DEFAULT_MATMUL_DTYPE = "auto"


def _spawn(name: str, args: list[str], env: dict[str, str]) -> subprocess.Popen:
    log = open(RUN_DIR / f"{name}.log", "ab")  # noqa: SIM115 - handed to the child
    return subprocess.Popen(
        [sys.executable, *args], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )


def _wait_healthy(name: str, port: int, proc: subprocess.Popen, timeout_s: float = 600.0) -> None:
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode}; see {RUN_DIR / (name + '.log')}")
            try:
                status = stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status
                if status == health_pb2.HealthCheckResponse.SERVING:
                    print(f"  {name:<12} serving on 127.0.0.1:{port}")
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.5)
    raise TimeoutError(f"{name} not healthy after {timeout_s:.0f}s; see {RUN_DIR / (name + '.log')}")


def _wait_http_healthy(name: str, port: int, proc: subprocess.Popen, timeout_s: float = 120.0) -> None:
    """Until GET /health answers the gateway's {"status": "serving"} (it reaches a SERVING coordinator).
    The body, not just a 200: another server on the port (a Prometheus exporter answers every path)
    must not pass for the gateway."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode}; see {RUN_DIR / (name + '.log')}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
                if response.status == 200 and _json_or_none(response.read()) == {"status": "serving"}:
                    print(f"  {name:<12} serving on http://127.0.0.1:{port}/v1 (OpenAI API)")
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{name} not healthy after {timeout_s:.0f}s; see {RUN_DIR / (name + '.log')}")


def _json_or_none(body: bytes) -> object:
    try:
        return json.loads(body)
    except ValueError:
        return None


def up() -> dict:
    if STATE.exists():
        raise SystemExit("the stack seems to be up already (.run/stack.json); run `make down` first")
    RUN_DIR.mkdir(exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE=os.environ.get("HF_HUB_OFFLINE", "1"))
    pids: dict[str, int] = {}
    procs: dict[str, subprocess.Popen] = {}
    redis_url = os.environ.get("REDIS_URL")
    try:
        if not redis_url:
            port = free_port()
            procs["redis"] = start_redis(port, str(RUN_DIR / "redis"), str(RUN_DIR / "redis.log"))
            redis_url = f"redis://127.0.0.1:{port}/0"
        wait_for_redis(redis_url)
        print(f"  {'redis':<12} {redis_url}")
        target_model = env.setdefault("SPECDEC_TARGET_MODEL", DEFAULT_TARGET)
        env.setdefault(MATMUL_DTYPE_ENV, DEFAULT_MATMUL_DTYPE)
        env.setdefault("SPECDEC_TARGET_LOOKUP", DEFAULT_TARGET_LOOKUP)
        if env.setdefault("SPECDEC_DRAFT_MODEL", DEFAULT_DRAFT) in MODEL_FREE:
            env.setdefault("SPECDEC_DRAFT_TOKENIZER", target_model)  # its Info: the target's vocabulary
        env.setdefault("SPECDEC_COORDINATOR_TOKENIZER", target_model)
        env["SPECDEC_COORDINATOR_REDIS_URL"] = redis_url
        env["SPECDEC_COORDINATOR_DRAFT_ADDRESS"] = f"127.0.0.1:{DRAFT_PORT}"
        env["SPECDEC_COORDINATOR_TARGET_ADDRESS"] = f"127.0.0.1:{TARGET_PORT}"
        # Both models share these cores: each loads and measures its forward costs alone.
        for role in ("TARGET", "DRAFT"):
            env.setdefault(f"SPECDEC_{role}_START_LOCK", str(RUN_DIR / "start.lock"))
        procs["target"] = _spawn("target", ["-m", "target_service", "--port", str(TARGET_PORT)], env)
        procs["draft"] = _spawn("draft", ["-m", "draft_service", "--port", str(DRAFT_PORT)], env)
        procs["coordinator"] = _spawn("coordinator", ["-m", "coordinator", "--port", str(COORDINATOR_PORT)], env)
        for name, port in (("target", TARGET_PORT), ("draft", DRAFT_PORT), ("coordinator", COORDINATOR_PORT)):
            _wait_healthy(name, port, procs[name])
        env["SPECDEC_GATEWAY_COORDINATOR_ADDRESS"] = f"127.0.0.1:{COORDINATOR_PORT}"
        env.setdefault("SPECDEC_GATEWAY_MODEL_NAME", target_model)  # the id OpenAI requests name
        gateway_port = GATEWAY_PORT or free_port()
        procs["gateway"] = _spawn("gateway", ["-m", "gateway", "--host", "127.0.0.1", "--port", str(gateway_port)], env)
        _wait_http_healthy("gateway", gateway_port, procs["gateway"])
    except BaseException:
        for proc in procs.values():
            _stop_pid(proc.pid)
        raise
    pids = {name: proc.pid for name, proc in procs.items()}
    state = {
        "pids": pids,
        "redis_url": redis_url,
        "coordinator": f"127.0.0.1:{COORDINATOR_PORT}",
        "gateway": f"http://127.0.0.1:{gateway_port}/v1",
        "model": env["SPECDEC_GATEWAY_MODEL_NAME"],
    }
    STATE.write_text(json.dumps(state, indent=2))
    return state


def _stop_pid(pid: int, timeout_s: float = 15.0) -> None:
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        try:
            if os.waitpid(pid, os.WNOHANG)[0]:  # our child (`run`): reaped
                return
        except ChildProcessError:
            pass  # not our child (`down` after `up`): gone once kill(pid, 0) fails, ports freed
        time.sleep(0.1)
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def down() -> None:
    if not STATE.exists():
        print("nothing to stop")
        return
    state = json.loads(STATE.read_text())
    # Gateway and coordinator first, Redis last: nothing is cut off mid-round.
    for name in ("gateway", "coordinator", "draft", "target", "redis"):
        if name in state["pids"]:
            _stop_pid(state["pids"][name])
            print(f"  stopped {name}")
    STATE.unlink()


GROUNDED_DEMO = "An input-grounded prompt (add type hints to textwrap.indent, whose answer copies the code)"


def _grounded_prompt() -> str:
    import inspect
    import textwrap

    return f"Add type hints to this Python function. Reply with the code only.\n\n{inspect.getsource(textwrap.indent)}"


def run() -> int:
    print("starting redis, target, draft, coordinator and gateway (first start loads the models: ~1 min)")
    state = up()
    try:
        from specdec.cli import main as cli

        print(f"\nprompt: {DEMO_PROMPT}\n")
        argv = ["generate", DEMO_PROMPT, "--address", state["coordinator"], "--chat", "--max-new-tokens", "64"]
        argv += ["--temperature", "0.7", "--top-p", "0.9", "--seed", "0"]
        k = ["-k", os.environ["SPECDEC_DEMO_K"]] if os.environ.get("SPECDEC_DEMO_K") else []  # unset: auto K
        code = cli(argv + k)
        if code == 0 and not os.environ.get("SPECDEC_DEMO_PROMPT"):
            print(f"\nDoes it pay? {GROUNDED_DEMO}, run with speculation, then by the target alone (T = 0):\n")
            code = cli(["compare", _grounded_prompt(), "--address", state["coordinator"], "--chat", *k])
        return code
    finally:
        print()
        down()


if __name__ == "__main__":
    command = sys.argv[1] if len(sys.argv) > 1 else "run"
    if command == "up":
        started = up()
        print(f'stack is up: `.venv/bin/specdec generate "Hello"`, or the OpenAI API at {started["gateway"]}:')
        print(
            f"  curl {started['gateway']}/chat/completions -H 'Content-Type: application/json' "
            f"""-d '{{"model": "{started["model"]}", "messages": [{{"role": "user", "content": "Hello"}}]}}'"""
        )
        print("stop it with `make down`")
    elif command == "down":
        down()
    elif command == "run":
        sys.exit(run())
    else:
        raise SystemExit(__doc__)
