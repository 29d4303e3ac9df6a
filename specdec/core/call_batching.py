"""Concurrent requests' Verify calls as one call to the target pool (group commit).

Each generation runs its rounds on its own thread, so at 8 served streams the target pool got 8
Verify calls a step, each with its own hand-offs between threads and processes, and its model
thread waited for them to trickle in (a fifth of its time waiting for company, a sixth with no call
at all, at 8 streams on 2 cores). Here the first caller to arrive leads: it waits, at most `wait_s`,
for the callers whose calls are in flight or have come back (calls the pool ran in one step come
back together, then each caller does its coordinator work), then sends everything queued with its
sampling as one call and hands each caller its results; a caller not come within the wait is not
waited for again until its call comes back (a long one: a prompt) or it calls (a request ended).
One call's sequences are the same sequences the pool would batch into one step anyway: each gets
what it would get alone (the pool's contract).

A batch that fails is retried call by call on the callers' own threads, so an error (a bad request,
an expired deadline) stays with the request it concerns.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from specdec.core.protocols import NO_DEADLINE, Deadline, Verifier, VerifyRequest, VerifyResult
from specdec.core.sampling import Sampling


# Most sequences one batched call carries by default (the coordinator passes its SAMPLE_BATCH_SIZE,
# the sequences it sends in one call): at T = 1 a sequence's laws are ~1 MB dense at K = 4
# (V = 49,152), so a batch stays far under the channels' 256 MiB messages.
MAX_SEQUENCES = 64


@dataclass(eq=False)
class _Call:
    requests: list[VerifyRequest]
    sampling: Sampling
    deadline: Deadline
    arrived: float
    leads: bool = False
    results: list[VerifyResult] | None = None
    alone: bool = False  # its batch (of several callers) failed: it calls by itself
    error: BaseException | None = None  # its batch, itself alone, failed so
    done: bool = False

    @property
    def key(self) -> str:
        return self.requests[0].cache_key if self.requests else ""

    @property
    def steps(self) -> int:
        """Steps its call holds the pool for: a caller of one step does not wait out decode steps."""
        return max((r.rounds for r in self.requests), default=0) or 1


def _latest(deadlines: Sequence[Deadline]) -> Deadline:
    """The batch's deadline: the latest of its callers' (each checks its own after)."""
    ats = [d.at for d in deadlines]
    return NO_DEADLINE if None in ats else Deadline(max(ats))


@dataclass
class BatchStats:
    calls: int = 0  # callers' verify calls
    batches: int = 0  # calls made to the pool
    retried_alone: int = 0  # callers whose batch failed


class BatchingVerifier:
    """A `Verifier` that sends concurrent callers' requests to `verifier` as one call."""

    def __init__(
        self, verifier: Verifier, wait_s: float = 0.004, max_sequences: int = MAX_SEQUENCES, clock=time.monotonic
    ):
        self.verifier = verifier
        self.wait_s = wait_s
        self.max_sequences = max_sequences
        self.clock = clock
        self.stats = BatchStats()
        self._cond = threading.Condition()
        self._queue: list[_Call] = []
        self._leader = False  # a caller is gathering a batch
        # Callers by their first cache key. In flight: in a batch sent and not back. Away: their
        # batch came back and they have not called again. Both are due soon (calls sent to the pool
        # at once come back at once; a caller's next call follows its coordinator work), except
        # those waited for in vain once: an ended request (forgotten), a long call such as a prompt
        # (missed until it comes back).
        self._in_flight: set[str] = set()
        self._away: set[str] = set()
        self._missed: set[str] = set()

    def verify(self, requests: Sequence[VerifyRequest], sampling: Sampling, deadline: Deadline) -> list[VerifyResult]:
        if self.wait_s <= 0:
            with self._cond:
                self.stats.calls += 1
                self.stats.batches += 1
            return self.verifier.verify(requests, sampling, deadline)
        call = _Call(list(requests), sampling, deadline, self.clock())
        with self._cond:
            self.stats.calls += 1
            self._queue.append(call)
            self._away.discard(call.key)
            if not self._leader:
                self._leader = call.leads = True
            self._cond.notify_all()
            while not (call.leads or call.done):
                self._cond.wait()
        if call.leads:
            self._lead(call)
        if call.error is not None:
            raise call.error
        if call.alone:
            return self.verifier.verify(call.requests, sampling, deadline)
        deadline.check()
        return call.results

    def _lead(self, call: _Call) -> None:
        with self._cond:
            until = call.arrived + self.wait_s
            while (due := self._due()) and (left := until - self.clock()) > 0:
                self._cond.wait(left)
            self._missed |= due & self._in_flight
            self._away -= due
            batch = self._take(call)
            self._leader = bool(self._queue)
            if self._queue:  # another sampling's (or steps') callers: the oldest leads them
                self._queue[0].leads = True
                self._cond.notify_all()
            self._in_flight |= {c.key for c in batch}
            self.stats.batches += 1
        results, error = self._send(batch)
        with self._cond:
            for member in batch:
                member.done = True
                if error is not None and (len(batch) == 1 or not isinstance(error, Exception)):
                    member.error = error  # (an interrupt or exit is every caller's)
                elif error is not None:
                    member.alone = True
                    self.stats.retried_alone += 1
                else:
                    member.results, results = results[: len(member.requests)], results[len(member.requests) :]
                self._in_flight.discard(member.key)
                self._missed.discard(member.key)
                self._away.add(member.key)
            self._cond.notify_all()

    def _take(self, leader: _Call) -> list[_Call]:
        """The leader's call, then the queued calls of its sampling and steps in order while their
        sequences fit `max_sequences` (under _cond); the others stay queued."""
        batch, size = [leader], len(leader.requests)
        for other in self._queue:
            if other is not leader and other.sampling == leader.sampling and other.steps == leader.steps:
                if size + len(other.requests) <= self.max_sequences:
                    batch.append(other)
                    size += len(other.requests)
        taken = {id(c) for c in batch}
        self._queue = [c for c in self._queue if id(c) not in taken]
        return batch

    def _due(self) -> set[str]:
        """Callers a leader waits for: away or in flight, not missed, not queued (under _cond)."""
        return (self._away | (self._in_flight - self._missed)) - {c.key for c in self._queue}

    def _send(self, batch: list[_Call]) -> tuple[list[VerifyResult] | None, BaseException | None]:
        """(the batch's results in order, None) or (None, the call's error)."""
        requests = [r for c in batch for r in c.requests]
        try:
            return self.verifier.verify(requests, batch[0].sampling, _latest([c.deadline for c in batch])), None
        except BaseException as exc:  # noqa: BLE001 - raised by its caller, or each caller calls alone
            return None, exc

