"""The layers point one way (core -> models -> rpc -> services -> tools), with no import cycle,
and units stay short enough to read at once. Imports inside functions count too."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("specdec", "coordinator", "draft_service", "target_service", "gateway")
SERVICES = ("coordinator", "draft_service", "target_service", "gateway")
TOOLS = (
    "specdec.client",
    "specdec.cli",
    "specdec.compare",
    "specdec.inprocess",
    "specdec.distill",
    "specdec.local_redis",
)


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            if "v1" in path.relative_to(ROOT).parts:
                continue  # generated stubs
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            found[name] = path
    return found


def _imports(path: Path, known: dict[str, Path]) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            candidates = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        elif isinstance(node, ast.Import):
            candidates = [a.name for a in node.names]
        else:
            continue
        out.update(c for c in candidates if c in known or c.startswith("specdec.v1"))
    return out


def _layer(module: str) -> int:
    if module in ("specdec.settings", "specdec.heap"):
        return -1  # stdlib only; every service uses them (its settings, its malloc thresholds)
    for rank, prefixes in enumerate(
        [("specdec.core",), ("specdec.models",), ("specdec.rpc", "specdec.v1"), SERVICES, TOOLS]
    ):
        if module.startswith(prefixes):
            return rank
    raise AssertionError(f"{module} belongs to no layer: add it to one in this test")


def test_no_module_imports_a_higher_layer_or_a_sibling_service():
    known = _modules()
    wrong = []
    for module, path in known.items():
        for target in _imports(path, known):
            upward = _layer(target) > _layer(module)
            sibling = _layer(module) == 3 and _layer(target) == 3 and target.split(".")[0] != module.split(".")[0]
            if upward or sibling:
                wrong.append(f"{module} -> {target}")
    assert not wrong, wrong


def test_there_is_no_import_cycle():
    known = _modules()
    graph = {m: _imports(p, known) - {m} for m, p in known.items()}
    state: dict[str, int] = {}

    def visit(module: str, trail: list[str]) -> None:
        state[module] = 1
        for target in graph.get(module, ()):
            assert state.get(target) != 1, "cycle: " + " -> ".join([*trail[trail.index(target) :], target])
            if target not in state:
                visit(target, [*trail, target])
        state[module] = 2

    for module in graph:
        if module not in state:
            visit(module, [module])


def test_importing_the_coordinators_server_loads_no_torch():
    code = "import coordinator.server, sys; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=120)


def test_no_function_over_80_lines_and_no_servicer_over_150():
    long = []
    for module, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            length = getattr(node, "end_lineno", 0) - getattr(node, "lineno", 0) + 1
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and length > 80:
                long.append(f"{module}.{node.name}: {length} lines")
            if isinstance(node, ast.ClassDef) and node.name.endswith("Servicer") and length > 150:
                long.append(f"{module}.{node.name}: {length} lines")
    assert not long, long
