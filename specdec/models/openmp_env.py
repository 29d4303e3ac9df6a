"""OpenMP defaults for the model services; they must be set before torch is imported.

torch's CPU kernels run as OpenMP parallel regions, hundreds per forward. Between regions
libgomp's worker threads spin for GOMP_SPINCOUNT iterations, then sleep on a futex.
- OMP_WAIT_POLICY=PASSIVE (no spinning) makes every region a futex wake-up: a SmolLM2 decode
  on 2 cores takes ~110 ms instead of ~55 ms.
- libgomp's default spin (300,000 iterations, milliseconds) keeps a worker burning a core after
  the forward has ended. Draft and target often share cores, and the draft's forward starts
  right after the target's, so that spin slows the draft step (e2e on 2 cores: 16 vs 11 ms).
- 10,000 iterations cover the gaps inside a forward and end within a fraction of a millisecond.
Values already in the environment win.
"""

from __future__ import annotations

import os

GOMP_SPINCOUNT_DEFAULT = "10000"


def set_openmp_defaults() -> None:
    os.environ.setdefault("GOMP_SPINCOUNT", GOMP_SPINCOUNT_DEFAULT)
