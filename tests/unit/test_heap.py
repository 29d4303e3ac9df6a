"""specdec.heap: glibc keeps the services' per-step temporaries of a few MB mapped."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from specdec.heap import keep_heap_pages

glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")

# Four blocks of 3.2 MB made and freed 50 times, as a step's laws are: the page faults it takes.
CYCLES = """
import resource, sys
import numpy as np
from specdec.heap import keep_heap_pages
kept = keep_heap_pages()
def cycle():
    a = np.ones(400_000); b = a * 2; c = b + a; d = c * b
for _ in range(5):
    cycle()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(50):
    cycle()
print(kept, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(env: dict[str, str]) -> tuple[bool, int]:
    done = subprocess.run([sys.executable, "-c", CYCLES], capture_output=True, text=True, env=env, check=True)
    kept, faults = done.stdout.split()
    return kept == "True", int(faults)


@glibc
def test_blocks_of_a_few_mb_stay_mapped_from_step_to_step():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    kept, faults = _faults(env)
    assert kept and faults < 500  # glibc's defaults: every page of every block, ~150,000
    kept, faults = _faults({**env, "SPECDEC_MALLOC_MMAP_THRESHOLD_MB": "0"})
    assert not kept and faults > 50_000


def test_a_threshold_that_is_not_a_number_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("SPECDEC_MALLOC_MMAP_THRESHOLD_MB", "lots")
    with pytest.raises(ValueError, match="whole number of MB"):
        keep_heap_pages()
