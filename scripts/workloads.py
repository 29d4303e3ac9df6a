"""Benchmark workloads built from text that installs with Python (no download), and user prompt files.

Five workloads, each a list of `Conversation`s (a first user turn, then optional later turns):

  code-editing     a stdlib function's source to rewrite with type hints and a docstring, or with a
                   planted bug to find and fix: the answer repeats most of the input
  summarisation    a stdlib module's documentation (its docstring, what pydoc shows first) to summarise
  document-qa      a stdlib function's documentation and a question answered by quoting it
  multi-turn-chat  a function's source, then turns that ask to rework and quote earlier turns
  open-ended       free questions with nothing to copy from (speculation's hard case)

The first three are input-grounded: the issue's speed targets average over them. The text comes
from this Python's standard library (`inspect.getsource`, `__doc__`), so a given Python install
always builds the same prompts; another Python version may differ slightly. Passages are clipped
to `max_chars` (about 4 characters per SmolLM2 token: a few hundred tokens of context each).

`load_prompts(path)` reads the same shape from JSONL: {"workload": ..., "prompt": ..., "turns": [...]}.
"""

from __future__ import annotations

import importlib
import inspect
import io
import json
import textwrap
import tokenize
from dataclasses import dataclass
from pathlib import Path

CODE_EDITING = "code-editing"
SUMMARISATION = "summarisation"
DOCUMENT_QA = "document-qa"
MULTI_TURN_CHAT = "multi-turn-chat"
OPEN_ENDED = "open-ended"
WORKLOADS = (CODE_EDITING, SUMMARISATION, DOCUMENT_QA, MULTI_TURN_CHAT, OPEN_ENDED)
# Where the output copies long spans of the prompt, so a model-free draft can propose them.
INPUT_GROUNDED = (CODE_EDITING, SUMMARISATION, DOCUMENT_QA)
DEFAULT_MAX_CHARS = 2400


@dataclass(frozen=True)
class Conversation:
    """One benchmark item: a first user turn and the user turns that follow each answer."""

    workload: str
    name: str
    prompt: str
    turns: tuple[str, ...] = ()


class PromptFileError(ValueError):
    """A --prompts file that cannot be read as benchmark conversations; says file and line."""


# (task, "module:qualified.name"). Type-hint and bug-fix tasks alternate, so two items give one of each.
CODE_ITEMS = (
    ("hints", "textwrap:dedent"),
    ("bug", "statistics:median"),
    ("hints", "difflib:get_close_matches"),
    ("bug", "calendar:monthrange"),
    ("hints", "heapq:nlargest"),
    ("bug", "colorsys:rgb_to_hls"),
    ("hints", "statistics:variance"),
    ("bug", "random:Random.choices"),
)
SUMMARY_MODULES = ("json", "csv", "heapq", "argparse", "statistics", "itertools", "subprocess", "unittest")
# (function, the parameter the question asks about).
QA_ITEMS = (
    ("json:dumps", "sort_keys"),
    ("shutil:copytree", "dirs_exist_ok"),
    ("json:loads", "object_pairs_hook"),
    ("subprocess:run", "check"),
    ("tempfile:mkstemp", "text"),
    ("shutil:rmtree", "ignore_errors"),
    ("zipfile:ZipFile", "compresslevel"),
    ("heapq:merge", "key"),
)
CHAT_FUNCTIONS = (
    "string:capwords",
    "fnmatch:fnmatch",
    "html:escape",
    "base64:b64encode",
    "statistics:mean",
    "csv:DictReader.__next__",
)
OPEN_PROMPTS = (
    "Explain how a refrigerator keeps food cold, step by step.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Give me five tips for learning a new language, with a sentence on each.",
    "What is the difference between a list and a tuple in Python? Explain with examples.",
    "Describe a day in the life of a medieval blacksmith.",
    "What should I consider when choosing between a bicycle and a car for commuting?",
)
# A planted bug: the first comparison in the code (not in a docstring) flipped, else the first + or -.
SWAPS = {"<=": "<", ">=": ">", "<": "<=", ">": ">=", "==": "!=", "!=": "==", "+": "-", "-": "+"}
COMPARISONS = ("<=", ">=", "<", ">", "==", "!=")


def _lookup(ref: str):
    module, _, qualname = ref.partition(":")
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _source(ref: str) -> str:
    return textwrap.dedent(inspect.getsource(_lookup(ref)))


def clip(text: str, max_chars: int) -> str:
    """`text` cut to at most `max_chars`, at the last paragraph (else line) break before the limit."""
    text = text.strip()
    if len(text) <= max_chars:
        return text
    head = text[:max_chars]
    for sep in ("\n\n", "\n"):
        cut = head.rfind(sep)
        if cut > max_chars // 2:
            return head[:cut].rstrip()
    return head.rstrip()


def plant_bug(source: str) -> str:
    """`source` with one operator swapped (SWAPS): the first comparison, else the first + or -.

    Found with `tokenize`, so text in docstrings and comments is never touched.
    """
    ops = [t for t in tokenize.generate_tokens(io.StringIO(source).readline) if t.string in SWAPS]
    ops = [t for t in ops if t.type == tokenize.OP]
    chosen = next((t for t in ops if t.string in COMPARISONS), ops[0] if ops else None)
    if chosen is None:
        raise ValueError("no comparison or arithmetic operator to change in this source")
    lines = source.splitlines(keepends=True)
    row, col = chosen.start[0] - 1, chosen.start[1]
    line = lines[row]
    lines[row] = line[:col] + SWAPS[chosen.string] + line[col + len(chosen.string) :]
    return "".join(lines)


def _code_item(task: str, ref: str, max_chars: int) -> Conversation:
    source = _source(ref)
    if task == "hints":
        ask = (
            "Rewrite this function from Python's standard library with type hints on every parameter "
            "and the return value, and a Google-style docstring. Keep the body unchanged. Reply with the "
            "code only."
        )
    else:
        source = plant_bug(source)  # before clipping: tokenize needs whole strings
        ask = (
            "This function from Python's standard library has one bug: a single operator was changed. "
            "Find it, say in one sentence what was wrong, then give the whole corrected function."
        )
    return Conversation(CODE_EDITING, f"{task}:{ref}", f"{ask}\n\n```python\n{clip(source, max_chars)}\n```")


def code_editing(n: int, max_chars: int = DEFAULT_MAX_CHARS) -> list[Conversation]:
    return [_code_item(task, ref, max_chars) for task, ref in _first(CODE_ITEMS, n, CODE_EDITING)]


def summarisation(n: int, max_chars: int = DEFAULT_MAX_CHARS) -> list[Conversation]:
    out = []
    for name in _first(SUMMARY_MODULES, n, SUMMARISATION):
        doc = clip(inspect.cleandoc(importlib.import_module(name).__doc__ or ""), max_chars)
        ask = f"Summarise the documentation of the Python module `{name}` below in five bullet points."
        out.append(Conversation(SUMMARISATION, name, f"{ask}\n\n{doc}"))
    return out


def _qa_item(ref: str, param: str, max_chars: int) -> Conversation:
    obj = _lookup(ref)
    name = ref.replace(":", ".")
    doc = clip(inspect.getdoc(obj) or "", max_chars)
    try:
        signature = f"{name}{inspect.signature(obj)}"
    except (TypeError, ValueError):  # some builtins have none
        signature = name
    if param in doc:
        question = f"What does the `{param}` argument of `{name}` do? Quote the sentence of the passage that says so."
    else:  # another Python version may document it differently
        question = f"What does `{name}` do? Quote the sentence of the passage that says so."
    prompt = f"Answer from this passage only.\n\nPassage: {signature}\n\n{doc}\n\nQuestion: {question}"
    return Conversation(DOCUMENT_QA, f"{name}:{param}", prompt)


def document_qa(n: int, max_chars: int = DEFAULT_MAX_CHARS) -> list[Conversation]:
    return [_qa_item(ref, param, max_chars) for ref, param in _first(QA_ITEMS, n, DOCUMENT_QA)]


def multi_turn_chat(n: int, max_chars: int = DEFAULT_MAX_CHARS) -> list[Conversation]:
    """Three turns on one function: the later turns quote the code and the first answer back."""
    out = []
    for ref in _first(CHAT_FUNCTIONS, n, MULTI_TURN_CHAT):
        source = clip(_source(ref), max_chars)
        first = f"Here is a function from Python's standard library:\n\n```python\n{source}\n```\n\nWhat does it do?"
        turns = (
            "Show the function again with a short comment above each line saying what the line does.",
            "Repeat your first explanation as a numbered list, one step per line.",
        )
        out.append(Conversation(MULTI_TURN_CHAT, ref, first, turns))
    return out


def open_ended(n: int, max_chars: int = DEFAULT_MAX_CHARS) -> list[Conversation]:
    return [Conversation(OPEN_ENDED, f"open-{i}", p) for i, p in enumerate(_first(OPEN_PROMPTS, n, OPEN_ENDED))]


BUILDERS = {
    CODE_EDITING: code_editing,
    SUMMARISATION: summarisation,
    DOCUMENT_QA: document_qa,
    MULTI_TURN_CHAT: multi_turn_chat,
    OPEN_ENDED: open_ended,
}


def _first(items: tuple, n: int, workload: str) -> tuple:
    if not 1 <= n <= len(items):
        raise ValueError(f"{workload} has {len(items)} built-in items; asked for {n}")
    return items[:n]


def build_workloads(
    workloads: tuple[str, ...] = WORKLOADS, per_workload: int = 2, max_chars: int = DEFAULT_MAX_CHARS
) -> list[Conversation]:
    """`per_workload` conversations of each named workload, in the order given (deterministic)."""
    unknown = [w for w in workloads if w not in BUILDERS]
    if unknown:
        raise ValueError(f"unknown workloads {unknown}; choose from {list(WORKLOADS)}")
    return [c for w in workloads for c in BUILDERS[w](per_workload, max_chars)]


PROMPT_FIELDS = {"workload", "prompt", "turns", "name"}


def _text(value, what: str, where: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise PromptFileError(f"{where}: {what} must be a non-empty string, got {value!r}")
    return value


def parse_prompt_line(line: str, where: str) -> Conversation:
    """One JSONL line -> Conversation; PromptFileError starting with `where` (file:line) if it is not one."""
    try:
        item = json.loads(line)
    except json.JSONDecodeError as exc:
        raise PromptFileError(f"{where}: not JSON ({exc.msg})") from exc
    if not isinstance(item, dict):
        raise PromptFileError(f"{where}: expected a JSON object, got {type(item).__name__}")
    if unknown := sorted(set(item) - PROMPT_FIELDS):
        raise PromptFileError(f"{where}: unknown fields {unknown}; allowed: {sorted(PROMPT_FIELDS)}")
    for required in ("workload", "prompt"):
        if required not in item:
            raise PromptFileError(f"{where}: missing {required!r}")
    turns = item.get("turns", [])
    if not isinstance(turns, list):
        raise PromptFileError(f"{where}: 'turns' must be a list of strings, got {type(turns).__name__}")
    return Conversation(
        workload=_text(item["workload"], "'workload'", where),
        name=_text(item.get("name", where), "'name'", where),
        prompt=_text(item["prompt"], "'prompt'", where),
        turns=tuple(_text(t, f"turns[{i}]", where) for i, t in enumerate(turns)),
    )


def load_prompts(path: str | Path) -> list[Conversation]:
    """Conversations from a JSONL file (blank lines skipped); PromptFileError names the bad line."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise PromptFileError(f"{path}: cannot read: {exc}") from exc
    out = [parse_prompt_line(line, f"{path}:{n}") for n, line in enumerate(lines, start=1) if line.strip()]
    if not out:
        raise PromptFileError(f"{path}: no prompts (one JSON object per line)")
    return out
