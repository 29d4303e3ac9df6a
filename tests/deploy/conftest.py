"""Fixtures of the deploy checks (helpers in deploy_support.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from deploy_support import OVERLAYS, load_compose, rendered_docs


@pytest.fixture(scope="session", params=OVERLAYS)
def overlay(request) -> str:
    return request.param


@pytest.fixture(scope="session")
def docs(overlay) -> list[dict]:
    return rendered_docs(overlay)


@pytest.fixture(scope="session")
def compose() -> dict:
    return load_compose()
