"""Iteration-level batching on a model's thread: the sequences of concurrent calls share forwards.

A call's work is one *task* per sequence: a generator that yields the `StepItem`s it needs one at
a time and receives each `LogitsResult` (a Verify sequence: one item; a draft sequence: K items,
each depending on the token the previous one sampled). `StepScheduler` runs one
`ModelRunner.step` over the next item of every ready task and sends each result back, so tasks
join and leave between steps. Each step holds at most one item per session (a task of a session
already in the step waits for the next one), at most `max_batch_tokens` new tokens (the oldest
task runs even when it alone is larger), and takes tasks oldest first, so a task waits at most
until every task admitted before it has finished. Deadlines and cancellation are checked before
each step of a task; an error fails only the tasks it concerns.

Before a step, waiting calls wait for company only for sessions whose next call is due within
the wait: `CompanyForecast` learns each session's usual gap between the end of one call and the
next (its coordinator's work between rounds, the other pool's call) and forgets a session that
is overdue or did not come when it was waited for (its stream ended). The wait ends
`batch_wait_s` after the oldest waiting call's arrival or `batch_wait_share` of a usual step
after the previous step ended, whichever is later. Why after a step too: streams that
arrive while a step runs would otherwise start the next step alone the moment it ends, just
before the streams that step served come back, and the two groups alternate for good (measured
through the served stack, 8 streams on 2 CPU cores: 4.3 sequences a step instead of 7-8, each
stream waiting out two steps per token).

A prompt with more than `prefill_chunk_tokens` new tokens runs over several steps (chunked
prefill, as vLLM's): each step fills its session's cache with the next part (an item of its own,
whose logits nobody reads) beside the other tasks' items, and the last step runs the item itself
from there, so it receives what it would run whole. Why: a long prompt's forward stalls every
decoding stream of its step (on 2 CPU cores a 384-token prefill costs ~1.5 s, a decode step
0.1-0.3 s).

Before each step `DraftRows` (`specdec.models.draft_rows`) may leave out the tail of an item's
drafted rows (those a round of auto K's lookup drafts carries gains for) where their expected
tokens do not pay for what the rows cost the whole step; it fits each step's seconds to do so.

`run_tasks` drives tasks to completion on the calling thread, with no scheduler: the reference
the scheduler is tested against, and the path of direct calls (tests, tools).
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
import weakref
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from specdec.core.errors import AtCapacity, Unavailable
from specdec.core.protocols import NO_DEADLINE, Deadline
from specdec.core.tokens import common_prefix_length
from specdec.models.draft_rows import DraftRows
from specdec.models.runner import LogitsResult, StepItem
from specdec.models.threads import one_thread

log = logging.getLogger(__name__)

# A sequence's work: yields StepItems, receives their LogitsResults, returns the sequence's result.
Task = Generator[StepItem, LogitsResult, Any]
# (session id, task): the id the task's items carry ("" = uncached; such tasks never conflict).
SessionTask = tuple[str, Task]
# A call's post-processing of its tasks' results of one step, all at once (one warp of every
# sequence's logits rather than one per sequence): what it returns is what the tasks receive.
Prepare = Callable[[list[LogitsResult]], Sequence[Any]]

# A session whose last call ended longer ago than this is company no longer (nor such a gap a
# stream's cadence: its client paused).
COMPANY_WINDOW_S = 1.0
# Smoothing of the gap estimates (as TCP's round-trip estimator: mean and mean deviation).
GAP_GAIN, DEV_GAIN = 0.25, 0.25
# Sessions whose cadence is remembered (least recently ended forgotten first).
MAX_CADENCES = 4096
# Smoothing of the usual step's seconds (the wait's share is of it, not of one prefill's step).
STEP_GAIN = 0.125


@dataclass(frozen=True)
class SchedulerLimits:
    batch_wait_s: float = 0.002  # longest a call waits for company from its arrival (0 = never)
    # ... and after a step, this share of a usual step's seconds, for the streams it just served:
    # their replies, coordinator rounds and next requests took 5-19 ms (p10-p90) against 15 ms
    # steps at 8 served streams on 2 cores, so a quarter of a step let half of them miss each step.
    batch_wait_share: float = 1.0
    # A prompt's new tokens past this many run over several steps (chunked prefill), so one
    # long prompt does not stall every decoding stream's step behind it; 0 = never split.
    prefill_chunk_tokens: int = 512
    max_batch_tokens: int = 2048  # new tokens per step (an older task larger than this runs alone)
    max_queued_sequences: int = 16384  # tasks admitted and not finished; beyond: AtCapacity

    def __post_init__(self):
        invalid = self.batch_wait_s < 0 or not 0 <= self.batch_wait_share <= 1 or self.prefill_chunk_tokens < 0
        if invalid or self.max_batch_tokens < 1 or self.max_queued_sequences < 1:
            raise ValueError(f"invalid scheduler limits: {self}")


class _Call:
    """One caller's tasks: their results in order, or the first error."""

    def __init__(self, count: int, deadline: Deadline, prepare: Prepare | None, steps_on: bool = False):
        self.prepare = prepare
        self.steps_on = steps_on  # its tasks, once stepped, are company (`StepScheduler.run`)
        self.results: list[Any] = [None] * count
        self.pending = count
        self.error: BaseException | None = None
        self.deadline = deadline
        self.done = threading.Event()
        # Its sequences' sessions as they finish: away (`CompanyForecast`) only once all have, as the
        # caller sends its next call after the whole result (a `num_samples` call's thousands).
        self.finished_sessions: list[str] = []

    def finish(self, index: int, value: Any) -> None:
        self.results[index] = value
        self.pending -= 1
        if self.pending == 0:
            self.done.set()

    def fail(self, error: BaseException) -> None:
        if self.error is None:
            self.error = error
        self.done.set()  # the caller raises at once; its other tasks leave before their next step


@dataclass(eq=False)
class _Task:
    session_id: str
    gen: Task
    call: _Call
    index: int  # position of the result in the call's list
    admitted_at: float  # time.monotonic() at submission
    item: StepItem | None = None  # the next item (None until primed on the model thread)
    chunk: StepItem | None = None  # this step runs only a leading part of the item's prompt
    done: bool = False  # finished or failed (then removed from the scheduler's list)
    # It has stepped and steps on in a call that asked so (decode steps): it is company for a step,
    # not a call waiting for some.
    continuing: bool = False
    rows: int = 0  # new rows of its part of the step being assembled (`_select`)


@dataclass
class StepStats:
    """What the steps carried (read by the metrics thread: plain counters)."""

    steps: int = 0
    sequences: int = 0  # items over all steps
    last_sequences: int = 0
    shared: int = 0  # steps that carried the sequences of more than one call
    sizes: collections.Counter = field(default_factory=collections.Counter)  # items per step -> steps
    company_waits: int = 0  # iterations that waited for an expected session
    company_missed: int = 0  # expected sessions that did not come within the wait (then forgotten)


@dataclass
class _Cadence:
    gap: float  # smoothed seconds from the end of one of the session's calls to its next call
    dev: float  # smoothed mean deviation of those gaps

    def learn(self, gap: float) -> None:
        self.dev += DEV_GAIN * (abs(gap - self.gap) - self.dev)
        self.gap += GAP_GAIN * (gap - self.gap)


class CompanyForecast:
    """Which absent sessions a new call should wait for: those whose next call is due.

    A session is *away* from the end of a call until its next call arrives; the gaps seen so far
    (per session, and over all sessions for one not seen twice yet) say when it is due. An away
    session is expected when it is due by the end of the wait (within twice its deviation);
    forgotten when it is overdue (later than four deviations or the wait, whichever is longer,
    as a finished stream is), when it was waited for and did not come, and after
    COMPANY_WINDOW_S. With no gap known anywhere yet, an away session is expected once.
    Times are the caller's (time.monotonic() in the scheduler); model thread only.
    """

    def __init__(self):
        self._away: dict[str, float] = {}  # session -> when its last call ended
        self._cadence: collections.OrderedDict[str, _Cadence] = collections.OrderedDict()
        self._pool: _Cadence | None = None  # over all sessions' gaps

    def ended(self, session: str, at: float) -> None:
        if session:
            self._away[session] = at

    def arrived(self, session: str, at: float) -> None:
        ended = self._away.pop(session, None)
        if ended is None or not 0 <= at - ended < COMPANY_WINDOW_S:
            return
        gap = at - ended
        for cadence in (self._cadence.get(session), self._pool):
            if cadence is not None:
                cadence.learn(gap)
        if session not in self._cadence:
            self._cadence[session] = _Cadence(gap, gap / 4)
        self._cadence.move_to_end(session)
        if len(self._cadence) > MAX_CADENCES:
            self._cadence.popitem(last=False)
        if self._pool is None:
            self._pool = _Cadence(gap, gap / 4)

    def expected(self, now: float, until: float, slack: float) -> set[str]:
        """Away sessions due by `until` (the end of the wait, `slack` long); drops the overdue."""
        due = set()
        for session, ended in list(self._away.items()):
            cadence = self._cadence.get(session, self._pool)
            if now - ended >= COMPANY_WINDOW_S:
                del self._away[session]
            elif cadence is None:
                due.add(session)
            elif now > ended + cadence.gap + max(4 * cadence.dev, slack):
                del self._away[session]  # overdue: its stream ended or paused
            elif ended + cadence.gap - 2 * cadence.dev <= until:
                due.add(session)
        return due

    def missed(self, sessions) -> None:
        """Sessions waited for that did not come: expected no more until their next call."""
        for session in sessions:
            self._away.pop(session, None)


class StepScheduler:
    """Batches the concurrent calls of one model (one per runner: `scheduler_for`).

    Nothing runs while there is no work: a submission queues one iteration on the model's
    thread, and an iteration that leaves work behind queues the next, so other users of the
    thread (another model in-process, calibration) interleave step by step.
    """

    def __init__(self, runner, limits: SchedulerLimits | None = None):
        self._runner_ref = weakref.ref(runner)  # the registry is keyed weakly by the runner
        self.limits = limits or SchedulerLimits()
        self.stats = StepStats()
        # Called with each step's (sequences, seconds) on the model thread (the services' histograms).
        self.step_observers: list[Callable[[int, float], None]] = []
        self._cond = threading.Condition()
        self._incoming: list[_Task] = []  # submitted, not yet primed (under _cond)
        self._queued = 0  # tasks admitted and not finished (under _cond)
        self._scheduled = False  # an iteration is queued or running on the model thread (under _cond)
        self._closed: str | None = None  # set by close(): why calls are refused
        # Model thread only:
        self._tasks: list[_Task] = []  # primed tasks, oldest first
        self._company = CompanyForecast()
        self.draft_rows = DraftRows()  # which drafted rows a step verifies (`specdec.models.draft_rows`)
        self._step_s = 0.0  # smoothed seconds of a step
        self._step_ended = 0.0  # time.monotonic() at the end of the last step

    @property
    def runner(self):
        runner = self._runner_ref()
        if runner is None:
            raise Unavailable("the model is gone")
        return runner

    @property
    def queued(self) -> int:
        return self._queued

    def configure(self, limits: SchedulerLimits) -> None:
        self.limits = limits  # read afresh by each iteration

    def close(self, reason: str = "the model service is shutting down", wait_s: float = 5.0) -> bool:
        """Refuse new calls and fail the admitted ones (Unavailable with `reason`) at once: none
        runs another step, and no iteration is queued after the one in progress (waited for up
        to `wait_s`). True when the model thread is then free of this scheduler."""
        with self._cond:
            self._closed = f"{reason}; retry on another replica"
            # Their callers return now; the model thread drops the tasks (their generators are
            # its own) in the next iteration, which steps nothing.
            for task in self._incoming + self._tasks:
                task.call.fail(Unavailable(self._closed))
            self._cond.notify_all()  # an iteration waiting for company
            return self._cond.wait_for(lambda: not self._scheduled, wait_s)

    # ------------------------------------------------------------ callers' side

    def run(
        self,
        tasks: Sequence[SessionTask],
        deadline: Deadline = NO_DEADLINE,
        prepare: Prepare | None = None,
        steps_on: bool = False,
    ) -> list[Any]:
        """The results of one call's tasks, in order; raises the first error of any of them.
        `prepare`: what the tasks receive instead of their LogitsResults (per step, all at once).
        `steps_on`: its tasks, after their first step, are company rather than calls waiting for
        some (decode steps: `_steps_on`); a draft's steps keep waiting, which keeps concurrent
        streams' Proposes, and so their Verifies, in step."""
        if not tasks:
            return []
        call = _Call(len(tasks), deadline, prepare, steps_on)
        self._admit(tasks, call)
        call.done.wait()
        if call.error is not None:
            raise call.error
        return call.results

    def _admit(self, tasks: Sequence[SessionTask], call: _Call) -> None:
        now = time.monotonic()
        with self._cond:
            if self._closed is not None:
                raise Unavailable(self._closed)
            limit = self.limits.max_queued_sequences
            # A call larger than the whole queue still runs once the queue is empty.
            if self._queued and self._queued + len(tasks) > limit:
                raise AtCapacity(f"{self._queued} sequences are queued (limit {limit}); retry shortly")
            self._incoming += [_Task(sid, gen, call, i, now) for i, (sid, gen) in enumerate(tasks)]
            self._queued += len(tasks)
            self._cond.notify_all()  # an iteration waiting for company
            if not self._scheduled:
                self._scheduled = True
                self._submit_iteration()

    def _submit_iteration(self) -> None:
        """Queue an iteration on the model thread (under _cond); on failure, fail what waits."""
        try:
            self.runner.submit(self._iteration)
        except Exception as exc:  # noqa: BLE001 - the executor is shut down, or the model is gone
            self._scheduled = False
            for task in self._incoming + self._tasks:
                task.call.fail(exc)
                task.done = True
            self._queued -= len(self._incoming) + len(self._tasks)
            self._incoming, self._tasks = [], []

    # ------------------------------------------------------------ the model thread's loop

    def _iteration(self) -> None:
        """One step on the model thread: wait briefly for company, gather, forward, route."""
        batch: list[_Task] = []
        try:
            if self._closed is not None:
                self._drop_all()
                return
            self._wait_for_company()
            self._take_incoming()
            batch = self._select()
            if batch:
                self._step(batch)
        except BaseException as exc:  # a bug here must not leave callers waiting
            log.exception("scheduler iteration failed")
            for task in batch or list(self._tasks):
                self._fail(task, exc)
            self._compact()
        finally:
            self._reschedule()

    def wait_until(self, oldest_arrival: float) -> float | None:
        """When calls waiting since `oldest_arrival` stop waiting for company (time.monotonic()):
        batch_wait_s after that arrival, or batch_wait_share of a usual step after the last step
        ended, whichever is later, so a wait after a step costs at most that share of one (a
        fixed floor there would halve a 2 ms step's throughput). None: never wait."""
        limits = self.limits
        if limits.batch_wait_s <= 0:
            return None
        return max(oldest_arrival + limits.batch_wait_s, self._step_ended + limits.batch_wait_share * self._step_s)

    def _wait_for_company(self) -> None:
        """Wait (until `wait_until`) while a session whose next call is due by then is absent:
        a stream between two rounds."""
        with self._cond:
            waiting = self._tasks or self._incoming  # both lists are oldest first
            until = self.wait_until(waiting[0].admitted_at) if waiting else None
            if until is None or self._fills_a_step() or self._steps_on():
                return
            slack = max(self.limits.batch_wait_s, self.limits.batch_wait_share * self._step_s)
            expected = self._company.expected(time.monotonic(), until, slack)
            waited = False
            while expected and self._closed is None:
                expected -= {t.session_id for t in self._tasks} | {t.session_id for t in self._incoming}
                left = until - time.monotonic()
                if expected and left <= 0:
                    if waited:  # (a call that has already waited its window at arrival marks none)
                        self._company.missed(expected)
                        self.stats.company_missed += len(expected)
                    break
                if expected:
                    waited = True
                    self._cond.wait(left)
            self.stats.company_waits += waited

    def _steps_on(self) -> bool:
        """Whether a task is in the middle of a `steps_on` call: a step that carries a stream whose
        next tokens the target samples itself (decode steps) does not stop for an absent one, which
        joins the step after it comes back (8 streams with decode steps: the model thread waited
        for company 20% of its time; without these waits 278 / 346 tok/s against 269, ITL p99
        98 / 82 against 165 ms)."""
        return any(task.continuing for task in self._tasks)

    def _fills_a_step(self) -> bool:
        """Whether the waiting tasks' rows alone reach a step's token budget (a `num_samples` call
        of thousands of sequences), so no company could join the next step. A task's rows read
        (`num_last`; an unprimed task: one) are a lower bound of its new tokens."""
        budget, rows = self.limits.max_batch_tokens, 0
        for task in itertools.chain(self._tasks, self._incoming):
            rows += task.item.num_last if task.item is not None else 1
            if rows >= budget:
                return True
        return False

    def _drop_all(self) -> None:
        """Closed: every task leaves unstepped (their calls have failed already)."""
        with self._cond:
            new, self._incoming = self._incoming, []
        for task in self._tasks + new:
            self._drop(task)
        self._compact()

    def _take_incoming(self) -> None:
        with self._cond:
            new, self._incoming = self._incoming, []
        for task in new:
            self._company.arrived(task.session_id, task.admitted_at)
            # Priming runs the task's set-up on this thread (torch ops stay on the model thread).
            self._tasks.append(task)
            self._advance(task, None)
        self._compact()

    def _select(self) -> list[_Task]:
        """The next step: oldest task first, one item per session, within the token budget."""
        budget = self.limits.max_batch_tokens
        batch: list[_Task] = []
        sessions: set[str] = set()
        tokens = 0
        for task in self._tasks:
            if tokens >= budget:
                break
            if task.call.error is not None:
                self._drop(task)  # a sibling failed: nobody reads this one
                continue
            if task.session_id and task.session_id in sessions:
                continue  # the session's cache is in use by an older task of this step
            task.chunk = self._chunk(task.item)
            cost = self._new_tokens(task.chunk or task.item)
            if batch and tokens + cost > budget:
                continue
            try:
                task.call.deadline.check()
            except Exception as exc:  # noqa: BLE001 - DeadlineExceeded / Cancelled
                self._fail(task, exc)
                continue
            batch.append(task)
            sessions.add(task.session_id)
            tokens += cost
            task.rows = cost
        self._compact()
        return batch

    def _new_tokens(self, item: StepItem) -> int:
        """Tokens the item's forward runs: past what its session's cache holds (the runner's
        own reuse rules may run a few more; this only bounds a step's size)."""
        return len(item.token_ids) - self._reused(item)

    def _reused(self, item: StepItem) -> int:
        cache = getattr(self.runner, "cache", None)
        held = cache.token_ids(item.session_id) if cache is not None and item.session_id else None
        tokens = item.token_ids
        if not held:
            # A new session starts from another's entry where one shares its prompt (`_fork`):
            # chunks then start past those positions instead of running them again.
            forked = getattr(self.runner, "fork_length", None)
            return forked(tokens, len(tokens) - item.num_last) if forked is not None and item.session_id else 0
        # Usually the entry holds a prefix of the item (a session's next round): compared at C speed.
        common = len(held) if list(tokens[: len(held)]) == held else common_prefix_length(held, tokens)
        return min(common, len(tokens) - item.num_last)

    def _chunk(self, item: StepItem) -> StepItem | None:
        """The leading part of a long prompt to run this step (its logits unread: it only fills
        the session's cache), or None to run the whole item. Only a plain cached item splits:
        hidden states asked for or fed in come with the item's own forward."""
        chunk = self.limits.prefill_chunk_tokens
        plain = item.hidden_from is None and item.input_hidden is None and item.exact_len is None
        if not chunk or not item.session_id or not plain or len(item.token_ids) - item.num_last <= chunk:
            return None
        if getattr(self.runner, "cache", None) is None:
            return None  # nothing would hold the chunks
        end = self._reused(item) + chunk
        if end > len(item.token_ids) - item.num_last:
            return None  # what is left runs whole
        return StepItem(item.session_id, list(item.token_ids[:end]), 1)

    def _step(self, batch: list[_Task]) -> None:
        prompt = any(t.chunk is not None for t in batch)
        items, rows = self.draft_rows.trim([t.chunk or t.item for t in batch], sum(t.rows for t in batch))
        started = time.perf_counter()
        results = self._forward(items)
        seconds = time.perf_counter() - started
        self._step_s += STEP_GAIN * (seconds - self._step_s) if self._step_s else seconds
        if not prompt:  # (a prompt's chunk costs what no round's rows do)
            self.draft_rows.observe(len(batch), rows, seconds)
        for observe in self.step_observers:
            observe(len(batch), seconds)
        self.stats.steps += 1
        self.stats.sequences += len(batch)
        self.stats.last_sequences = len(batch)
        self.stats.sizes[len(batch)] += 1
        self.stats.shared += len({id(t.call) for t in batch}) > 1
        by_call: dict[_Call, list[tuple[_Task, LogitsResult]]] = {}
        for task, result in zip(batch, results, strict=True):
            if isinstance(result, BaseException):
                self._fail(task, result)
            elif task.chunk is not None:
                task.chunk = None  # the prompt's part is cached now; the item runs on from there
            else:
                by_call.setdefault(task.call, []).append((task, result))
                task.continuing = task.call.steps_on  # (if its call's next item follows: `_advance`)
        with one_thread():  # each delivery wakes a caller on another core (`threads.one_thread`)
            for call, done in by_call.items():
                self._deliver(call, done)
        self._compact()
        self._step_ended = time.monotonic()  # the served sessions are away from now

    def _deliver(self, call: _Call, done: list[tuple[_Task, LogitsResult]]) -> None:
        """Send a call's tasks their step's results, prepared together (a failure fails them)."""
        values: Sequence[Any] = [result for _, result in done]
        if call.prepare is not None:
            try:
                values = call.prepare(list(values))
            except Exception as exc:  # noqa: BLE001 - this call's post-processing: it alone fails
                for task, _ in done:
                    self._fail(task, exc)
                return
        for (task, _), value in zip(done, values, strict=True):
            self._advance(task, value)

    def _forward(self, items: list[StepItem]) -> list[LogitsResult | BaseException]:
        """The items' forward (`step_items`); when it fails, each item alone, so only the
        failing ones fail."""
        try:
            results = step_items(self.runner, items)
            if len(results) != len(items):
                raise RuntimeError(f"runner.step returned {len(results)} results for {len(items)} items")
            return results
        except Exception as exc:  # noqa: BLE001 - isolated below
            if len(items) == 1:
                return [exc]
            log.warning("a step of %d sequences failed (%s); running them one by one", len(items), exc)
            return [self._forward([item])[0] for item in items]

    def _advance(self, task: _Task, result: Any) -> None:
        """Send the task its result (None: start it); it yields its next item or finishes."""
        try:
            task.item = task.gen.send(result)
        except StopIteration as stop:
            self._finish(task)
            task.call.finish(task.index, stop.value)
        except Exception as exc:  # noqa: BLE001 - this task's post-processing failed: it alone fails
            self._fail(task, exc)

    def _fail(self, task: _Task, exc: BaseException) -> None:
        task.call.fail(exc)
        self._drop(task)

    def _drop(self, task: _Task) -> None:
        task.gen.close()
        self._finish(task)

    def _finish(self, task: _Task) -> None:
        if not task.done:
            task.done = True
            call = task.call
            call.finished_sessions.append(task.session_id)
            if len(call.finished_sessions) == len(call.results):
                now = time.monotonic()
                for session in call.finished_sessions:
                    self._company.ended(session, now)
            with self._cond:
                self._queued -= 1

    def _compact(self) -> None:
        self._tasks = [t for t in self._tasks if not t.done]

    def _reschedule(self) -> None:
        with self._cond:
            if self._tasks or self._incoming:
                self._submit_iteration()
            else:
                self._scheduled = False
                self._cond.notify_all()  # close() waits for this


# ---------------------------------------------------------------- a step's forwards


def step_items(runner, items: Sequence[StepItem]) -> list[LogitsResult]:
    """`runner.step` over the cached items, and the uncached ones (session "") in one padded
    `runner.batch_forward`: a ragged step runs attention sequence by sequence, so hundreds of
    short uncached samples (num_samples) ran 14x slower there than padded (200 x 5 tokens, tiny
    model). Both give each item what `last_logits` gives it alone, up to float noise.

    Each result also says what the whole step carried (items, new rows): a caller's K policy
    weighs its own rows against them."""
    results = _step_items(runner, items)
    rows = sum(len(item.token_ids) - r.cached_tokens for item, r in zip(items, results, strict=True))
    return [replace(r, step_sequences=len(items), step_rows=rows) for r in results]


def _step_items(runner, items: Sequence[StepItem]) -> list[LogitsResult]:
    uncached = [i for i, item in enumerate(items) if not item.session_id]
    if len(uncached) < 2 or not runner.pads_uncached:
        return list(runner.step(items))
    results: list[LogitsResult | None] = [None] * len(items)
    cached = [i for i, item in enumerate(items) if item.session_id]
    if cached:
        for i, result in zip(cached, runner.step([items[i] for i in cached]), strict=True):
            results[i] = result
    for group in (
        [i for i in uncached if items[i].input_hidden is None],
        [i for i in uncached if items[i].input_hidden is not None],
    ):
        for i, result in zip(group, _padded(runner, [items[i] for i in group]), strict=True):
            results[i] = result
    return results


def _padded(runner, items: list[StepItem]) -> list[LogitsResult]:
    if not items:
        return []
    want = [item.hidden_from is not None for item in items]
    fed = [item.input_hidden for item in items] if items[0].input_hidden is not None else None
    results = runner.batch_forward(
        [item.token_ids for item in items],
        [item.num_last for item in items],
        hidden_from=[item.hidden_from or 0 for item in items] if any(want) else None,
        input_hidden=fed,
    )
    # Hidden states only where last_logits returns them: asked for, or a draft fed hidden states.
    return [r if w or fed is not None else LogitsResult(r.logits, 0) for r, w in zip(results, want, strict=True)]


# ---------------------------------------------------------------- one scheduler per model

_SCHEDULERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_SCHEDULERS_LOCK = threading.Lock()


def scheduler_for(runner, limits: SchedulerLimits | None = None) -> StepScheduler:
    """The runner's scheduler, made on first use (every caller of a model shares its steps);
    `limits` given: they apply from the next step on."""
    with _SCHEDULERS_LOCK:
        scheduler = _SCHEDULERS.get(runner)
        if scheduler is None:
            scheduler = _SCHEDULERS[runner] = StepScheduler(runner, limits)
        elif limits is not None:
            scheduler.configure(limits)
        return scheduler


# ---------------------------------------------------------------- without a scheduler


def run_tasks(
    runner,
    tasks: Sequence[SessionTask],
    deadline: Deadline = NO_DEADLINE,
    prepare: Prepare | None = None,
) -> list[Any]:
    """Drive tasks to completion on this thread, all in lockstep (one item per session per
    step, the earlier task first); `deadline` is checked before each step. The first error
    ends the call."""
    results: list[Any] = [None] * len(tasks)
    items: list[StepItem | None] = [None] * len(tasks)  # each task's next item; None: finished
    for i, (_, gen) in enumerate(tasks):
        items[i] = _send(gen, None, results, i)
    while any(item is not None for item in items):
        deadline.check()
        chosen, sessions = [], set()
        for i, item in enumerate(items):
            if item is not None and not (tasks[i][0] and tasks[i][0] in sessions):
                chosen.append(i)
                sessions.add(tasks[i][0])
        outs = step_items(runner, [items[i] for i in chosen])
        outs = prepare(outs) if prepare is not None else outs
        for i, out in zip(chosen, outs, strict=True):
            items[i] = _send(tasks[i][1], out, results, i)
    return results


def _send(gen: Task, value: Any, results: list, i: int) -> StepItem | None:
    """The task's next item, or None once it has returned (its value then in results[i])."""
    try:
        return gen.send(value)
    except StopIteration as stop:
        results[i] = stop.value
        return None
