"""The served stack under load, as `vllm bench serve` measures one: N concurrent client streams or
Poisson arrivals, through the real gRPC pipeline, K = 0 and speculation interleaved in one run.

  python scripts/serve_bench.py                                   concurrency 1,4,8 at K=0 and auto K
  python scripts/serve_bench.py --concurrency 1,4,8,16 --ks 0,2,auto
  python scripts/serve_bench.py --request-rate 0.5,1,2 --max-concurrency 8
  python scripts/serve_bench.py --address HOST:PORT               a coordinator that is already up
  python scripts/serve_bench.py --duration 30                     30 s per level and K (no request count)
  python scripts/serve_bench.py --json                            one JSON object per row on stdout
  python scripts/serve_bench.py --openai-url http://HOST:8000/v1  any OpenAI-compatible server (this
                                                                  gateway, vLLM, TGI, llama.cpp, ...)

A separate script from bench.py, which measures one request at a time per workload x drafter x K x T
(the cost of speculation per round); this one measures a served stack's capacity under load. It
reuses bench.py's drafters, stack environment and background load, and workloads.py's prompts.

Load. `--concurrency 1,4,8` (closed loop): at each level N client streams are in flight, each starting
its next request as soon as its last one ends, until `--num-prompts` requests have started (default 2
per stream, at least 4) or `--duration` seconds have passed. `--request-rate 0.5,2` (open loop): requests
arrive as a Poisson process of that rate (seeded exponential gaps; `inf` = all at once), each in its own
stream; `--max-concurrency M` caps the streams in flight (an arrival waits for a free one); the default
count is 10 s of arrivals (at least 4). Every request is a GenerateStream of a new session, chat template
on, `--ignore-eos` on by default so every request generates exactly --max-new-tokens and levels compare
equal work. Prompts are the first turns of the workloads (30 by default); every K of a level sends the
same prompts with the same seeds (each K's behind its own short opening, so none reuses another's
prefill from the target's cache), and each level the next ones, so no prompt is sent twice at one K until
all are used (a suffix draft learns answers across sessions: at T = 0 it would propose a repeated
prompt's answer whole; rows count such requests). With --same-prompts every level sends the first
ones instead, each level and K behind an opening of its own, so levels compare on the same prompts
(their lengths differ tenfold; with the next ones, 16 requests gave 8 streams prompts of half the
length that 1 stream got). Across the Ks of a level a suffix draft does learn: the second
drafting K meets a draft that indexed the first's answers to the same prompts (measured, 8 streams,
T = 0: auto K 0.7-0.9x of K = 0 run before K = 1, 1.3x after it), so rows count those requests too
and, for a suffix draft, Ks compare fairly only in separate runs. Sessions are deleted after each level, outside its
timing. Each (level, K) starts with nothing in flight; the order of the Ks is rotated per level and per
--repeats, so drift over the run hits every K alike.

The stack. Without --address it is started as processes exactly as `make up` starts it (scripts/stack.py:
Redis, target, draft, coordinator; default pair: the packaged SmolLM2-135M-Instruct target and the
`suffix` draft, as `make run` serves), on free ports with logs in .run/serve-bench-<pid>/, so it does not
collide with a `make up` stack. Its admission limits (MAX_CONCURRENT_REQUESTS, MAX_WORKERS of the
coordinator and both pools) are raised to the most streams this run keeps in flight, unless set in the
environment, so the engine is measured, not the refusals. With --address the server's own limits apply
and a refusal counts as an error (the stream waits 50 ms, then starts its next request).

OpenAI mode. `--openai-url URL` streams the same requests as `POST URL/chat/completions` (or
`URL/completions` with --no-chat) with `stream_options.include_usage`, `ignore_eos`, `seed`, to any
OpenAI-compatible server, so this gateway and other servers are measured the same way; `--model`
names the model (default: the first of `GET URL/models`), `--api-key` (or OPENAI_API_KEY) is sent as
a bearer key. K: `--ks` defaults to `auto` alone (the server's own choice, nothing sent); an integer
K is sent as this gateway's `num_speculative_tokens` extension. A chunk carries text, not token ids:
each request's token count is its final `usage.completion_tokens`, spread over its chunks in
proportion to their characters for ITL (exact when a server sends one token per chunk, an
estimate within a round's chunk otherwise). Acceptance and tokens per round come from this
gateway's `specdec` extension (absent elsewhere: "-"). Sessions the gateway creates are not
deleted (HTTP has no call for it): they expire with the coordinator's SESSION_TTL_S.

Per row (one K at one load level, pooled over --repeats):
  aggregate tok/s     tokens received by all streams / wall time of the level (first send to last end)
  steady tok/s        (closed loops) tokens received from when every stream had its first token (the
                      opening wave of prompts, all sent at once, is over) until the first stream found no
                      request left, over that time; the x base beside it is its ratio to the first level's.
                      The aggregate also counts that wave and the tail (streams finishing alone, in ever
                      smaller batches). "-" where there was no such stretch (one request a stream)
  per-stream tok/s    mean over requests of its tokens / its own wall time (what one user sees)
  req/s               completed requests / wall time of the level
  TTFT                send -> first chunk carrying a token (queueing and the prompt's forward included)
  ITL                 per token: a chunk of n tokens arriving t after the previous token-bearing chunk
                      gives n samples of t / n (a speculative round delivers several tokens at once; per
                      chunk it would look K+1 times slower). Tokens sharing the first chunk are not samples.
  p50 / p90 / p99     linear interpolation between order statistics (numpy's default)
  accept, tok/rnd     sum accepted / sum drafted and sum generated / sum rounds, from each request's
                      final chunk's GenerationStats
  errors              failed requests (by gRPC status code in JSON)
  x base              aggregate tok/s / that of the first (lowest) level at the same K: the scaling; the
                      range is the lowest and highest of that ratio within each repeat (noise)
  vs K=0              aggregate tok/s / that of K = 0 at the same level

--json objects, by "type":
  run   target, drafter, address, commit (git HEAD, "+dirty" if the tree has changes), ks, loads,
        num_prompts, duration_s, max_new_tokens, temperature, ignore_eos, chat, repeats, seed, prompts,
        background_load, cpus, python
  row   k, load, concurrency, request_rate, max_concurrency, repeats, requests, errors, error_codes, repeated_prompts,
        draft_knew_prompts (drafting requests whose prompt an earlier drafting run sent, at any K),
        tokens, seconds, aggregate_tokens_per_s, aggregate_tokens_per_s_runs (one per repeat),
        steady_seconds, steady_tokens_per_s (null: an open loop, or no steady stretch),
        per_stream_tokens_per_s, request_throughput, ttft_ms_p50, ttft_ms_p90, ttft_ms_p99, itl_ms_p50,
        itl_ms_p90, itl_ms_p99, latency_ms_p50, acceptance_rate, tokens_per_round, base, ratio_vs_base,
        ratio_vs_base_min, ratio_vs_base_max, steady_ratio_vs_base, ratio_vs_k0
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import random
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext, redirect_stdout
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import bench
import hostinfo
import stack
import workloads
from workloads import WORKLOADS

from specdec.models.openmp_env import set_openmp_defaults

DEFAULT_DRAFTER = "suffix"  # what `make run` / `make up` serve (stack.DEFAULT_DRAFT)
ERROR_PAUSE_S = 0.05  # after a failed request, before a closed-loop stream starts its next one
DEFAULT_RATE_WINDOW_S = 10.0  # --request-rate without --num-prompts: this many seconds of arrivals


# ------------------------------------------------------------------ pure parts


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100) by linear interpolation between order statistics, as numpy's
    default; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def poisson_schedule(rate: float, n: int, seed: int) -> list[float]:
    """n arrival offsets (seconds from the level's start, non-decreasing) of a Poisson process of
    `rate` requests/s: exponential gaps of mean 1/rate from a seeded generator; rate = inf: all at 0."""
    if rate <= 0:
        raise ValueError(f"request rate must be > 0, got {rate}")
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    return list(itertools.accumulate(rng.expovariate(rate) for _ in range(n)))


def chunk_latencies(arrivals: Sequence[tuple[float, int]]) -> tuple[float | None, list[float]]:
    """(TTFT, ITL samples) from (seconds since send, tokens in the chunk) of the token-bearing chunks,
    in order: TTFT is the first chunk's time; each later chunk of n tokens t after the previous one
    gives n samples of t / n."""
    if not arrivals:
        return None, []
    itls = []
    for (before, _), (now, n) in itertools.pairwise(arrivals):
        itls += [(now - before) / n] * n
    return arrivals[0][0], itls


@dataclass(frozen=True)
class RequestResult:
    """One streamed request as the client saw it; `error` is a gRPC status code name, "" if it succeeded."""

    latency_s: float
    ttft_s: float | None = None
    itl_s: tuple[float, ...] = ()
    tokens: int = 0  # received in chunks
    rounds: int = 0  # from the final chunk's GenerationStats, as drafted and accepted
    drafted: int = 0
    accepted: int = 0
    session_id: str = ""
    error: str = ""
    sent_s: float = 0.0  # when it was sent (time.perf_counter)
    arrivals: tuple[tuple[float, int], ...] = ()  # (seconds since sent, tokens) of each token-bearing chunk


@dataclass(frozen=True)
class Load:
    """One load level: `concurrency` closed-loop streams, or Poisson arrivals at `rate` (capped by
    `max_concurrency` streams in flight when set)."""

    concurrency: int | None = None
    rate: float | None = None
    max_concurrency: int | None = None

    @property
    def label(self) -> str:
        if self.concurrency is not None:
            return f"c={self.concurrency}"
        cap = f",max{self.max_concurrency}" if self.max_concurrency else ""
        return f"r={self.rate:g}{cap}"

    def default_requests(self) -> int:
        """--num-prompts unset: 2 per stream (closed loop) or 10 s of arrivals (Poisson), at least 4."""
        if self.concurrency is not None:
            return max(4, 2 * self.concurrency)
        return 4 if math.isinf(self.rate) else max(4, math.ceil(DEFAULT_RATE_WINDOW_S * self.rate))


@dataclass
class LevelRun:
    """The requests of one (K, load) in one repeat, and the level's wall time."""

    results: list[RequestResult]
    seconds: float
    # A closed loop's steady state, (from, until) in time.perf_counter: from when every stream had the
    # first token of its first request (the opening wave of prompts, all sent at once, is over) until
    # the first stream found no request left to start (None: an open loop, or no such stretch).
    steady: tuple[float, float] | None = None
    repeated_prompts: int = 0  # requests whose prompt an earlier level or repeat had sent
    draft_knew: int = 0  # drafting requests whose prompt a drafting run had sent before (any K)

    @property
    def tokens(self) -> int:
        return sum(r.tokens for r in self.results if not r.error)

    def tokens_in_steady_state(self) -> int | None:
        """Tokens that arrived in the steady state (`steady`), or None. The level's aggregate also
        counts its opening wave of prompts and its tail (streams finishing alone, in ever smaller
        batches); the steady state is what N streams sustain."""
        if self.steady is None:
            return None
        start, end = self.steady
        return sum(n for r in self.results if not r.error for t, n in r.arrivals if start <= r.sent_s + t <= end)


def _ms(value: float | None) -> float | None:
    return None if value is None else 1e3 * value


def aggregate(k, load: Load, runs: list[LevelRun]) -> dict:
    """One row: the runs of one (K, load) over the repeats, pooled (ratios are added by add_ratios)."""
    results = [r for run in runs for r in run.results]
    ok = [r for r in results if not r.error]
    seconds = sum(run.seconds for run in runs)
    tokens = sum(r.tokens for r in ok)
    drafted, rounds = sum(r.drafted for r in ok), sum(r.rounds for r in ok)
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    itls = [x for r in ok for x in r.itl_s]
    streams = [r.tokens / r.latency_s for r in ok if r.latency_s > 0]
    # Closed loops: the tokens and seconds of the steady state (`LevelRun.tokens_in_steady_state`).
    steady = [run.tokens_in_steady_state() for run in runs]
    steady = steady if all(n is not None for n in steady) else []
    steady_s = sum(run.steady[1] - run.steady[0] for run in runs) if steady else 0.0
    row = {
        "type": "row",
        "k": k,
        "load": load.label,
        "concurrency": load.concurrency,
        "request_rate": load.rate,
        "max_concurrency": load.max_concurrency,
        "repeats": len(runs),
        "requests": len(ok),
        "errors": len(results) - len(ok),
        "error_codes": dict(Counter(r.error for r in results if r.error)),
        "repeated_prompts": sum(run.repeated_prompts for run in runs),
        "draft_knew_prompts": sum(run.draft_knew for run in runs),
        "tokens": tokens,
        "seconds": seconds,
        "aggregate_tokens_per_s": tokens / seconds if seconds else 0.0,
        "aggregate_tokens_per_s_runs": [run.tokens / run.seconds if run.seconds else 0.0 for run in runs],
        "steady_seconds": steady_s if steady else None,
        "steady_tokens_per_s": sum(steady) / steady_s if steady and steady_s else None,
        "per_stream_tokens_per_s": sum(streams) / len(streams) if streams else None,
        "request_throughput": len(ok) / seconds if seconds else 0.0,
        "acceptance_rate": sum(r.accepted for r in ok) / drafted if drafted else None,
        "tokens_per_round": tokens / rounds if rounds else None,
        "latency_ms_p50": _ms(percentile([r.latency_s for r in ok], 50)),
    }
    for q in (50, 90, 99):
        row[f"ttft_ms_p{q}"] = _ms(percentile(ttfts, q))
        row[f"itl_ms_p{q}"] = _ms(percentile(itls, q))
    return row


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def add_ratios(rows: list[dict]) -> list[dict]:
    """Each row gets the ratio of its aggregate tok/s to the first level's at the same K (pooled, and
    the range of the per-repeat ratios), the same of its steady-state tok/s (closed loops), and the
    ratio to K = 0's at the same level. Rows in level order."""
    base_of = {}
    for r in rows:
        base_of.setdefault(r["k"], r)
    k0 = {r["load"]: r for r in rows if r["k"] == 0}
    for r in rows:
        base = base_of[r["k"]]
        per_repeat = [
            _ratio(a, b)
            for a, b in zip(r["aggregate_tokens_per_s_runs"], base["aggregate_tokens_per_s_runs"], strict=False)
        ]
        per_repeat = [x for x in per_repeat if x is not None]
        r["base"] = base["load"]
        r["ratio_vs_base"] = _ratio(r["aggregate_tokens_per_s"], base["aggregate_tokens_per_s"])
        r["ratio_vs_base_min"] = min(per_repeat) if per_repeat else None
        r["ratio_vs_base_max"] = max(per_repeat) if per_repeat else None
        steady = r.get("steady_tokens_per_s")
        r["steady_ratio_vs_base"] = None if steady is None else _ratio(steady, base.get("steady_tokens_per_s"))
        same_level = k0.get(r["load"])
        r["ratio_vs_k0"] = (
            _ratio(r["aggregate_tokens_per_s"], same_level["aggregate_tokens_per_s"]) if same_level else None
        )
    return rows


def schedule_order(ks: list, loads: list[Load], repeats: int) -> list[tuple[int, Load, object]]:
    """(repeat, load, K) in run order: every level once per repeat, the Ks at each level interleaved
    in an order rotated per level and repeat, so no K always runs first."""
    order = []
    for repeat in range(repeats):
        for i, load in enumerate(loads):
            order += [(repeat, load, k) for k in bench.rotated(ks, repeat + i)]
    return order


# ------------------------------------------------------------------ table


def _fmt(value, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def _pct(r: dict, name: str) -> str:
    return "/".join(_fmt(r[f"{name}_ms_p{q}"], ".0f") for q in (50, 90, 99))


def format_table(rows: list[dict]) -> str:
    header = (
        f"  {'load':<12} {'K':<5} {'reqs':>4} {'err':>3} {'agg tok/s':>9} {'x base':>16} {'steady tok/s':>12}"
        f" {'x base':>6} {'vs K=0':>6} {'stream':>6} {'req/s':>5}  {'TTFT ms p50/90/99':>18}  {'ITL ms p50/90/99':>17}"
        f"  {'accept':>6} {'tok/rnd':>7}"
    )
    lines = [header]
    for r in rows:
        spread = ""
        if r["repeats"] > 1 and r["ratio_vs_base_min"] is not None:
            spread = f" ({r['ratio_vs_base_min']:.2f}-{r['ratio_vs_base_max']:.2f})"
        lines.append(
            f"  {r['load']:<12} {r['k']!s:<5} {r['requests']:>4} {r['errors']:>3} {r['aggregate_tokens_per_s']:>9.2f} "
            f"{_fmt(r['ratio_vs_base'], '.2f', 'x') + spread:>16} {_fmt(r['steady_tokens_per_s'], '.2f'):>12} "
            f"{_fmt(r['steady_ratio_vs_base'], '.2f', 'x'):>6} {_fmt(r['ratio_vs_k0'], '.2f', 'x'):>6} "
            f"{_fmt(r['per_stream_tokens_per_s'], '.2f'):>6} {r['request_throughput']:>5.2f}  {_pct(r, 'ttft'):>18}  "
            f"{_pct(r, 'itl'):>17}  {_fmt(r['acceptance_rate'], '.3f'):>6} {_fmt(r['tokens_per_round'], '.2f'):>7}"
        )
    lines.append("  x base: aggregate tok/s / the first level's at the same K (range: lowest-highest per repeat)")
    lines.append(
        "  steady tok/s: a closed loop, from every stream's first token until the first"
        " ran out of requests (the aggregate also counts the opening wave of prompts and the tail)"
    )
    if repeated := sum(r["repeated_prompts"] for r in rows):
        lines.append(
            f"  {repeated} requests repeated a prompt sent earlier at their K (a suffix draft may know its answer)"
        )
    if knew := sum(r.get("draft_knew_prompts", 0) for r in rows):
        lines.append(
            f"  {knew} drafting requests sent a prompt that an earlier drafting run had sent, at any K: a suffix"
            " draft learns across sessions, so those rows may be favoured (compare Ks in separate runs)"
        )
    return "\n".join(lines)


# ------------------------------------------------------------------ running requests

Send = Callable[[int], RequestResult]  # request index within the level -> its result


def stream_one(client, prompt: str, **kwargs) -> RequestResult:
    """One GenerateStream, timed per chunk on arrival; a gRPC error is a result with its code."""
    import grpc

    started = time.perf_counter()
    arrivals: list[tuple[float, int]] = []  # (seconds since send, tokens in the chunk)
    stats, session = None, ""
    try:
        for chunk in client.stream(prompt, **kwargs):
            if chunk.token_ids:
                arrivals.append((time.perf_counter() - started, len(chunk.token_ids)))
            session = chunk.session_id or session
            if chunk.done:
                stats = chunk.stats
    except grpc.RpcError as exc:
        return RequestResult(time.perf_counter() - started, session_id=session, error=exc.code().name)
    latency = time.perf_counter() - started
    ttft, itls = chunk_latencies(arrivals)
    return RequestResult(
        latency,
        ttft,
        tuple(itls),
        sum(n for _, n in arrivals),
        stats.rounds if stats else 0,
        stats.drafted_tokens if stats else 0,
        stats.accepted_tokens if stats else 0,
        session,
        sent_s=started,
        arrivals=tuple(arrivals),
    )


def apportion(total: int, weights: Sequence[int]) -> list[int]:
    """`total` split over `weights` in proportion (largest remainders): the tokens of an OpenAI
    stream's chunks, known only as a sum (usage) and as texts (weights: their characters)."""
    if not weights:
        return []
    weights = [max(w, 1) for w in weights]
    shares = [total * w / sum(weights) for w in weights]
    parts = [math.floor(x) for x in shares]
    for i in sorted(range(len(parts)), key=lambda i: parts[i] - shares[i])[: total - sum(parts)]:
        parts[i] += 1
    return parts


class OpenAIEndpoint:
    """An OpenAI-compatible server (`--openai-url`): each request one streamed chat/completions (or
    completions) call over HTTP, timed per chunk on arrival."""

    def __init__(self, url: str, model: str = "", api_key: str = "", timeout_s: float = 900.0):
        import httpx

        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        self.http = httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=timeout_s, limits=limits)
        self.model = model

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.http.close()

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        """Until GET /models answers; the model defaults to the first it lists."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                response = self.http.get("/models")
                response.raise_for_status()
                break
            except Exception:  # not up yet
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        self.model = self.model or response.json()["data"][0]["id"]

    def request(self, prompt: str, **kwargs) -> tuple[str, dict]:
        """(path, JSON body) of one streamed request with the plan's parameters."""
        body = {"model": self.model, "max_tokens": kwargs["max_new_tokens"], "temperature": kwargs["temperature"]}
        body |= {"seed": kwargs["seed"], "ignore_eos": kwargs["ignore_eos"], "stream": True}
        body["stream_options"] = {"include_usage": True}
        if kwargs.get("num_speculative_tokens") is not None:
            body["num_speculative_tokens"] = kwargs["num_speculative_tokens"]
        if kwargs["chat"]:
            return "/chat/completions", {**body, "messages": [{"role": "user", "content": prompt}]}
        return "/completions", {**body, "prompt": prompt}

    def stream_one(self, prompt: str, **kwargs) -> RequestResult:
        started = time.perf_counter()
        path, body = self.request(prompt, **kwargs)
        try:
            with self.http.stream("POST", path, json=body) as response:
                if response.status_code != 200:
                    response.read()
                    return RequestResult(time.perf_counter() - started, error=f"HTTP_{response.status_code}")
                return self._read(response, started)
        except Exception as exc:  # noqa: BLE001 - a failed request is a result
            return RequestResult(time.perf_counter() - started, error=type(exc).__name__)

    @staticmethod
    def _read(response, started: float) -> RequestResult:
        arrivals, tokens, stats = [], 0, {}  # arrivals: (seconds since send, characters)
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line.removeprefix("data: "))
            if "error" in event:
                return RequestResult(time.perf_counter() - started, error=str(event["error"].get("code", "error")))
            for choice in event.get("choices") or ():
                text = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                if text:
                    arrivals.append((time.perf_counter() - started, len(text)))
            tokens = (event.get("usage") or {}).get("completion_tokens", tokens)
            stats = event.get("specdec") or stats
        latency = time.perf_counter() - started
        counts = apportion(tokens, [n for _, n in arrivals])
        chunks = tuple((t, n) for (t, _), n in zip(arrivals, counts, strict=True) if n)
        ttft, itls = chunk_latencies(chunks)
        get = stats.get
        return RequestResult(
            latency, ttft, tuple(itls), tokens, get("rounds", 0), get("drafted_tokens", 0),
            get("accepted_tokens", 0), get("session_id", ""), sent_s=started, arrivals=chunks,
        )  # fmt: skip

    def delete_session(self, session_id: str) -> None:
        """Nothing: HTTP has no call for it; the gateway's sessions expire with their TTL."""


def _join(threads: list[threading.Thread]) -> None:
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def run_closed_loop(send: Send, concurrency: int, requests: int | None, duration_s: float | None) -> LevelRun:
    """`concurrency` streams, each starting the next request when its last ends, until `requests` have
    started or `duration_s` has passed (whichever comes first; at least one must be set)."""
    if requests is None and duration_s is None:
        raise ValueError("a closed loop needs a request count or a duration")
    counter, lock, results = itertools.count(), threading.Lock(), []
    first_tokens, idle = [], []  # per stream: its first request's first token; when it ran out of work
    started = time.perf_counter()

    def stream() -> None:
        first = True
        while True:
            with lock:
                i = next(counter)
            if (requests is not None and i >= requests) or (
                duration_s is not None and time.perf_counter() - started >= duration_s
            ):
                idle.append(time.perf_counter())
                return
            result = send(i)
            results.append(result)  # list.append is atomic
            if first:
                first_tokens.append(result.sent_s + result.ttft_s if result.ttft_s is not None else time.perf_counter())
                first = False
            if result.error:
                time.sleep(ERROR_PAUSE_S)  # a refused stream must not spin

    _join([threading.Thread(target=stream, daemon=True) for _ in range(concurrency)])
    steady = (max(first_tokens), min(idle)) if len(first_tokens) == concurrency else None
    return LevelRun(results, time.perf_counter() - started, steady if steady and steady[0] < steady[1] else None)


def run_open_loop(send: Send, schedule: list[float], max_concurrency: int | None = None) -> LevelRun:
    """A request at each offset of `schedule`, each in its own stream; with `max_concurrency`, an
    arrival waits until fewer than that many are in flight (vllm's --max-concurrency)."""
    slots = threading.BoundedSemaphore(max_concurrency) if max_concurrency else None
    results, threads = [], []
    started = time.perf_counter()

    def one(i: int) -> None:
        try:
            results.append(send(i))
        finally:
            if slots:
                slots.release()

    for i, at in enumerate(schedule):
        time.sleep(max(0.0, started + at - time.perf_counter()))
        if slots:
            slots.acquire()
        threads.append(threading.Thread(target=one, args=(i,), daemon=True))
        threads[-1].start()
    for t in threads:
        t.join()
    return LevelRun(results, time.perf_counter() - started)


@dataclass(frozen=True)
class Plan:
    prompts: list[str]
    ks: list  # 0 first; ints and "auto"
    loads: list[Load]
    num_prompts: int | None  # None: each level's default, unless a duration is given
    duration_s: float | None
    max_new_tokens: int
    temperature: float = 0.0
    ignore_eos: bool = True
    chat: bool = True
    repeats: int = 1
    seed: int = 0
    same_prompts: bool = False  # every level sends the first prompts, not the next ones
    runs: dict = field(default_factory=dict)  # (k, load) -> [LevelRun], one per repeat

    def requests_for(self, load: Load) -> int | None:
        """--num-prompts, else none with --duration (the duration ends the level), else the level's default."""
        if self.num_prompts is not None:
            return self.num_prompts
        return None if self.duration_s is not None else load.default_requests()

    def arrivals(self, load: Load) -> list[float]:
        """A Poisson level's arrival offsets: --num-prompts of them, those before --duration, or both."""
        n = self.requests_for(load)
        if n is None:  # duration only: more arrivals than the window can hold (mean + a wide margin)
            n = load.default_requests() if math.isinf(load.rate) else math.ceil(3 * load.rate * self.duration_s) + 10
        schedule = poisson_schedule(load.rate, n, self.seed)
        if self.duration_s is not None:
            schedule = [at for at in schedule if at < self.duration_s] or schedule[:1]
        return schedule

    def peak_streams(self) -> int:
        """The most streams this plan keeps in flight at once."""
        peaks = []
        for load in self.loads:
            if load.concurrency is not None:
                peaks.append(load.concurrency)
            else:
                arrivals = len(self.arrivals(load))
                peaks.append(min(load.max_concurrency or arrivals, arrivals))
        return max(peaks)

    def request_kwargs(self, k, seed: int, max_new_tokens: int | None = None) -> dict:
        return {
            "max_new_tokens": max_new_tokens or self.max_new_tokens,
            "temperature": self.temperature,
            "seed": seed,
            "num_speculative_tokens": None if k == "auto" else k,  # unset: the coordinator's auto K
            "ignore_eos": self.ignore_eos,
            "chat": self.chat,
        }


def send_one(client, prompt: str, **kwargs) -> RequestResult:
    """One streamed request through the coordinator's gRPC (SpecdecClient) or an OpenAI endpoint."""
    if isinstance(client, OpenAIEndpoint):
        return client.stream_one(prompt, **kwargs)
    return stream_one(client, prompt, **kwargs)


def run_level(client, plan: Plan, load: Load, k, first: int = 0, level: int = 0) -> LevelRun:
    """One (load, K), the run's `level`-th level: its requests, then its sessions deleted (outside
    the timing). Request i sends prompt first + i (cycled) with seed --seed + first + i."""

    def send(i: int) -> RequestResult:
        prompt = opening(plan, k, level) + plan.prompts[(first + i) % len(plan.prompts)]
        return send_one(client, prompt, **plan.request_kwargs(k, plan.seed + first + i))

    if load.concurrency is not None:
        run = run_closed_loop(send, load.concurrency, plan.requests_for(load), plan.duration_s)
    else:
        run = run_open_loop(send, plan.arrivals(load), load.max_concurrency)
    delete_sessions(client, run.results)
    run.repeated_prompts = min(len(run.results), max(0, first + len(run.results) - len(plan.prompts)))
    if plan.same_prompts and level > 0:
        run.repeated_prompts = len(run.results)  # every one was sent at this K by an earlier level
    return run


def opening(plan: Plan, k, level: int = 0) -> str:
    """What each K's prompts open with, a tag of its own: the target keeps deleted sessions' KV
    caches and starts a new session from the cached entry that shares its longest prefix, so a K
    sending the same prompts after another could skip their prefill (measured, 8 streams: auto K
    run after K=0 and drafting almost nothing, 1.07 tokens a round, gave 1.32x of K=0). With its
    own tag after the shared system prompt, every K's requests run their prompts' forwards. With
    --same-prompts every level sends the same prompts too, so the tag names the level as well."""
    if plan.same_prompts:
        return f"({level + 1}.{plan.ks.index(k) + 1}) "
    return f"({plan.ks.index(k) + 1}) "


def delete_sessions(client, results: list[RequestResult]) -> None:
    """The requests' sessions, so Redis holds only what a level is running."""
    for r in results:
        if r.session_id:
            try:
                client.delete_session(r.session_id)
            except Exception as exc:  # noqa: BLE001 - cleanup only: Redis keeps a stray session until its TTL
                bench.log(f"could not delete session {r.session_id}: {exc}")


def warm_up(client, plan: Plan) -> None:
    """One short request per K: first calls allocate caches and buffers. On the last prompt, the one
    the levels reach last."""
    kwargs = [plan.request_kwargs(k, plan.seed, max_new_tokens=8) for k in plan.ks]
    delete_sessions(client, [send_one(client, plan.prompts[-1], **kw) for kw in kwargs])


def bench_stack(client, plan: Plan) -> list[dict]:
    """Every (repeat, load, K) in schedule_order; one row per (K, load), in load order. The Ks of one
    level send the same prompts; each level the next ones, so no prompt is sent twice at one K until
    the run has used them all (a suffix draft learns answers across sessions: at T = 0 it would propose
    a repeated prompt's answer whole)."""
    warm_up(client, plan)
    # Prompts a draft was sent (K = 0 calls no draft): at T = 0 a suffix draft then knows their answers.
    drafted = {len(plan.prompts) - 1} if any(k != 0 for k in plan.ks) else set()
    level, index, first, used = None, -1, 0, 0
    for repeat, load, k in schedule_order(plan.ks, plan.loads, plan.repeats):
        if (repeat, load) != level:
            first = 0 if plan.same_prompts else first + used
            level, index, used = (repeat, load), index + 1, 0
        run = run_level(client, plan, load, k, first, index)
        used = max(used, len(run.results))
        if k != 0:
            sent = [(first + i) % len(plan.prompts) for i in range(len(run.results))]
            run.draft_knew = sum(i in drafted for i in sent)
            drafted.update(sent)
        plan.runs.setdefault((k, load), []).append(run)
        bench.log(
            f"repeat {repeat + 1}/{plan.repeats} {load.label:<12} K={k!s:<5} {len(run.results)} requests "
            f"{run.tokens / run.seconds if run.seconds else 0:7.2f} tok/s in {run.seconds:.1f}s"
            + (f", {sum(1 for r in run.results if r.error)} errors" if any(r.error for r in run.results) else "")
        )
    rows = [aggregate(k, load, plan.runs[(k, load)]) for load in plan.loads for k in plan.ks]
    return add_ratios(rows)


# ------------------------------------------------------------------ the stack


def stack_env(args, drafter: bench.Drafter, peak_streams: int) -> dict[str, str]:
    """The services' environment: the pair (as bench.py sets it), metrics on free ports, admission
    raised to `peak_streams` where the environment does not set it."""
    env = bench.pair_env(args.target, drafter)
    for settings in _service_settings():
        prefix, defaults = settings.ENV_PREFIX, {f.name: f.default for f in dataclasses.fields(settings)}
        env[prefix + "METRICS_PORT"] = "0"  # no clash with a `make up` stack's 9101..9103
        admitted = max(defaults["max_concurrent_requests"], peak_streams)
        workers = max(defaults["max_workers"], admitted + 8)  # above admission: health probes need threads
        limits = {"MAX_CONCURRENT_REQUESTS": admitted, "MAX_WORKERS": workers}
        for name, value in limits.items():
            env[prefix + name] = os.environ.get(prefix + name, str(value))
    return env


def _service_settings() -> list[type]:
    from coordinator.settings import CoordinatorSettings
    from draft_service.settings import DraftSettings
    from target_service.settings import TargetSettings

    return [CoordinatorSettings, DraftSettings, TargetSettings]


@contextmanager
def private_stack(env: dict[str, str]) -> Iterator[str]:
    """stack.up() on free ports with its state and logs in .run/serve-bench-<pid>/ (not the shared
    .run/stack.json of `make up`); yields the coordinator's address; always stopped."""
    from specdec.local_redis import free_port

    run_dir = stack.ROOT / ".run" / f"serve-bench-{os.getpid()}"
    run_dir.mkdir(parents=True, exist_ok=True)  # stack.up() makes only the last level
    names = ("RUN_DIR", "STATE", "COORDINATOR_PORT", "DRAFT_PORT", "TARGET_PORT", "GATEWAY_PORT")
    saved = {name: getattr(stack, name) for name in names}
    stack.RUN_DIR, stack.STATE = run_dir, run_dir / "stack.json"
    stack.COORDINATOR_PORT, stack.DRAFT_PORT, stack.TARGET_PORT = free_port(), free_port(), free_port()
    stack.GATEWAY_PORT = 0  # chosen when the gateway starts
    try:
        with bench._environment(env), redirect_stdout(sys.stderr):  # stdout carries only results
            address = stack.up()["coordinator"]
        try:
            yield address
        finally:
            with redirect_stdout(sys.stderr):
                stack.down()
    finally:
        for name, value in saved.items():
            setattr(stack, name, value)
    bench.log(f"stack logs: {run_dir}")


@contextmanager
def open_client(args, drafter: bench.Drafter, peak_streams: int):
    from specdec.client import SpecdecClient

    if args.openai_url:
        with OpenAIEndpoint(args.openai_url, args.model or "", args.api_key or "") as endpoint:
            endpoint.wait_ready(60)
            yield endpoint
        return
    started = nullcontext(args.address) if args.address else _started(args, drafter, peak_streams)
    with started as address, SpecdecClient(address, timeout_s=900) as client:
        client.wait_ready(60)
        yield client


@contextmanager
def _started(args, drafter: bench.Drafter, peak_streams: int) -> Iterator[str]:
    drafts = f"{drafter.model} {drafter.lookup}"
    bench.log(f"starting the stack: target {args.target} {drafter.target_lookup}, draft {drafts}")
    with private_stack(stack_env(args, drafter, peak_streams)) as address:
        yield address


# ------------------------------------------------------------------ command line


def parse_levels(text: str, kind: Callable[[str], float]) -> list:
    """'1,4,8' -> [1, 4, 8] (duplicates dropped, order kept); ValueError for a non-positive value."""
    out = []
    for item in (part.strip() for part in text.split(",") if part.strip()):
        value = kind(item)
        if not value > 0:
            raise ValueError(f"load levels must be > 0, got {item!r}")
        if value not in out:
            out.append(value)
    if not out:
        raise ValueError("no load levels given")
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--address", help="a running coordinator (default: start the stack as processes)")
    p.add_argument("--target", default=os.environ.get("SPECDEC_TARGET_MODEL", stack.DEFAULT_TARGET))
    p.add_argument("--drafter", default=DEFAULT_DRAFTER, help=f"one of {', '.join(bench.DRAFTERS)} or LABEL=SPEC")
    p.add_argument("--draft", default=bench.DISTILLED_DRAFT, help="the draft of the `model` drafter")
    p.add_argument(
        "--ks",
        default=None,
        help="comma list of K, interleaved (0 is always added; default 0,auto, or auto alone with --openai-url)",
    )
    p.add_argument("--openai-url", help="an OpenAI-compatible server's base URL, e.g. http://HOST:8000/v1 (see above)")
    p.add_argument("--model", help="with --openai-url: the model to request (default: the first of GET /models)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="with --openai-url: a bearer key")
    p.add_argument("--concurrency", default=None, help="comma list of closed-loop stream counts (default 1,4,8)")
    p.add_argument("--request-rate", default=None, help="comma list of Poisson arrival rates, requests/s (inf ok)")
    p.add_argument("--max-concurrency", type=int, default=None, help="with --request-rate: most streams in flight")
    p.add_argument("--num-prompts", type=int, default=None, help="requests per level and K (default: see above)")
    p.add_argument("--duration", type=float, default=None, help="seconds per level and K; stop starting requests")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True, help="the chat template")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help="comma list of built-in workloads")
    p.add_argument("--per-workload", type=int, default=6, help="prompts per built-in workload (at most 6)")
    p.add_argument("--max-chars", type=int, default=1200, help="longest passage of a built-in prompt (~4 per token)")
    p.add_argument("--prompts", metavar="FILE", help="JSONL prompts (workloads.py format; first turns used)")
    p.add_argument("--repeats", type=int, default=1, help="every level and K this many times, interleaved")
    p.add_argument(
        "--same-prompts",
        action="store_true",
        help="every level sends the same prompts (each level and K behind its own opening), so levels compare alike",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--background-load", type=int, default=0, metavar="N", help="N busy CPU processes")
    p.add_argument("--json", nargs="?", const="-", metavar="FILE", help="JSON rows on stdout (no table), or into FILE")
    return p.parse_args(argv)


def build_plan(args: argparse.Namespace) -> Plan:
    """The plan from the arguments; ValueError for anything wrong."""
    if args.concurrency and args.request_rate:
        raise ValueError("give --concurrency or --request-rate, not both")
    if args.openai_url and args.address:
        raise ValueError("give --address (gRPC) or --openai-url (HTTP), not both")
    if args.max_concurrency is not None and not args.request_rate:
        raise ValueError("--max-concurrency caps --request-rate; with --concurrency the level is the cap")
    for name in ("num_prompts", "max_concurrency", "repeats", "max_new_tokens"):
        if (value := getattr(args, name)) is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.duration is not None and args.duration <= 0:
        raise ValueError(f"--duration must be > 0, got {args.duration}")
    if args.request_rate:
        loads = [Load(rate=r, max_concurrency=args.max_concurrency) for r in parse_levels(args.request_rate, float)]
    else:
        loads = [Load(concurrency=c) for c in parse_levels(args.concurrency or "1,4,8", int)]
    if args.prompts:
        conversations = workloads.load_prompts(args.prompts)
    else:
        names = tuple(w.strip() for w in args.workloads.split(",") if w.strip())
        conversations = workloads.build_workloads(names, args.per_workload, args.max_chars)
    return Plan(
        prompts=[c.prompt for c in conversations],
        ks=["auto"] if args.openai_url and args.ks is None else bench.parse_ks(args.ks or "0,auto"),
        loads=loads,
        num_prompts=args.num_prompts,
        duration_s=args.duration,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        ignore_eos=args.ignore_eos,
        chat=args.chat,
        repeats=args.repeats,
        same_prompts=args.same_prompts,
        seed=args.seed,
    )


def git_commit() -> str:
    """HEAD, with "+dirty" when the working tree has changes; "" outside git."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True)
        dirty = subprocess.run(
            ["git", "status", "--porcelain"], check=False, cwd=ROOT, capture_output=True, text=True
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return ""
    return head.stdout.strip() + ("+dirty" if dirty.strip() else "")


def run_info(args, plan: Plan, drafter: bench.Drafter) -> dict:
    return {
        "type": "run",
        "target": args.target,
        # What a stack started here serves the target with (one given by --address: its own setting).
        "matmul_dtype": None if args.address else os.environ.get(stack.MATMUL_DTYPE_ENV, stack.DEFAULT_MATMUL_DTYPE),
        "drafter": {"label": drafter.label} | {f: getattr(drafter, f) for f in ("model", "lookup", "target_lookup")},
        "address": args.address,
        "openai_url": args.openai_url,
        "model": args.model,
        "commit": git_commit(),
        "ks": plan.ks,
        "loads": [load.label for load in plan.loads],
        "num_prompts": plan.num_prompts,
        "duration_s": plan.duration_s,
        "max_new_tokens": plan.max_new_tokens,
        "temperature": plan.temperature,
        "ignore_eos": plan.ignore_eos,
        "chat": plan.chat,
        "repeats": plan.repeats,
        "seed": plan.seed,
        "prompts": len(plan.prompts),
        "background_load": args.background_load,
        **hostinfo.describe(),  # cpus, cpu, isa
        "python": sys.version.split()[0],
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        plan = build_plan(args)
        drafter = bench.parse_drafter(args.drafter, args.draft)
    except ValueError as exc:  # PromptFileError included
        raise SystemExit(f"serve_bench.py: error: {exc}") from None
    set_openmp_defaults()  # the started services inherit it, as under `make up`
    info = run_info(args, plan, drafter)
    with bench.background_load(args.background_load), open_client(args, drafter, plan.peak_streams()) as client:
        rows = bench_stack(client, plan)
    if args.json == "-":
        for obj in (info, *rows):
            print(json.dumps(obj), flush=True)
        return 0
    if args.json:
        Path(args.json).write_text("".join(json.dumps(obj) + "\n" for obj in (info, *rows)))
    print(
        f"\n{drafter.label} draft, target {args.target} (MATMUL_DTYPE {info['matmul_dtype'] or 'its own'}), "
        f"{plan.max_new_tokens} new tokens, T={plan.temperature:g}, "
        f"{len(plan.prompts)} prompts, {plan.repeats} repeat(s), {hostinfo.summary(info)}, commit {info['commit'][:12]}"
    )
    print(format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
