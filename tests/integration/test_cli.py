"""The `specdec` console command against the real services."""

from __future__ import annotations

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
