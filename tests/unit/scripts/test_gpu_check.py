"""scripts/gpu_check: the Qwen2.5 shapes it builds, its options, a fast clear failure without a GPU,
its speedup model and table; and (slow) the whole check on the CPU with tiny shapes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "scripts"))

import gpu_check


def test_qwen_shapes_are_the_released_configs():
    small = gpu_check.qwen2_config(gpu_check.SHAPES["qwen2.5-0.5b"])
    large = gpu_check.qwen2_config(gpu_check.SHAPES["qwen2.5-7b"])
    assert (small.hidden_size, small.num_hidden_layers, small.num_attention_heads) == (896, 24, 14)
    assert (small.num_key_value_heads, small.intermediate_size, small.vocab_size) == (2, 4864, 151936)
    assert (large.hidden_size, large.num_hidden_layers, large.num_attention_heads) == (3584, 28, 28)
    assert (large.num_key_value_heads, large.intermediate_size, large.vocab_size) == (4, 18944, 151936)
    assert small.tie_word_embeddings and not large.tie_word_embeddings
    assert (
        small.hidden_size // small.num_attention_heads == 64 and large.hidden_size // large.num_attention_heads == 128
    )


def test_options():
    args = gpu_check.parse_args([])
    assert (args.draft, args.target, args.k, args.dry_run) == ("qwen2.5-0.5b", "qwen2.5-7b", 4, False)
    dry = gpu_check.parse_args(["--dry-run", "--k", "2"])
    assert (dry.draft, dry.target, dry.k) == ("tiny-draft", "tiny-target", 2)
    assert dry.shapes["target"] == gpu_check.DRY_RUN_SHAPES["tiny-target"]
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--target", "tiny-target"])  # a dry-run shape without --dry-run
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--tokens", "0"])


def test_without_a_gpu_the_script_fails_fast_and_says_why():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", GPU_CHECK_TIMEOUT_S="60")
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh")],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == gpu_check.NO_GPU_EXIT
    assert "no CUDA GPU here" in done.stderr and "--dry-run" in done.stderr
    assert done.stdout == ""


def test_predicted_speedup():
    # No acceptance: one token per round at the cost of K draft steps and a Verify.
    assert gpu_check.predicted_speedup(0.0, 4, 2.0, 8.0, 8.0) == pytest.approx(8.0 / 16.0)
    # Everything accepted: K + 1 tokens per round.
    assert gpu_check.predicted_speedup(1.0, 4, 2.0, 8.0, 8.0) == pytest.approx(5 * 8.0 / 16.0)
    assert gpu_check.predicted_speedup(0.5, 1, 1.0, 4.0, 4.0) == pytest.approx(1.5 * 4.0 / 5.0)


def test_table_shows_every_figure():
    results = {
        "device": "GPU",
        "models": {
            "draft": {"name": "qwen2.5-0.5b", "ms_per_token": {"eager": 19.3, "static": 2.68}},
            "target": {"name": "qwen2.5-7b", "ms_per_token": {"eager": 21.9, "static": 7.59}},
        },
        "c": {"eager": 0.88, "static": 0.353},
        "verify_ms": {1: 7.6, 5: 8.1},
        "e2e": {
            "runs": [
                {"k": 0, "tokens_per_s": 130.0, "tokens": 128, "rounds": 128, "acceptance": None},
                {"k": 4, "tokens_per_s": 200.0, "tokens": 128, "rounds": 40, "acceptance": 0.7},
            ],
            "speedup": 200 / 130,
            "predicted_speedup": {"0.7": 1.6},
        },
    }
    text = gpu_check.table(results, 4)
    for figure in ("19.30", "2.68", "7.2x", "c = draft/target: eager 0.880  static 0.353", "K=4: 200.0 tok/s", "1.54x"):
        assert figure in text


@pytest.mark.slow
def test_dry_run_end_to_end(tmp_path, capsys):
    """Every step on the CPU with tiny shapes (aot_eager: ~1.5 minutes here, compiling)."""
    out = tmp_path / "results.json"
    argv = ["--dry-run", "--tokens", "4", "--prompt-len", "12", "--e2e-tokens", "12", "--repeats", "1"]
    assert gpu_check.main([*argv, "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    assert set(results["models"]["target"]["ms_per_token"]) == {"eager", "static"}
    assert {run["k"] for run in results["e2e"]["runs"]} == {0, 4}
    assert all(run["tokens"] == 12 for run in results["e2e"]["runs"])
    assert set(results["batched_step_ms"]) == {"1", "8"}  # JSON keys
    printed = capsys.readouterr().out
    assert "end to end K=4" in printed and "step of N sessions x 1 token" in printed
