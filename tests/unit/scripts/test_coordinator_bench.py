"""scripts/coordinator_bench.py end to end, briefly: the real coordinator process on stub pools
and a real Redis streams every level without errors, and each level's numbers are measured."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "scripts"))

import coordinator_bench


def test_levels_stream_rounds_and_measure_the_coordinator(capsys):
    argv = ["--concurrency", "1,3", "--seconds", "1", "--tokens", "12", "--k", "3", "--max-concurrent", "2", "--json"]
    assert coordinator_bench.main(argv) == 0
    one, three = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert (one["concurrency"], three["concurrency"]) == (1, 3)
    for level in (one, three):
        assert level["rounds"] > 0 and level["streams"] > 0 and level["errors"] == 0, level
        assert level["coordinator_cpu_ms_per_round"] > 0 and level["rounds_per_s"] > 0
        assert 0 < level["round_p50_ms"] <= level["round_p99_ms"] and level["coordinator_ms_per_round"] > 0
    # 12 tokens at K = 3 take at most 12 rounds a stream (a round gains at least one token).
    assert one["rounds"] <= 12 * one["streams"]
    assert one["refused"] == 0 and three["refused"] > 0  # admission: 2 at once
