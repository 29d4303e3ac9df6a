"""Whether the draft pool may be asked for proposals: one object per coordinator, shared by its
requests, so that a draft that is down costs one failed Propose per back-off, not one per round.

A failed Propose (or Info) marks the pool down for `backoff_s`; rounds meanwhile run at K = 0,
which is still exactly lossless. Once the back-off has passed, the first request to ask gets
to probe (and the back-off restarts for everyone else, so only it probes); its success makes
the pool healthy again, its failure starts a new back-off.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class DraftHealth:
    def __init__(self, backoff_s: float = 30.0, clock: Callable[[], float] = time.monotonic):
        self.backoff_s = backoff_s
        self._clock = clock
        self._lock = threading.Lock()
        self._down_until: float | None = None  # None: healthy
        self.failures = 0  # failed Proposes / Infos
        self.fallback_rounds = 0  # rounds run at K = 0 because of the draft (every request's)

    @property
    def healthy(self) -> bool:
        with self._lock:
            return self._down_until is None

    def may_propose(self) -> bool:
        """True when healthy, or for the one caller that probes after a back-off."""
        with self._lock:
            if self._down_until is None:
                return True
            now = self._clock()
            if now < self._down_until:
                return False
            self._down_until = now + self.backoff_s  # this caller probes; the others keep waiting
            return True

    def succeeded(self) -> None:
        with self._lock:
            self._down_until = None

    def failed(self) -> None:
        with self._lock:
            self._down_until = self._clock() + self.backoff_s
            self.failures += 1

    def count_fallback(self, rounds: int = 1) -> None:
        with self._lock:
            self.fallback_rounds += rounds
