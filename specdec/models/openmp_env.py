"""OpenMP defaults for the model services; they must be set before torch is imported.

torch's CPU kernels run as OpenMP parallel regions, hundreds per forward. Between regions
libgomp's worker threads spin for GOMP_SPINCOUNT iterations, then sleep on a futex.
- OMP_WAIT_POLICY=PASSIVE (no spinning) makes every region a futex wake-up: a SmolLM2 decode
  on 2 cores takes ~110 ms instead of ~55 ms.
- libgomp's default spin (300,000 iterations, milliseconds) keeps a worker burning a core after
  the forward has ended. Draft and target often share cores, and the draft's forward starts
  right after the target's, so that spin slows the draft step (e2e on 2 cores: 16 vs 11 ms).
- 50,000 iterations cover the gaps inside a multi-row forward. With 10,000 the workers fell asleep
  in them on an AMX Xeon host (2026-12-05; step_bench, 400 cached tokens, medians): a 5-row Verify
  took 58 against 50 ms, 8 decodes 86 against 78, one decode 35 either way, and the served stack
  (suffix draft) ran 2-9% faster at 1 and 8 streams. After a forward the workers burned about
  1.1 ms of CPU at either count (2-3 ms at 100,000-300,000), and a co-located model draft's
  Propose cost the same within the noise (docs/performance.md, "One model thread per service").
- OpenMP keeps one team per thread that has run a parallel region, until that thread ends. Once
  the process holds more team threads than CPUs, libgomp spins only 100 iterations (the
  "throttled" count, whatever GOMP_SPINCOUNT says), so every region is a futex wake-up again. So
  the model thread's team must be the only one: the services load their model on a thread that
  then ends and runs on one torch thread meanwhile (until it ended, its team throttled the start-up
  calibration: `model_service.load_model`), and a process that runs tensor ops on other
  long-lived threads sets those to one thread (`threads.set_torch_threads(1)`: no team). Measured
  with step_bench's sessions (400 cached tokens, medians of 6 runs interleaved in one process):
  one step of 8 sessions x 1 token took 171 ms with the model thread's team alone and 284 ms
  beside a second, idle team (8 x 3: 331 vs 397 ms; 1 x 1: 81 vs 83 ms, as a one-row forward
  runs its matmuls on one thread).

Thread count: an OpenMP team larger than the CPUs the process may really run on (its affinity
mask, its cgroup's CPU quota: a Kubernetes CPU limit) waits at every barrier for a thread the
kernel has descheduled, and multi-row forwards, with more regions per forward, suffer most. Host
core counts are not the limit in a container, so the default follows `available_cpus()`.
Values already in the environment win.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from specdec.heap import keep_heap_pages

GOMP_SPINCOUNT_DEFAULT = "50000"
_CGROUP_V2 = Path("/sys/fs/cgroup/cpu.max")
_CGROUP_V1 = Path("/sys/fs/cgroup/cpu")


def cgroup_cpu_limit(v2: Path = _CGROUP_V2, v1: Path = _CGROUP_V1) -> float | None:
    """CPUs the cgroup's quota allows (quota / period), None without a quota."""
    try:
        quota, period = v2.read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota_us = int((v1 / "cpu.cfs_quota_us").read_text())
        period_us = int((v1 / "cpu.cfs_period_us").read_text())
        return None if quota_us <= 0 else quota_us / period_us
    except (OSError, ValueError):
        return None


def available_cpus() -> int:
    """CPUs this process may use: its affinity mask, capped by the cgroup quota (rounded up)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    limit = cgroup_cpu_limit()
    if limit is not None:
        cpus = min(cpus, max(1, math.ceil(limit)))
    return max(1, cpus)


def set_openmp_defaults() -> None:
    os.environ.setdefault("GOMP_SPINCOUNT", GOMP_SPINCOUNT_DEFAULT)
    os.environ.setdefault("OMP_NUM_THREADS", str(available_cpus()))
    keep_heap_pages()  # (not OpenMP, but every model process starts here: `specdec.heap`)
