"""How many concurrent streams one coordinator drives, with pools that cost nothing (issue 13).

Starts three processes: a real Redis, stub draft and target pools (one grpc.aio process that
answers Propose / Verify at once, or after --propose-ms / --verify-ms, with small valid laws over
an 8-token vocabulary: the draft proposes token 1, the target gives it 0.7, so ~0.7 of drafts are
accepted), and the real coordinator (`python -m coordinator`). Then, per concurrency level, that
many clients (grpc.aio, in this process) each run GenerateStream calls back to back for
--seconds, and it reports:

  rounds/s     chunks carrying tokens, over all streams (one per engine round)
  cpu ms/round the coordinator process's user + system CPU (/proc) over the level, per round;
               cpu % is the same over wall time (100 % = one core: the GIL's ceiling)
  p50 / p99    ms between consecutive chunks of a stream: with instant pools, the latency the
               coordinator (and the two loopback calls it makes) adds to each round; with
               --verify-ms / --propose-ms, less those
  coord ms     the coordinator's own time per round as it reports it (GenerationStats
               coordinator_time_s / rounds: total less its Propose and Verify calls), mean
  refused      calls refused RESOURCE_EXHAUSTED (admission: MAX_CONCURRENT_REQUESTS)

and the CPU % of the stub process and of this driver, to see which process is saturated.

  python scripts/coordinator_bench.py                          1,8,32,64,128 streams, instant pools
  python scripts/coordinator_bench.py --verify-ms 100 --propose-ms 20 --concurrency 16,64,128
  python scripts/coordinator_bench.py --max-workers 32 --max-concurrent 16   (the old defaults)
  python scripts/coordinator_bench.py --json                   one JSON object per level
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parents[1]
VOCAB = ["<eos>", "a", "b", "c", "d", "e", "f", "g"]
DRAFT_TOKEN = 1
TARGET_LAW = [0.0, 0.7] + [0.05] * 6  # never EOS: streams run to max_new_tokens


# ---------------------------------------------------------------- the stub pools (a process)


def save_tokenizer(directory: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(VOCAB)}, unk_token="<eos>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>").save_pretrained(directory)
    return directory


async def serve_stubs(tokenizer_dir: str, draft_port: int, target_port: int, propose_s: float, verify_s: float):
    import numpy as np

    from specdec.models.sources import load_tokenizer, tokenizer_fingerprint
    from specdec.rpc.wire import encode_probs
    from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc

    fingerprint = tokenizer_fingerprint(load_tokenizer(tokenizer_dir))

    def info(role: str) -> common_pb2.ModelInfo:
        return common_pb2.ModelInfo(
            model_id=f"stub-{role}",
            vocab_size=len(VOCAB),
            tokenizer_fingerprint=fingerprint,
            eos_token_ids=[0],
            dtype="float32",
            device="cpu",
            max_position_embeddings=1 << 20,
            role=role,
            hidden_size=8,
        )

    laws: dict[int, common_pb2.ProbTensor] = {}

    def target_probs(rows: int) -> common_pb2.ProbTensor:
        if rows not in laws:
            laws[rows] = encode_probs(np.tile(np.asarray(TARGET_LAW, dtype=np.float32), (rows, 1)))
        return laws[rows]

    class Draft(draft_pb2_grpc.DraftServiceServicer):
        async def Propose(self, request, context):
            if propose_s:
                await asyncio.sleep(propose_s)
            return draft_pb2.ProposeResponse(
                proposals=[
                    draft_pb2.Proposal(draft_token_ids=[DRAFT_TOKEN] * s.num_draft_tokens, point_mass=True)
                    for s in request.sequences
                ]
            )

        async def Info(self, request, context):
            return info("draft")

    class Target(target_pb2_grpc.TargetServiceServicer):
        async def Verify(self, request, context):
            if verify_s:
                await asyncio.sleep(verify_s)
            return target_pb2.VerifyResponse(
                verifications=[
                    target_pb2.Verification(target_probs=target_probs(len(s.draft_token_ids) + 1))
                    for s in request.sequences
                ]
            )

        async def Info(self, request, context):
            return info("target")

    servers = []
    for port, add, servicer in (
        (draft_port, draft_pb2_grpc.add_DraftServiceServicer_to_server, Draft()),
        (target_port, target_pb2_grpc.add_TargetServiceServicer_to_server, Target()),
    ):
        server = grpc.aio.server()
        add(servicer, server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        servers.append(server)
    print("ready", flush=True)
    await asyncio.gather(*(s.wait_for_termination() for s in servers))


# ---------------------------------------------------------------- the processes


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (its threads included)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    from specdec.local_redis import free_port as free

    return free()


@contextlib.contextmanager
def process(args: list[str], log: Path, env: dict[str, str] | None = None, ready: str | None = None):
    """A child process logging to `log` (its stdout piped when it prints `ready` first)."""
    with open(log, "w") as out:
        proc = subprocess.Popen(
            args,
            env={**os.environ, **(env or {})},
            cwd=ROOT,
            stdout=subprocess.PIPE if ready else out,
            stderr=out,
            text=True,
        )
    try:
        if ready is not None and ready not in proc.stdout.readline():
            raise RuntimeError(f"{args[:3]} did not start: {log.read_text()[-2000:]}")
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()


def wait_serving(address: str, proc: subprocess.Popen, timeout_s: float = 60.0) -> bool:
    """Whether the server at `address` (run by `proc`) reports SERVING within `timeout_s`."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    serving = health_pb2.HealthCheckResponse.SERVING
    until = time.monotonic() + timeout_s
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while proc.poll() is None and time.monotonic() < until:
            with contextlib.suppress(grpc.RpcError):
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status == serving:
                    return True
            time.sleep(0.2)
    return False


# ---------------------------------------------------------------- the clients


@dataclass
class Level:
    concurrency: int
    seconds: float = 0.0
    rounds: int = 0
    streams: int = 0
    refused: int = 0
    errors: int = 0
    rounds_per_s: float = 0.0
    coordinator_cpu_ms_per_round: float = 0.0
    coordinator_cpu_pct: float = 0.0
    stubs_cpu_pct: float = 0.0
    driver_cpu_pct: float = 0.0
    round_p50_ms: float = 0.0
    round_p99_ms: float = 0.0
    coordinator_ms_per_round: float = 0.0
    gaps: list[float] = field(default_factory=list, repr=False)
    own_s: list[float] = field(default_factory=list, repr=False)


async def client(stub, level: Level, args, until: float, index: int) -> None:
    from specdec.v1 import coordinator_pb2

    n = 0
    while time.monotonic() < until:
        n += 1
        request = coordinator_pb2.GenerateRequest(
            prompt_token_ids=[1, 2, 3, 4],
            max_new_tokens=args.tokens,
            num_speculative_tokens=args.k,
            seed=index * 100_000 + n,
            ignore_eos=True,
        )
        last = None
        try:
            async for chunk in stub.GenerateStream(request, timeout=120):
                now = time.perf_counter()
                if chunk.done:
                    if chunk.stats.rounds:
                        level.own_s.append(chunk.stats.coordinator_time_s / chunk.stats.rounds)
                    continue
                if last is not None:
                    level.gaps.append(now - last)
                last = now
                level.rounds += 1
            level.streams += 1
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                level.refused += 1
                await asyncio.sleep(0.01)
            else:
                level.errors += 1
                if level.errors <= 3:
                    print(f"  stream failed: {exc.code().name} {exc.details()}", file=sys.stderr)


async def run_level(address: str, concurrency: int, args, pids: dict[str, int]) -> Level:
    from specdec.v1 import coordinator_pb2_grpc

    async with grpc.aio.insecure_channel(address) as channel:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        warm = Level(concurrency)
        await asyncio.gather(*(client(stub, warm, args, time.monotonic() + 1.0, i) for i in range(concurrency)))
        level = Level(concurrency)
        cpu = {name: cpu_seconds(pid) for name, pid in pids.items()}
        started = time.monotonic()
        until = started + args.seconds
        await asyncio.gather(*(client(stub, level, args, until, i) for i in range(concurrency)))
        level.seconds = time.monotonic() - started
    used = {name: cpu_seconds(pid) - cpu[name] for name, pid in pids.items()}
    level.rounds_per_s = level.rounds / level.seconds
    level.coordinator_cpu_ms_per_round = 1000 * used["coordinator"] / max(1, level.rounds)
    level.coordinator_cpu_pct = 100 * used["coordinator"] / level.seconds
    level.stubs_cpu_pct = 100 * used["stubs"] / level.seconds
    level.driver_cpu_pct = 100 * used["driver"] / level.seconds
    if level.gaps:
        gaps = sorted(level.gaps)
        level.round_p50_ms = 1000 * statistics.median(gaps)
        level.round_p99_ms = 1000 * gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))]
    if level.own_s:
        level.coordinator_ms_per_round = 1000 * statistics.fmean(level.own_s)
    return level


def report(level: Level, as_json: bool) -> None:
    if as_json:
        print(json.dumps({k: v for k, v in asdict(level).items() if k not in ("gaps", "own_s")}), flush=True)
        return
    print(
        f"{level.concurrency:>5} {level.rounds_per_s:>9.0f} {level.coordinator_cpu_ms_per_round:>8.2f}"
        f" {level.coordinator_cpu_pct:>6.0f} {level.round_p50_ms:>7.1f} {level.round_p99_ms:>7.1f}"
        f" {level.coordinator_ms_per_round:>8.2f} {level.stubs_cpu_pct:>6.0f} {level.driver_cpu_pct:>6.0f}"
        f" {level.refused:>7} {level.errors:>6}",
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", default="1,8,32,64,128", help="comma list of concurrent streams")
    parser.add_argument("--seconds", type=float, default=8.0, help="measured seconds per level (after 1 s warm-up)")
    parser.add_argument("--tokens", type=int, default=64, help="max_new_tokens of each stream")
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--propose-ms", type=float, default=0.0, help="the stub draft's latency per Propose")
    parser.add_argument("--verify-ms", type=float, default=0.0, help="the stub target's latency per Verify")
    parser.add_argument("--max-workers", type=int, default=0, help="coordinator MAX_WORKERS (0 = its default)")
    parser.add_argument("--max-concurrent", type=int, default=0, help="MAX_CONCURRENT_REQUESTS (0 = its default)")
    parser.add_argument(
        "--switch-ms", type=float, default=0.0, help="the coordinator's sys.setswitchinterval, ms (0 = Python's 5)"
    )
    parser.add_argument("--json", action="store_true", help="one JSON object per level")
    parser.add_argument(
        "--serve-stubs", nargs=3, metavar=("TOKENIZER", "DRAFT_PORT", "TARGET_PORT"), help=argparse.SUPPRESS
    )
    args = parser.parse_args(argv)
    if args.serve_stubs:
        tokenizer, draft_port, target_port = args.serve_stubs
        asyncio.run(
            serve_stubs(tokenizer, int(draft_port), int(target_port), args.propose_ms / 1000, args.verify_ms / 1000)
        )
        return 0
    bench(args)
    return 0


def coordinator_command(switch_ms: float) -> list[str]:
    """`python -m coordinator`, with the interpreter's GIL switch interval set first when asked."""
    if not switch_ms:
        return [sys.executable, "-m", "coordinator"]
    code = f"import runpy, sys; sys.setswitchinterval({switch_ms / 1000}); runpy.run_module('coordinator', run_name='__main__')"
    return [sys.executable, "-c", code]


def bench(args) -> None:
    from specdec.local_redis import temporary_redis

    with tempfile.TemporaryDirectory() as tmp, temporary_redis(os.path.join(tmp, "redis")) as redis_url:
        tokenizer = str(save_tokenizer(Path(tmp) / "tokenizer"))
        draft_port, target_port, port = free_port(), free_port(), free_port()
        stub_args = [sys.executable, __file__, "--serve-stubs", tokenizer, str(draft_port), str(target_port)]
        stub_args += ["--propose-ms", str(args.propose_ms), "--verify-ms", str(args.verify_ms)]
        env = {
            "SPECDEC_COORDINATOR_HOST": "127.0.0.1",
            "SPECDEC_COORDINATOR_PORT": str(port),
            "SPECDEC_COORDINATOR_METRICS_PORT": "-1",
            "SPECDEC_COORDINATOR_DRAFT_ADDRESS": f"127.0.0.1:{draft_port}",
            "SPECDEC_COORDINATOR_TARGET_ADDRESS": f"127.0.0.1:{target_port}",
            "SPECDEC_COORDINATOR_REDIS_URL": redis_url,
            "SPECDEC_COORDINATOR_TOKENIZER": tokenizer,
            "SPECDEC_COORDINATOR_LOG_LEVEL": "warning",
        }
        if args.max_workers:
            env["SPECDEC_COORDINATOR_MAX_WORKERS"] = str(args.max_workers)
        if args.max_concurrent:
            env["SPECDEC_COORDINATOR_MAX_CONCURRENT_REQUESTS"] = str(args.max_concurrent)
        with (
            process(stub_args, Path(tmp) / "stubs.log", ready="ready") as stubs,
            process(coordinator_command(args.switch_ms), Path(tmp) / "coordinator.log", env) as coordinator,
        ):
            address = f"127.0.0.1:{port}"
            if not wait_serving(address, coordinator):
                raise RuntimeError(
                    f"the coordinator is not serving: {(Path(tmp) / 'coordinator.log').read_text()[-2000:]}"
                )
            pids = {"coordinator": coordinator.pid, "stubs": stubs.pid, "driver": os.getpid()}
            if not args.json:
                print(f"K={args.k}, {args.tokens} tokens a stream, pools {args.propose_ms:g} / {args.verify_ms:g} ms")
                print("  conc  rounds/s cpu ms/r  cpu %   p50 ms  p99 ms coord ms stub % drv %  refused errors")
            for concurrency in (int(c) for c in args.concurrency.split(",")):
                report(asyncio.run(run_level(address, concurrency, args, pids)), args.json)


if __name__ == "__main__":
    sys.exit(main())
