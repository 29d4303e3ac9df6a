"""scripts/bench.py end to end in process on a tiny random model pair with a chat template: every
workload x drafter x temperature x K gets a row with the documented fields, ratios to K = 0 of the
same run, summary rows; and its option parsing, user prompt files, and background load."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "tests"))

import bench
from tiny_models import build_tiny_model
from workloads import WORKLOADS

ROW_FIELDS = {
    "type", "drafter", "mode", "workload", "temperature", "k", "background_load", "conversations", "requests",
    "tokens", "seconds", "tokens_per_s", "ratio_vs_k0", "ratio_interval", "ratio_vs_hf", "acceptance_rate",
    "tokens_per_round", "drafted_per_round", "rounds", "draft_ms_per_round", "verify_ms_per_round",
    "other_ms_per_round", "call_ms_per_request", "steal_share",
}  # fmt: skip
SUMMARY_FIELDS = {
    "type", "drafter", "mode", "temperature", "k", "background_load", "workloads", "grounded_mean_ratio",
    "grounded_target", "grounded_mean_vs_hf", "min_ratio", "min_ratio_workload", "min_ratio_interval",
    "auto_floor",
}  # fmt: skip
# Prefix-stable, as the coordinator's continued-session rendering needs.
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}assistant {% endif %}"
)


def _chat_model(directory: Path, seed: int) -> str:
    """A tiny model whose tokenizer has a chat template and whose context holds a workload prompt."""
    from transformers import AutoTokenizer

    build_tiny_model(directory, seed=seed, logit_scale=15.0)
    config = json.loads((directory / "config.json").read_text())
    config["max_position_embeddings"] = 2048
    (directory / "config.json").write_text(json.dumps(config))
    tokenizer = AutoTokenizer.from_pretrained(directory)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(directory)
    return str(directory)


@pytest.fixture(scope="module")
def chat_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench-models")
    return _chat_model(root / "target", 0), _chat_model(root / "draft", 1)


def _run_json(capsys, args: list[str]) -> list[dict]:
    assert bench.main([*args, "--json"]) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def test_bench_runs_every_workload_drafter_and_k_in_process(chat_pair, capsys):
    target, draft = chat_pair
    args = ["--target", target, "--draft", draft, "--drafters", "model,ngram", "--ks", "2,auto"]
    args += ["--per-workload", "1", "--max-chars", "300", "--max-new-tokens", "5", "--temperatures", "0,1"]
    objects = _run_json(capsys, args)
    run, rows = objects[0], [o for o in objects if o["type"] == "row"]
    assert run["type"] == "run" and run["ks"] == [0, 2, "auto"] and run["modes"] == ["in-process"]
    keys = {(r["drafter"], r["workload"], r["temperature"], r["k"]) for r in rows}
    assert keys == {
        (d, w, t, k) for d in ("model", "ngram") for w in WORKLOADS for t in (0.0, 1.0) for k in (0, 2, "auto")
    }
    for r in rows:
        assert set(r) == ROW_FIELDS and r["mode"] == "in-process"
        assert r["tokens"] > 0 and r["tokens_per_s"] > 0 and r["rounds"] > 0
        assert r["verify_ms_per_round"] > 0 and r["other_ms_per_round"] is not None
        assert r["requests"] == (3 if r["workload"] == "multi-turn-chat" else 1)
        assert r["ratio_vs_hf"] is None  # no hf-generate mode in this run
        assert 0 <= r["steal_share"] < 1
        if r["k"] == 0:
            assert r["ratio_vs_k0"] == 1.0 and r["acceptance_rate"] is None and r["draft_ms_per_round"] == 0
    # Greedy speculation emits the target's own tokens: same count at every K.
    greedy = {(r["drafter"], r["workload"], r["k"]): r["tokens"] for r in rows if r["temperature"] == 0}
    assert all(greedy[(d, w, k)] == greedy[(d, w, 0)] for d, w, k in greedy)
    summaries = [o for o in objects if o["type"] == "summary"]
    assert {(s["drafter"], s["temperature"], s["k"]) for s in summaries} == {
        (d, t, k) for d in ("model", "ngram") for t in (0.0, 1.0) for k in (2, "auto")
    }
    for s in summaries:
        assert set(s) == SUMMARY_FIELDS and s["grounded_mean_ratio"] > 0 and s["min_ratio"] > 0
        assert s["grounded_target"] == {0.0: 1.5, 1.0: 1.2}[s["temperature"]]
    targets = {(t["check"], t["temperature"]): t for t in objects if t["type"] == "target"}
    assert set(targets) == {(c, t) for c in ("grounded_mean", "auto_floor") for t in (0.0, 1.0)}
    assert all(t["drafter"] == "ngram" for (c, _), t in targets.items() if c == "grounded_mean")
    assert all(t["met"] == (t["value"] >= t["target"]) for t in targets.values())


def test_bench_reads_a_prompt_file_and_prints_a_table(chat_pair, tmp_path, capsys):
    target, draft = chat_pair
    prompts = tmp_path / "mine.jsonl"
    prompts.write_text(json.dumps({"workload": "mine", "prompt": "a b c a b c", "turns": ["a b"]}) + "\n")
    args = ["--target", target, "--draft", draft, "--drafters", "ngram", "--ks", "1", "--temperature", "1"]
    assert bench.main([*args, "--prompts", str(prompts), "--max-new-tokens", "4", "--ignore-eos"]) == 0
    out = capsys.readouterr().out
    assert "drafter ngram, in-process, T=1" in out and "mine" in out and "summary" in out


def test_hf_generate_runs_beside_each_k0_and_every_row_gets_its_ratio(chat_pair, capsys):
    target, draft = chat_pair
    args = ["--target", target, "--draft", draft, "--drafters", "ngram", "--ks", "2", "--workloads", "code-editing"]
    args += ["--modes", "in-process,hf-generate", "--per-workload", "1", "--max-chars", "300", "--max-new-tokens", "5"]
    objects = _run_json(capsys, [*args, "--temperatures", "0,1", "--ignore-eos"])
    rows = [o for o in objects if o["type"] == "row"]
    assert {(r["mode"], r["temperature"], r["k"]) for r in rows} == {
        (m, t, k) for t in (0.0, 1.0) for m, k in (("in-process", 0), ("in-process", 2), ("hf-generate", 0))
    }
    hf = {r["temperature"]: r for r in rows if r["mode"] == "hf-generate"}
    for r in rows:
        assert r["tokens"] == 5, r
        assert r["ratio_vs_hf"] == pytest.approx(r["tokens_per_s"] / hf[r["temperature"]]["tokens_per_s"])
    assert all(r["rounds"] == r["tokens"] and r["other_ms_per_round"] == 0 for r in hf.values())
    assert all(o["mode"] == "in-process" for o in objects if o["type"] == "target")
    (summary,) = [o for o in objects if o["type"] == "summary" and o["temperature"] == 0 and o["k"] == 2]
    assert summary["grounded_mean_vs_hf"] == pytest.approx(
        next(r["ratio_vs_hf"] for r in rows if (r["mode"], r["temperature"], r["k"]) == ("in-process", 0.0, 2))
    )


def test_each_row_reports_the_cpu_time_the_hypervisor_took_during_its_calls(chat_pair, capsys, monkeypatch):
    """A run that met a slow spell of the VM says so: the steal counter's growth over each run of
    a conversation, as a share of the VM's CPU time in the row's calls."""
    target, _ = chat_pair
    counter = iter(range(0, 10**6, 2))  # every read 2 CPU seconds later: each run steals 2 s
    monkeypatch.setattr(bench.hostinfo, "steal_seconds", lambda: float(next(counter)))
    args = ["--target", target, "--drafters", "ngram", "--ks", "2", "--workloads", "code-editing,multi-turn-chat"]
    args += ["--temperatures", "0", "--per-workload", "1", "--max-chars", "300", "--max-new-tokens", "4"]
    rows = [o for o in _run_json(capsys, args) if o["type"] == "row"]
    assert len(rows) == 4
    for r in rows:
        assert r["steal_share"] == pytest.approx(2.0 / (r["seconds"] * bench.VM_CPUS))
    monkeypatch.setattr(bench.hostinfo, "steal_seconds", lambda: None)  # no /proc/stat
    rows = [o for o in _run_json(capsys, args) if o["type"] == "row"]
    assert len(rows) == 4 and all(r["steal_share"] == 0 for r in rows)


def test_hf_generate_is_the_same_work_as_the_target_alone(chat_pair):
    """The baseline decodes what the pipeline at K = 0 does: the same greedy tokens, and as many
    sampled ones (HF's own random stream, so not the same draws)."""
    from specdec.inprocess import InProcessPipeline

    target, _ = chat_pair
    with InProcessPipeline(target, None) as pipeline:
        hf = bench.HfGenerateRunner(pipeline, target)
        ids = hf._turn_ids("a b c d a b c", continuing=False)
        for temperature in (0.0, 1.0):
            kwargs = {"max_new_tokens": 12, "temperature": temperature, "seed": 3, "ignore_eos": True}
            ours = pipeline.generate(ids, num_speculative_tokens=0, **kwargs).completions[0].token_ids
            theirs = hf.generate(ids, **kwargs).completions[0].token_ids
            assert len(theirs) == len(ours) == 12
            if temperature == 0:
                assert list(theirs) == list(ours)
                greedy = list(theirs)
            else:  # it samples: a tiny random model's near-flat laws do not give greedy's 12 tokens
                assert list(theirs) != greedy
            assert hf.generate(ids, **kwargs).completions[0].token_ids == theirs  # seeded


def test_bad_options_are_clear_errors(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"workload": "w"}\n')
    with pytest.raises(SystemExit, match=r"bad.jsonl:1: missing 'prompt'"):
        bench.main(["--prompts", str(tmp_path / "bad.jsonl")])
    with pytest.raises(SystemExit, match="K must be"):
        bench.main(["--ks", "1,two"])
    with pytest.raises(SystemExit, match="unknown drafter"):
        bench.main(["--drafters", "model,ngarm"])
    with pytest.raises(SystemExit, match="unknown modes"):
        bench.main(["--modes", "cloud"])
    with pytest.raises(SystemExit, match="one drafter"):
        bench.main(["--address", "localhost:1", "--modes", "grpc", "--drafters", "model,ngram"])


def test_ks_always_start_with_zero():
    assert bench.parse_ks("3,auto,3") == [0, 3, "auto"]
    assert bench.parse_ks("auto,0") == [0, "auto"]
    assert bench.rotated([0, 1, 2], 4) == [1, 2, 0]


def test_drafter_names_map_to_draft_models_and_lookups():
    assert bench.parse_drafter("model", "drafts/x") == bench.Drafter("model", "drafts/x")
    assert bench.parse_drafter("suffix", "drafts/x") == bench.Drafter("suffix", "suffix")
    assert bench.parse_drafter("hybrid", "drafts/x") == bench.Drafter("hybrid", "drafts/x", "suffix")
    assert bench.parse_drafter("tokens=drafts/y", "drafts/x") == bench.Drafter("tokens", "drafts/y")
    assert bench.parse_drafter("target-suffix", "drafts/x") == bench.Drafter("target-suffix", "ngram", "", "suffix")
    with pytest.raises(ValueError, match="unknown drafter 'ngarm'"):
        bench.parse_drafter("ngarm", "drafts/x")
    with pytest.raises(ValueError, match="LABEL=SPEC"):
        bench.parse_drafter("=drafts/y", "drafts/x")


def test_background_load_runs_busy_processes_and_stops_them():
    with bench.background_load(2) as pids:
        assert len(pids) == 2
        time.sleep(0.2)
        for pid in pids:
            os.kill(pid, 0)  # alive
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_in_process_runs_reset_a_drafter_with_state_across_sessions():
    from types import SimpleNamespace

    from workloads import Conversation

    resets = []
    drafter = SimpleNamespace(reset=lambda: resets.append(1))
    response = SimpleNamespace(stats=SimpleNamespace(), completions=[SimpleNamespace(token_ids=[1])])
    pipeline = SimpleNamespace(draft=SimpleNamespace(drafter=drafter), generate=lambda prompt, **kw: response)
    runner = bench.InProcessRunner(pipeline)
    runner.run(Conversation("w", "a", "hello"), max_new_tokens=1)
    runner.run(Conversation("w", "b", "again"), max_new_tokens=1)
    assert len(resets) == 2
    bench.InProcessRunner(SimpleNamespace(draft=None, generate=pipeline.generate)).run(Conversation("w", "c", "x"))



@pytest.mark.parametrize("cache", ["cold", "warm"])
def test_every_timed_call_starts_from_the_same_prompt_cache(cache, monkeypatch):
    """Without this the first K of a conversation computed the prompt and every later K read it from
    the target's cache (a 600-token prompt: half a 64-token call's time)."""
    from workloads import Conversation

    events = []
    stats = SimpleNamespace(generated_tokens=1, drafted_tokens=0, accepted_tokens=0)
    response = SimpleNamespace(stats=stats, completions=[SimpleNamespace(token_ids=[1])], session_id="s")

    def recorded(name):
        return lambda prompt, **kwargs: events.append((name, kwargs["max_new_tokens"])) or response

    pipeline = SimpleNamespace(draft=None, clear_caches=lambda: events.append(("local", "clear")))
    pipeline.generate = recorded("local")
    client = SimpleNamespace(generate=recorded("grpc"), delete_session=lambda session: None)
    monkeypatch.setattr(bench, "warm_up", lambda runners, plan: None)
    monkeypatch.setattr(bench.Tally, "add", lambda self, calls, stolen, run=(): None)
    runners = {"in-process": bench.InProcessRunner(pipeline), "grpc": bench.GrpcRunner(client)}
    plan = bench.Plan([Conversation("w", "a", "hello")], [0, 2], [0.0], 4, prompt_cache=cache)
    bench.bench_drafter("ngram", runners, plan)
    local = [("local", "clear"), *([("local", 1)] if cache == "warm" else []), ("local", 4)]
    assert events == (local + [("grpc", 1), ("grpc", 4)]) * 2  # the prompt untimed (1 token), then the call

def test_warm_prompts_refuse_the_hf_generate_mode():
    with pytest.raises(SystemExit, match="computes every prompt"):
        bench.main(["--prompt-cache", "warm", "--modes", "in-process,hf-generate"])


def _tally(runs: list[tuple[tuple, int, float]]) -> bench.Tally:
    return bench.Tally(runs=list(runs))


def test_the_ratio_interval_pairs_runs_by_conversation_and_repeat():
    base = _tally([(("a", 0), 100, 1.0), (("b", 0), 100, 2.0), (("a", 1), 100, 1.25), (("c", 0), 100, 1.0)])
    # Twice as fast as K = 0's run of the same conversation and repeat, whatever that run took.
    twice = _tally([(("a", 0), 100, 0.5), (("b", 0), 100, 1.0), (("a", 1), 100, 0.625), (("d", 0), 100, 0.1)])
    low, high = bench.paired_interval(twice, base)
    assert low == pytest.approx(2.0) and high == pytest.approx(2.0)  # "d" has no partner, "c" no run
    assert bench.paired_interval(_tally([(("a", 0), 100, 0.5)]), base) is None  # one pair: no interval
    assert bench.paired_interval(twice, None) is None


def test_the_ratio_interval_is_students_t_over_the_log_ratios():
    import math
    import statistics

    ratios = [0.9, 1.0, 1.1]
    base = _tally([((str(i), 0), 100, 1.0) for i in range(3)])
    tally = _tally([((str(i), 0), 100, 1.0 / r) for i, r in enumerate(ratios)])
    logs = [math.log(r) for r in ratios]
    half = 4.303 * statistics.stdev(logs) / math.sqrt(3)  # t at 97.5%, 2 degrees of freedom
    low, high = bench.paired_interval(tally, base)
    assert low == pytest.approx(math.exp(statistics.fmean(logs) - half))
    assert high == pytest.approx(math.exp(statistics.fmean(logs) + half))


def test_a_miss_inside_its_interval_is_not_resolved():
    check = bench._check("auto_floor", "in-process", 0.0, 0.97, 0.9, "suffix", "auto", "summarisation", [0.8, 1.0])
    assert not check["met"] and not check["resolved"]
    check = bench._check("auto_floor", "in-process", 0.0, 0.97, 0.9, "suffix", "auto", "summarisation", [0.85, 0.95])
    assert not check["met"] and check["resolved"]
    assert bench._check("grounded_mean", "in-process", 0.0, 1.5, 1.2, "suffix", 4, None, None)["resolved"]
    table = bench.format_table(
        {"rows": [], "summaries": [], "pipeline": [], "targets": [{**check, "interval": [0.8, 1.0], "resolved": False}]}
    )
    assert "NOT met (not resolved: the target lies in its 95% interval, 0.80-1.00)" in table


def test_repeated_runs_give_each_row_its_interval(chat_pair, tmp_path, capsys):
    target, draft = chat_pair
    prompts = tmp_path / "mine.jsonl"
    prompts.write_text(json.dumps({"workload": "mine", "prompt": "a b c a b c a b"}) + "\n")
    args = ["--target", target, "--draft", draft, "--drafters", "ngram", "--ks", "1", "--temperature", "0"]
    args += ["--prompts", str(prompts), "--max-new-tokens", "4", "--ignore-eos", "--repeats", "2"]
    rows = [o for o in _run_json(capsys, args) if o["type"] == "row"]
    by_k = {r["k"]: r for r in rows}
    assert by_k[0]["ratio_interval"] is None  # K = 0 against itself
    low, high = by_k[1]["ratio_interval"]
    assert 0 < low <= high
