"""The `specdec` console command against the real services."""

from __future__ import annotations

import pytest

from specdec.cli import main


def test_generate_streams_text_and_prints_stats_then_session_commands(tiny_stack, capsys):
    code = main(
        ["generate", "a b c", "--address", tiny_stack.coordinator_address, "--max-new-tokens", "6", "--seed", "1",
         "-k", "2", "--ignore-eos"]
    )  # fmt: skip
    assert code == 0
    out, err = capsys.readouterr()
    assert out.strip()
    assert "acceptance rate" in err and "tokens/s" in err
    session_id = next(line.split()[1] for line in err.splitlines() if line.startswith("session"))
    assert main(["session", "show", session_id, "--address", tiny_stack.coordinator_address]) == 0
    shown = capsys.readouterr().out
    assert f"session {session_id}: 9 tokens" in shown
    assert main(["session", "delete", session_id, "--address", tiny_stack.coordinator_address]) == 0
    assert "deleted" in capsys.readouterr().out


def test_errors_are_one_line_with_the_status(tiny_stack, capsys):
    code = main(["generate", "a", "--address", tiny_stack.coordinator_address, "--top-p", "2"])
    assert code == 1
    assert "INVALID_ARGUMENT: top_p must be in (0, 1]" in capsys.readouterr().err


def test_compare_runs_the_prompt_with_speculation_then_alone_and_leaves_no_session(tiny_stack, capsys, redis_client):
    before = set(redis_client.scan_iter())
    code = main(
        ["compare", "a b c a b c a b", "--address", tiny_stack.coordinator_address, "--max-new-tokens", "12",
         "-k", "3", "--ignore-eos"]
    )  # fmt: skip
    assert code == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[1].startswith("speculation, K = 3") and lines[2].startswith("target alone, K = 0")
    assert lines[2].split()[-1] == lines[1].split()[-1] == "12"  # tokens of each run
    assert lines[3].endswith("x the target alone; the same tokens")  # greedy: the target's tokens both times
    assert set(redis_client.scan_iter()) == before


@pytest.mark.parametrize("drafts", [["--draft", "DRAFT"], ["--draft", "", "--target-lookup", "suffix"]])
def test_compare_in_process_loads_the_pair_here(tiny_model_dirs, capsys, drafts):
    drafts = [tiny_model_dirs["draft"] if d == "DRAFT" else d for d in drafts]
    code = main(
        ["compare", "a b c a b c a b", "--in-process", "--target", tiny_model_dirs["target"], *drafts,
         "--max-new-tokens", "10", "-k", "2", "--ignore-eos"]
    )  # fmt: skip
    assert code == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[1].startswith("speculation, K = 2") and lines[2].split()[-1] == "10"
    assert lines[3].endswith("x the target alone; the same tokens")
