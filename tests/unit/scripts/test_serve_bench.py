"""scripts/serve_bench.py: its statistics (percentiles, a seeded Poisson schedule, TTFT / ITL from
chunk times, rows pooled over repeats, ratios), its closed and open loops' concurrency, and one run
end to end against the real gRPC services (tiny models, in process) that produces every row."""

from __future__ import annotations

import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import grpc
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "scripts"))

import serve_bench
from serve_bench import LevelRun, Load, RequestResult

ROW_FIELDS = {
    "type", "k", "load", "concurrency", "request_rate", "max_concurrency", "repeats", "requests", "errors", "repeated_prompts",
    "draft_knew_prompts", "error_codes", "tokens", "seconds", "aggregate_tokens_per_s", "aggregate_tokens_per_s_runs",
    "per_stream_tokens_per_s", "request_throughput", "ttft_ms_p50", "ttft_ms_p90", "ttft_ms_p99", "itl_ms_p50",
    "itl_ms_p90", "itl_ms_p99", "latency_ms_p50", "acceptance_rate", "tokens_per_round", "base", "ratio_vs_base",
    "ratio_vs_base_min", "ratio_vs_base_max", "ratio_vs_k0", "steady_seconds", "steady_tokens_per_s",
    "steady_ratio_vs_base",
}  # fmt: skip


# ------------------------------------------------------------------ pure parts


@pytest.mark.parametrize("values", [[3.0], [5.0, 1.0], [0.4, 2.5, 9.0, 1.0, 7.5, 3.3, 2.2]])
@pytest.mark.parametrize("q", [0, 50, 90, 99, 100])
def test_percentile_matches_numpys_linear_interpolation(values, q):
    assert serve_bench.percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_percentile_of_nothing_is_none():
    assert serve_bench.percentile([], 50) is None


def test_poisson_schedule_is_seeded_with_exponential_gaps_of_mean_one_over_rate():
    schedule = serve_bench.poisson_schedule(4.0, 4000, seed=7)
    assert schedule == serve_bench.poisson_schedule(4.0, 4000, seed=7)
    assert schedule != serve_bench.poisson_schedule(4.0, 4000, seed=8)
    gaps = np.diff([0.0, *schedule])
    assert len(schedule) == 4000 and (gaps >= 0).all()
    # Exponential: mean = sd = 1/rate (each within 5%: ~3 standard errors at n = 4000).
    assert gaps.mean() == pytest.approx(0.25, rel=0.05) and gaps.std() == pytest.approx(0.25, rel=0.05)
    assert serve_bench.poisson_schedule(float("inf"), 3, seed=0) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="rate must be > 0"):
        serve_bench.poisson_schedule(0.0, 3, seed=0)


def test_ttft_is_the_first_token_chunk_and_itl_is_per_token():
    # A first chunk of 2 tokens at 0.5 s, then 1 token 0.2 s later, then 3 tokens 0.6 s after that.
    ttft, itls = serve_bench.chunk_latencies([(0.5, 2), (0.7, 1), (1.3, 3)])
    assert ttft == 0.5
    assert itls == pytest.approx([0.2, 0.2, 0.2, 0.2])
    assert serve_bench.chunk_latencies([]) == (None, [])
    assert serve_bench.chunk_latencies([(0.1, 4)]) == (0.1, [])


def _result(tokens: int, latency: float, ttft: float, itl: float, rounds: int, drafted: int, accepted: int):
    return RequestResult(latency, ttft, (itl,) * (tokens - 1), tokens, rounds, drafted, accepted, "s")


def test_rows_pool_the_repeats_of_one_k_and_load():
    runs = [
        LevelRun([_result(10, 2.0, 0.2, 0.2, 5, 8, 5), RequestResult(0.1, error="RESOURCE_EXHAUSTED")], 2.0),
        LevelRun([_result(10, 1.0, 0.1, 0.1, 4, 8, 6), _result(10, 1.0, 0.3, 0.1, 4, 8, 6)], 2.0),
    ]
    row = serve_bench.aggregate("auto", Load(concurrency=2), runs)
    assert row["load"] == "c=2" and row["k"] == "auto" and row["repeats"] == 2
    assert row["requests"] == 3 and row["errors"] == 1 and row["error_codes"] == {"RESOURCE_EXHAUSTED": 1}
    assert row["tokens"] == 30 and row["seconds"] == 4.0
    assert row["aggregate_tokens_per_s"] == 7.5 and row["aggregate_tokens_per_s_runs"] == [5.0, 10.0]
    assert row["per_stream_tokens_per_s"] == pytest.approx((5 + 10 + 10) / 3)
    assert row["request_throughput"] == 0.75
    assert row["acceptance_rate"] == pytest.approx(17 / 24) and row["tokens_per_round"] == pytest.approx(30 / 13)
    assert row["ttft_ms_p50"] == pytest.approx(200) and row["ttft_ms_p99"] == pytest.approx(298)
    assert row["itl_ms_p50"] == pytest.approx(100) and row["itl_ms_p99"] == pytest.approx(200)
    assert row["latency_ms_p50"] == pytest.approx(1000)


def _streamed(sent: float, *chunks: tuple[float, int]) -> RequestResult:
    return RequestResult(1.0, tokens=sum(n for _, n in chunks), sent_s=sent, arrivals=chunks)


def test_the_steady_state_counts_the_tokens_between_the_last_first_token_and_the_first_idle_stream():
    # Two streams from t = 100; both had their first token by 101, the first ran out of requests at
    # t = 102, the other ran on to 104.
    run = LevelRun(
        [
            _streamed(100.0, (0.5, 10), (1.5, 10)),  # 100.5 (the opening wave) and 101.5
            _streamed(100.0, (1.0, 10), (2.5, 10)),  # 101.0 and 102.5 (the tail)
            _streamed(101.5, (0.5, 5), (1.0, 5), (2.0, 5)),  # 102.0, 102.5, 103.5
            RequestResult(0.1, error="UNAVAILABLE", sent_s=100.0, arrivals=((1.2, 9),)),
        ],
        4.0,
        steady=(101.0, 102.0),
    )
    assert run.tokens_in_steady_state() == 10 + 10 + 5
    row = serve_bench.aggregate(0, Load(concurrency=2), [run, run])
    assert row["steady_seconds"] == 2.0 and row["steady_tokens_per_s"] == 25
    assert row["aggregate_tokens_per_s"] == 55 / 4
    # An open loop has no such window.
    open_row = serve_bench.aggregate(0, Load(rate=1.0), [LevelRun(run.results, 4.0)])
    assert open_row["steady_tokens_per_s"] is None and open_row["steady_seconds"] is None


def test_a_level_of_only_errors_still_makes_a_row():
    row = serve_bench.aggregate(0, Load(rate=2.0), [LevelRun([RequestResult(0.1, error="UNAVAILABLE")], 0.1)])
    assert row["requests"] == 0 and row["errors"] == 1 and row["aggregate_tokens_per_s"] == 0.0
    assert row["ttft_ms_p50"] is None and row["acceptance_rate"] is None and row["load"] == "r=2"


def _row(k, load: str, runs: list[float]) -> dict:
    return {"k": k, "load": load, "aggregate_tokens_per_s": statistics.mean(runs), "aggregate_tokens_per_s_runs": runs}


def test_ratios_to_the_first_level_of_the_same_k_and_to_k0_of_the_same_level():
    rows = serve_bench.add_ratios(
        [
            _row(0, "c=1", [10, 12]),
            _row("auto", "c=1", [20, 20]),
            _row(0, "c=4", [30, 24]),
            _row("auto", "c=4", [40, 40]),
        ]
    )
    by = {(r["k"], r["load"]): r for r in rows}
    assert by[(0, "c=4")]["ratio_vs_base"] == pytest.approx(27 / 11) and by[(0, "c=4")]["base"] == "c=1"
    assert (by[(0, "c=4")]["ratio_vs_base_min"], by[(0, "c=4")]["ratio_vs_base_max"]) == (2.0, 3.0)
    assert by[("auto", "c=4")]["ratio_vs_base"] == 2.0 and by[("auto", "c=1")]["ratio_vs_base"] == 1.0
    assert by[("auto", "c=1")]["ratio_vs_k0"] == pytest.approx(20 / 11) and by[(0, "c=1")]["ratio_vs_k0"] == 1.0
    assert by[(0, "c=4")]["steady_ratio_vs_base"] is None  # rows without a steady-state figure
    steady = serve_bench.add_ratios([{**_row(0, "c=1", [10]), "steady_tokens_per_s": 10.0},
                                   {**_row(0, "c=8", [25]), "steady_tokens_per_s": 32.0}])  # fmt: skip
    assert steady[1]["steady_ratio_vs_base"] == 3.2 and steady[1]["ratio_vs_base"] == 2.5


def test_every_load_and_k_runs_once_per_repeat_with_the_k_order_rotated():
    loads = [Load(concurrency=1), Load(concurrency=4)]
    order = serve_bench.schedule_order([0, "auto"], loads, repeats=2)
    assert sorted((r, load.concurrency, str(k)) for r, load, k in order) == sorted(
        (r, c, str(k)) for r in range(2) for c in (1, 4) for k in (0, "auto")
    )
    firsts = [k for i, (_, _, k) in enumerate(order) if i % 2 == 0]
    assert firsts == [0, "auto", "auto", 0]


def test_default_request_counts():
    assert Load(concurrency=1).default_requests() == 4 and Load(concurrency=8).default_requests() == 16
    assert Load(rate=2.0).default_requests() == 20 and Load(rate=0.1).default_requests() == 4
    plan = serve_bench.build_plan(serve_bench.parse_args(["--request-rate", "2", "--duration", "3", "--seed", "1"]))
    arrivals = plan.arrivals(plan.loads[0])
    assert arrivals and max(arrivals) < 3 and plan.requests_for(plan.loads[0]) is None
    capped = serve_bench.build_plan(serve_bench.parse_args(["--request-rate", "inf", "--max-concurrency", "3"]))
    assert capped.peak_streams() == 3
    assert serve_bench.build_plan(serve_bench.parse_args(["--concurrency", "2,16"])).peak_streams() == 16


# ------------------------------------------------------------------ the loops


class InFlight:
    """A fake request that takes `seconds` and records how many ran at once and when each started."""

    def __init__(self, seconds: float):
        self.seconds, self.now, self.peak, self.starts = seconds, 0, 0, []
        self.lock = threading.Lock()

    def __call__(self, i: int) -> RequestResult:
        with self.lock:
            self.now += 1
            self.peak = max(self.peak, self.now)
            sent = time.perf_counter()
            self.starts.append((i, sent))
        time.sleep(self.seconds)
        with self.lock:
            self.now -= 1
        return RequestResult(self.seconds, self.seconds, (), 1, sent_s=sent)


def test_closed_loop_keeps_n_streams_in_flight_until_the_count():
    send = InFlight(0.05)
    run = serve_bench.run_closed_loop(send, concurrency=4, requests=10, duration_s=None)
    assert len(run.results) == 10 and send.peak == 4
    assert sorted(i for i, _ in send.starts) == list(range(10))
    # 10 requests on 4 streams take 3 request times (4 + 4 + 2); one after the other, 10.
    assert 0.15 <= run.seconds < 0.5
    # The steady state: from the first wave's first tokens (at its end: InFlight's TTFT is its whole
    # time) until the first stream found no request left, while two streams ran the last two.
    first_wave_end = max(t for i, t in send.starts if i < 4) + 0.05
    assert run.steady[0] == pytest.approx(first_wave_end, abs=0.02) and run.steady[1] - run.steady[0] >= 0.04
    assert run.steady[1] < min(t for _, t in send.starts) + run.seconds - 0.03


def test_closed_loop_stops_starting_requests_after_the_duration():
    send = InFlight(0.05)
    called = time.perf_counter()
    run = serve_bench.run_closed_loop(send, concurrency=2, requests=None, duration_s=0.2)
    assert 4 <= len(run.results) <= 10 and send.peak == 2
    assert all(t - called < 0.2 for _, t in send.starts) and run.seconds >= 0.2


def test_open_loop_sends_on_schedule_and_caps_the_streams_in_flight():
    send = InFlight(0.1)
    schedule = [0.0, 0.0, 0.0, 0.05, 0.3]
    called = time.perf_counter()
    run = serve_bench.run_open_loop(send, schedule, max_concurrency=2)
    assert len(run.results) == 5 and send.peak == 2
    assert dict(send.starts)[4] - called >= 0.3  # the fifth arrival waited for its time
    assert run.seconds >= 0.4  # ... and the level lasted until it ended
    unbounded = InFlight(0.1)
    serve_bench.run_open_loop(unbounded, [0.0] * 5)
    assert unbounded.peak == 5


class FakeRpcError(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.RESOURCE_EXHAUSTED


class FakeClient:
    """client.stream: two token chunks, then the final chunk with stats; or an error after the first."""

    def __init__(self, fail: bool = False):
        self.fail = fail

    def stream(self, prompt, **kwargs):
        yield SimpleNamespace(token_ids=[1, 2], session_id="s1", done=False, stats=None)
        if self.fail:
            raise FakeRpcError()
        time.sleep(0.01)
        yield SimpleNamespace(token_ids=[3], session_id="s1", done=False, stats=None)
        stats = SimpleNamespace(rounds=2, drafted_tokens=3, accepted_tokens=1)
        yield SimpleNamespace(token_ids=[], session_id="s1", done=True, stats=stats)


def test_stream_one_times_chunks_and_reads_the_final_stats():
    result = serve_bench.stream_one(FakeClient(), "hi", max_new_tokens=3)
    assert result.tokens == 3 and result.rounds == 2 and result.drafted == 3 and result.accepted == 1
    assert result.session_id == "s1" and not result.error
    assert len(result.itl_s) == 1 and result.itl_s[0] >= 0.01 and result.ttft_s <= result.latency_s
    assert [n for _, n in result.arrivals] == [2, 1] and result.arrivals[0][0] == result.ttft_s
    assert result.sent_s > 0
    failed = serve_bench.stream_one(FakeClient(fail=True), "hi")
    assert failed.error == "RESOURCE_EXHAUSTED" and failed.session_id == "s1"


class RecordingClient:
    """client.stream answers one 1-token chunk and records (prompt, seed, K); sessions are deleted."""

    def __init__(self):
        self.sent, self.deleted = [], []

    def stream(self, prompt, **kwargs):
        self.sent.append((prompt, kwargs["seed"], kwargs["num_speculative_tokens"]))
        stats = SimpleNamespace(rounds=1, drafted_tokens=0, accepted_tokens=0)
        yield SimpleNamespace(token_ids=[1], session_id=f"s{len(self.sent)}", done=True, stats=stats)

    def delete_session(self, session_id):
        self.deleted.append(session_id)


def test_every_k_of_a_level_sends_the_same_prompts_and_levels_the_next_ones():
    argv = ["--concurrency", "1,2", "--ks", "auto", "--num-prompts", "2", "--repeats", "2", "--per-workload", "1"]
    plan = serve_bench.build_plan(serve_bench.parse_args(argv))
    assert len(plan.prompts) == 5
    client = RecordingClient()
    rows = serve_bench.bench_stack(client, plan)
    warm, measured = client.sent[:2], client.sent[2:]
    assert {p for p, _, _ in warm} == {plan.prompts[-1]}
    by_k = {k: sorted((p, seed) for p, seed, kk in measured if kk == k) for k in (0, None)}
    # The same prompts and seeds at K=0 and auto, each K's behind its own opening (no prefill reuse).
    assert all(p.startswith("(1) ") for p, _ in by_k[0]) and all(p.startswith("(2) ") for p, _ in by_k[None])
    assert [(p[4:], seed) for p, seed in by_k[0]] == [(p[4:], seed) for p, seed in by_k[None]]
    order = [plan.prompts.index(p[4:]) for p, _, k in measured if k == 0]  # 2 levels of 2 requests, twice
    assert [sorted(order[i : i + 2]) for i in range(0, 8, 2)] == [[0, 1], [2, 3], [0, 4], [1, 2]]
    assert sum(r["repeated_prompts"] for r in rows if r["k"] == 0) == 3  # 8 requests over 5 prompts
    assert len(client.deleted) == len(client.sent)


def test_with_same_prompts_every_level_sends_the_first_prompts_each_behind_its_own_opening():
    """Levels compare alike only on the same prompts (their lengths differ tenfold); each (level,
    K) opens with its own tag, so none reuses another's prefill from the target's cache."""
    argv = ["--concurrency", "1,2", "--ks", "0,auto", "--num-prompts", "2", "--per-workload", "1", "--same-prompts"]
    plan = serve_bench.build_plan(serve_bench.parse_args(argv))
    client = RecordingClient()
    rows = serve_bench.bench_stack(client, plan)
    measured = client.sent[2:]  # after one warm-up request per K
    tags = {p.split(" ", 1)[0] for p, _, _ in measured}
    assert tags == {"(1.1)", "(1.2)", "(2.1)", "(2.2)"}
    for tag in tags:
        sent = sorted((p.split(" ", 1)[1], seed) for p, seed, _ in measured if p.startswith(tag + " "))
        assert sent == [(plan.prompts[0], 0), (plan.prompts[1], 1)]
    repeated = {(r["k"], r["concurrency"]): r["repeated_prompts"] for r in rows}
    assert repeated == {(0, 1): 0, ("auto", 1): 0, (0, 2): 2, ("auto", 2): 2}


def test_rows_count_drafting_requests_whose_prompt_a_draft_has_seen_at_another_k():
    """The Ks of a level send the same prompts: whichever drafting K runs later meets a suffix draft
    that has indexed those prompts' answers (K = 0 sends the draft nothing)."""
    argv = ["--concurrency", "1", "--ks", "1,auto", "--num-prompts", "2", "--per-workload", "1"]
    plan = serve_bench.build_plan(serve_bench.parse_args(argv))
    rows = serve_bench.bench_stack(RecordingClient(), plan)
    knew = {r["k"]: r["draft_knew_prompts"] for r in rows}
    assert knew[0] == 0 and sorted([knew[1], knew["auto"]]) == [0, 2], knew
    assert "an earlier drafting run had sent" in serve_bench.format_table(rows)


# ------------------------------------------------------------------ options and the stack's environment


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--concurrency", "1", "--request-rate", "2"], "not both"),
        (["--concurrency", "0,4"], "must be > 0"),
        (["--max-concurrency", "4"], "caps --request-rate"),
        (["--num-prompts", "0"], "--num-prompts must be >= 1"),
        (["--ks", "1,x"], "K must be"),
        (["--drafter", "ngarm"], "unknown drafter"),
    ],
)
def test_bad_options_are_clear_errors(argv, message):
    with pytest.raises(SystemExit, match=message):
        serve_bench.main(argv)


def test_a_started_stack_admits_the_streams_in_flight_unless_the_environment_says(monkeypatch):
    args = serve_bench.parse_args([])
    drafter = serve_bench.bench.parse_drafter("suffix", args.draft)
    env = serve_bench.stack_env(args, drafter, peak_streams=80)
    assert env["SPECDEC_DRAFT_MODEL"] == "suffix" and env["SPECDEC_COORDINATOR_METRICS_PORT"] == "0"
    assert env["SPECDEC_COORDINATOR_MAX_CONCURRENT_REQUESTS"] == "80" and env["SPECDEC_TARGET_MAX_WORKERS"] == "88"
    from coordinator.settings import CoordinatorSettings

    default = str(CoordinatorSettings().max_concurrent_requests)  # never lowered
    assert serve_bench.stack_env(args, drafter, 4)["SPECDEC_COORDINATOR_MAX_CONCURRENT_REQUESTS"] == default
    monkeypatch.setenv("SPECDEC_TARGET_MAX_CONCURRENT_REQUESTS", "5")
    assert serve_bench.stack_env(args, drafter, 40)["SPECDEC_TARGET_MAX_CONCURRENT_REQUESTS"] == "5"


def test_a_private_stack_has_its_own_state_ports_and_run_dir_and_restores_stacks(monkeypatch, tmp_path):
    """stack.up / down stubbed: what they would see, and that `make up`'s globals come back."""
    stack = serve_bench.stack
    monkeypatch.setattr(stack, "ROOT", tmp_path)  # .run does not exist yet
    saved = (stack.RUN_DIR, stack.STATE, stack.COORDINATOR_PORT)
    seen = {}

    def up():
        seen.update(run_dir=stack.RUN_DIR, state=stack.STATE, port=stack.COORDINATOR_PORT, env=dict(os.environ))
        assert stack.RUN_DIR.is_dir()
        return {"coordinator": f"127.0.0.1:{stack.COORDINATOR_PORT}"}

    monkeypatch.setattr(stack, "up", up)
    monkeypatch.setattr(stack, "down", lambda: seen.setdefault("down", True))
    with serve_bench.private_stack({"SPECDEC_X_TEST": "1"}) as address:
        assert address == f"127.0.0.1:{seen['port']}"
    assert seen["run_dir"].parent == tmp_path / ".run" and seen["state"].parent == seen["run_dir"]
    assert seen["port"] != saved[2] and seen["env"]["SPECDEC_X_TEST"] == "1" and seen["down"]
    assert (stack.RUN_DIR, stack.STATE, stack.COORDINATOR_PORT) == saved and "SPECDEC_X_TEST" not in os.environ


# ------------------------------------------------------------------ end to end


def _sessions(redis_url: str) -> set[bytes]:
    import redis

    client = redis.Redis.from_url(redis_url)
    try:
        return set(client.scan_iter("specdec:v1:session:*"))
    finally:
        client.close()


def test_rows_for_every_k_and_level_through_the_real_services(tiny_stack, tmp_path, capsys):
    before = _sessions(tiny_stack.redis_url)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"workload": "w", "prompt": p}) + "\n" for p in ("a b c a b", "c d e f")))
    argv = ["--address", tiny_stack.coordinator_address, "--no-chat", "--prompts", str(prompts)]
    argv += ["--concurrency", "1,3", "--ks", "2,auto", "--num-prompts", "3", "--max-new-tokens", "6"]
    assert serve_bench.main([*argv, "--temperature", "1", "--json"]) == 0
    objects = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    run, rows = objects[0], objects[1:]
    assert run["type"] == "run" and run["ks"] == [0, 2, "auto"] and run["loads"] == ["c=1", "c=3"]
    assert {(r["k"], r["load"]) for r in rows} == {(k, c) for k in (0, 2, "auto") for c in ("c=1", "c=3")}
    for r in rows:
        assert set(r) == ROW_FIELDS and r["type"] == "row"
        assert r["errors"] == 0 and r["requests"] == 3 and r["tokens"] == 18  # ignore_eos: exactly 6 each
        assert r["aggregate_tokens_per_s"] > 0 and r["ttft_ms_p50"] > 0 and r["itl_ms_p99"] >= r["itl_ms_p50"]
        assert r["base"] == "c=1" and r["ratio_vs_base"] > 0 and r["ratio_vs_k0"] > 0
        assert r["repeated_prompts"] == (1 if r["load"] == "c=1" else 3)  # 2 prompts: c=1 sends 0 1 0, c=3 1 0 1
        if r["k"] == 0:
            assert r["acceptance_rate"] is None and r["tokens_per_round"] == 1.0
        else:
            assert 0 <= r["acceptance_rate"] <= 1 and r["tokens_per_round"] >= 1.0
    assert _sessions(tiny_stack.redis_url) <= before  # each level's sessions deleted
