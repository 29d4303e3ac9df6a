"""scripts/transport_bench.py end to end on a small vocabulary: an empty round, then one row per
V x K x law x encoding, sparse exactly where warping leaves most of a law 0."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "scripts"))

import transport_bench


def test_rows_cover_every_setting_and_the_encoder_sends_cut_laws_sparsely(capsys):
    argv = ["--vocab", "4096", "--ks", "1,3", "--laws", "T=1,top_k=50,greedy", "--repeats", "2", "--json"]
    assert transport_bench.main(argv) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert rows[0]["law"] == "none" and len(rows) == 1 + 2 * 3 * 2
    for row in rows[1:]:
        assert row["round_min_ms"] <= row["round_ms"] and row["encode_ms"] > 0 and row["decode_ms"] > 0
        dense_bytes = 4 * 4096 * (2 * row["k"] + 1)
        assert row["sparse"] == (row["encoding"] == "auto" and row["law"] != "T=1")
        assert (row["bytes"] < dense_bytes / 10) == row["sparse"]
    greedy = [r for r in rows if r["law"] == "greedy"]
    assert all(r["stored_per_row"] == 1 for r in greedy)


def test_the_table_has_a_header_and_a_line_per_row(capsys):
    assert transport_bench.main(["--vocab", "512", "--ks", "2", "--laws", "greedy", "--repeats", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:3] == ["vocab", "K", "law"] and len(lines) == 1 + 1 + 2
