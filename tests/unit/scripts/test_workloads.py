"""The benchmark's workloads: built from this Python's own sources and docs, the same every time,
every workload present; user prompt files read with errors that name the bad line."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "scripts"))

import workloads
from workloads import Conversation, PromptFileError


def test_builders_are_deterministic_and_produce_every_workload():
    first = workloads.build_workloads(per_workload=3)
    assert first == workloads.build_workloads(per_workload=3)
    assert [c.workload for c in first] == [w for w in workloads.WORKLOADS for _ in range(3)]
    assert len({c.prompt for c in first}) == len(first)
    assert set(workloads.INPUT_GROUNDED) < set(workloads.WORKLOADS)


@pytest.mark.parametrize("workload", workloads.WORKLOADS)
def test_every_built_in_item_builds_within_its_budget(workload):
    items = {
        workloads.CODE_EDITING: workloads.CODE_ITEMS,
        workloads.SUMMARISATION: workloads.SUMMARY_MODULES,
        workloads.DOCUMENT_QA: workloads.QA_ITEMS,
        workloads.MULTI_TURN_CHAT: workloads.CHAT_FUNCTIONS,
        workloads.OPEN_ENDED: workloads.OPEN_PROMPTS,
    }[workload]
    built = workloads.BUILDERS[workload](len(items), 1200)
    assert len(built) == len(items)
    for conv in built:
        # The passage is clipped to max_chars; the instruction around it adds a few hundred more.
        assert 20 < len(conv.prompt) < 1200 + 400, conv.name
        assert all(t.strip() for t in conv.turns)
    assert all(c.turns for c in built) == (workload == workloads.MULTI_TURN_CHAT)


def test_grounded_prompts_quote_the_standard_library():
    import inspect
    import json as json_module

    (qa,) = workloads.document_qa(1)
    assert inspect.getdoc(json_module.dumps)[:200] in qa.prompt and "`sort_keys`" in qa.prompt
    (summary,) = workloads.summarisation(1)
    assert inspect.cleandoc(json_module.__doc__)[:200] in summary.prompt


def test_planted_bug_changes_one_operator_in_code_never_in_the_docstring():
    source = 'def f(a, b=1):\n    """Is a < b? 1 + 1."""\n    return a + b if a <= b else a\n'
    assert workloads.plant_bug(source) == source.replace("a <= b", "a < b")
    assert workloads.plant_bug("def g(x):\n    return x + 2\n") == "def g(x):\n    return x - 2\n"
    with pytest.raises(ValueError, match="no comparison"):
        workloads.plant_bug("def h():\n    return None\n")
    for conv in workloads.code_editing(len(workloads.CODE_ITEMS)):
        if conv.name.startswith("bug:"):
            assert "has one bug" in conv.prompt


def test_clip_cuts_at_a_paragraph_break():
    text = "a" * 50 + "\n\n" + "b" * 50 + "\n\n" + "c" * 50
    assert workloads.clip(text, 120) == "a" * 50 + "\n\n" + "b" * 50
    assert workloads.clip("short", 120) == "short"


def test_unknown_workloads_and_too_many_items_are_errors():
    with pytest.raises(ValueError, match="unknown workloads"):
        workloads.build_workloads(("code-editing", "poetry"))
    with pytest.raises(ValueError, match="built-in items"):
        workloads.build_workloads(("open-ended",), per_workload=99)


def test_prompt_file_reads_conversations(tmp_path):
    path = tmp_path / "mine.jsonl"
    lines = [
        {"workload": "mine", "prompt": "Summarise: a b c"},
        {"workload": "chat", "prompt": "Hi", "turns": ["And then?", "Quote me."], "name": "greeting"},
    ]
    path.write_text(json.dumps(lines[0]) + "\n\n" + json.dumps(lines[1]) + "\n")
    assert workloads.load_prompts(path) == [
        Conversation("mine", f"{path}:1", "Summarise: a b c"),
        Conversation("chat", "greeting", "Hi", ("And then?", "Quote me.")),
    ]


@pytest.mark.parametrize(
    "line, message",
    [
        ("{not json", "not JSON"),
        ('["a list"]', "expected a JSON object"),
        ('{"workload": "w"}', "missing 'prompt'"),
        ('{"prompt": "p"}', "missing 'workload'"),
        ('{"workload": "w", "prompt": "  "}', "'prompt' must be a non-empty string"),
        ('{"workload": "w", "prompt": "p", "turn": ["x"]}', r"unknown fields \['turn'\]"),
        ('{"workload": "w", "prompt": "p", "turns": "x"}', "'turns' must be a list"),
        ('{"workload": "w", "prompt": "p", "turns": ["ok", 3]}', r"turns\[1\] must be a non-empty string"),
    ],
)
def test_bad_prompt_lines_name_the_file_and_line(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"workload": "w", "prompt": "fine"}\n' + line + "\n")
    with pytest.raises(PromptFileError, match=f"bad.jsonl:2: {message}"):
        workloads.load_prompts(path)


def test_empty_or_missing_prompt_files_are_errors(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n \n")
    with pytest.raises(PromptFileError, match="no prompts"):
        workloads.load_prompts(tmp_path / "empty.jsonl")
    with pytest.raises(PromptFileError, match="cannot read"):
        workloads.load_prompts(tmp_path / "missing.jsonl")
