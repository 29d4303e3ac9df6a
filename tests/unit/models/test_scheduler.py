"""StepScheduler with a fake runner: what shares a step, what waits, what fails."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from specdec.core.errors import AtCapacity, Cancelled, DeadlineExceeded
from specdec.core.protocols import NO_DEADLINE, Deadline
from specdec.models.runner import LogitsResult, StepItem
from specdec.models.scheduler import SchedulerLimits, StepScheduler, run_tasks
from specdec.rpc.metrics import AT_CAPACITY

BAD = 99  # a token the fake runner's step refuses


class FakeRunner:
    """Records each step's items; logits [1, 1] = the sum of the item's tokens."""

    def __init__(self):
        self._model_thread = ThreadPoolExecutor(max_workers=1)
        self.cache = None
        self.pads_uncached = True  # as ModelRunner: uncached sequences of a step go left-padded together
        self.steps: list[list[StepItem]] = []
        self.step_s = 0.0  # how long each step takes

    def submit(self, fn, *args):
        return self._model_thread.submit(fn, *args)

    def step(self, items):
        self.steps.append(list(items))
        time.sleep(self.step_s)
        if any(BAD in i.token_ids for i in items):
            raise ValueError("bad token")
        return [LogitsResult(torch.tensor([[float(sum(i.token_ids))]]), 0) for i in items]

    def batch_forward(self, sequences, num_last, hidden_from=None, input_hidden=None):
        return self.step([StepItem("", s, n) for s, n in zip(sequences, num_last, strict=True)])

    def hold(self) -> threading.Event:
        """Block the model thread until the returned event is set (calls queue meanwhile)."""
        release = threading.Event()
        self._model_thread.submit(release.wait, 10)
        return release

    def sessions(self) -> list[list[str]]:
        return [[i.session_id for i in step] for step in self.steps]


def counting_task(start: list[int], steps: int, log: list | None = None):
    """`steps` items; each appends the sum it received as the next token; returns the tokens."""
    tokens = list(start)
    for _ in range(steps):
        result = yield StepItem("", list(tokens), 1)
        tokens.append(int(result.logits[0, 0]))
        if log is not None:
            log.append(tokens[-1])
    return tokens


def session_task(session: str, steps: int = 1, tokens: int = 1):
    for _ in range(steps):
        yield StepItem(session, [1] * tokens, 1)
    return session


def scheduler(runner, **limits) -> StepScheduler:
    return StepScheduler(runner, SchedulerLimits(**{"batch_wait_s": 0.0, **limits}))


def call_in_thread(s: StepScheduler, tasks, deadline: Deadline = NO_DEADLINE, prepare=None):
    """Start s.run(tasks) in a thread; returns a function that joins it and gives (result, error)."""
    out: dict = {}

    def run():
        try:
            out["result"] = s.run(tasks, deadline, prepare)
        except Exception as exc:  # noqa: BLE001 - handed to the test
            out["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()

    def join():
        thread.join(10)
        assert not thread.is_alive()
        return out.get("result"), out.get("error")

    return join


def wait_queued(s: StepScheduler, count: int) -> None:
    until = time.monotonic() + 5
    while s.queued < count:
        assert time.monotonic() < until, s.queued
        time.sleep(0.001)


def test_concurrent_calls_share_one_step_and_get_their_own_results():
    runner = FakeRunner()
    s = scheduler(runner)
    release = runner.hold()
    joins = [call_in_thread(s, [(f"s{i}", counting_task([i], 3))]) for i in range(5)]
    wait_queued(s, 5)
    release.set()
    results = [join() for join in joins]
    # Each call's tokens are what it gets alone (run_tasks, one call at a time).
    for i, (result, error) in enumerate(results):
        assert error is None
        assert result == [run_tasks(FakeRunner(), [("", counting_task([i], 3))])[0]]
    assert [len(step) for step in runner.steps] == [5, 5, 5]
    assert s.stats.sizes == {5: 3} and s.stats.shared == 3 and s.queued == 0


def test_a_call_of_several_sequences_is_several_tasks_joined_in_order():
    runner = FakeRunner()
    s = scheduler(runner)
    result = s.run([("", counting_task([i], 2)) for i in range(4)])
    assert result == [[i, i, 2 * i] for i in range(4)]
    assert [len(step) for step in runner.steps] == [4, 4]
    assert s.stats.shared == 0  # one call


def test_tasks_of_one_session_never_share_a_step():
    runner = FakeRunner()
    s = scheduler(runner)
    release = runner.hold()
    first = call_in_thread(s, [("a", session_task("a", steps=2))])
    wait_queued(s, 1)
    second = call_in_thread(s, [("a", session_task("a", steps=1)), ("b", session_task("b", steps=1))])
    wait_queued(s, 3)
    release.set()
    assert first()[0] == ["a"] and second()[0] == ["a", "b"]
    # The second "a" waits for the first to finish (older first); "b" joins the first step.
    assert runner.sessions() == [["a", "b"], ["a"], ["a"]]


def test_uncached_sequences_share_steps():
    runner = FakeRunner()
    scheduler(runner).run([("", session_task("")) for _ in range(3)])
    assert runner.sessions() == [["", "", ""]]


def test_a_step_holds_at_most_max_batch_tokens_new_tokens_and_the_oldest_runs_even_if_larger():
    runner = FakeRunner()
    s = scheduler(runner, max_batch_tokens=4)
    release = runner.hold()
    joins = [call_in_thread(s, [(name, session_task(name, tokens=n))]) for name, n in (("big", 6), ("x", 2))]
    wait_queued(s, 2)
    joins += [call_in_thread(s, [(name, session_task(name, tokens=2))]) for name in ("y", "z")]
    wait_queued(s, 4)
    release.set()
    for join in joins:
        assert join()[1] is None
    assert runner.sessions() == [["big"], ["x", "y"], ["z"]]


def test_a_long_task_is_never_overtaken_by_newer_ones():
    """Budget for 2 one-token items a step while new calls keep arriving: the 8-step task that
    came first is in every step until it is done; a large task waits only for older ones."""
    runner = FakeRunner()
    s = scheduler(runner, max_batch_tokens=2)
    release = runner.hold()
    long = call_in_thread(s, [("long", session_task("long", steps=8))])
    wait_queued(s, 1)
    large = call_in_thread(s, [("large", session_task("large", tokens=3))])
    wait_queued(s, 2)
    newcomers = [call_in_thread(s, [(f"n{i}", session_task(f"n{i}"))]) for i in range(12)]
    wait_queued(s, 14)
    release.set()
    assert long()[1] is None and large()[1] is None
    for join in newcomers:
        assert join()[1] is None
    sessions = runner.sessions()
    assert all("long" in step for step in sessions[:8])
    assert sessions[8] == ["large"]  # the oldest left; it runs alone although over the budget


def test_the_wait_window_gathers_sessions_that_stepped_recently():
    runner = FakeRunner()
    s = StepScheduler(runner, SchedulerLimits(batch_wait_s=0.5))
    s.run([("a", session_task("a")), ("b", session_task("b"))])  # both stepped: company expected
    first = call_in_thread(s, [("a", session_task("a"))])
    time.sleep(0.1)
    second = call_in_thread(s, [("b", session_task("b"))])
    assert first()[1] is None and second()[1] is None
    assert runner.sessions()[1:] == [["a", "b"]]


def test_the_wait_window_ends_and_nobody_waits_without_expected_company():
    runner = FakeRunner()
    s = StepScheduler(runner, SchedulerLimits(batch_wait_s=0.3))
    started = time.monotonic()
    s.run([("a", session_task("a"))])  # nothing stepped recently: no wait
    assert time.monotonic() - started < 0.2
    s.run([("b", session_task("b"))])  # "a" is expected but never comes: waits the window, once
    assert 0.25 <= time.monotonic() - started < 1.0
    steps = len(runner.steps)
    started = time.monotonic()
    s.run([("a", session_task("a", steps=3)), ("b", session_task("b", steps=3))])  # both present
    assert time.monotonic() - started < 0.2 and len(runner.steps) == steps + 3


def test_a_full_queue_refuses_with_the_at_capacity_reason():
    runner = FakeRunner()
    s = scheduler(runner, max_queued_sequences=3)
    release = runner.hold()
    join = call_in_thread(s, [("a", session_task("a")), ("b", session_task("b"))])
    wait_queued(s, 2)
    with pytest.raises(AtCapacity) as err:
        s.run([("c", session_task("c")), ("d", session_task("d"))])
    assert err.value.code == "RESOURCE_EXHAUSTED" and err.value.reason == AT_CAPACITY
    assert s.run([]) == [] and s.queued == 2
    release.set()
    assert join()[0] == ["a", "b"]
    # An empty queue admits a call larger than it.
    assert len(s.run([(str(i), session_task(str(i))) for i in range(5)])) == 5


class Switch(Deadline):
    """A deadline the test ends: `error` is raised by check() once set."""

    def __init__(self):
        super().__init__(None)
        self.error: Exception | None = None

    def check(self) -> None:
        if self.error is not None:
            raise self.error


@pytest.mark.parametrize("error", [Cancelled("gone"), DeadlineExceeded("late")])
def test_a_cancelled_or_expired_task_leaves_between_steps_and_others_go_on(error):
    runner = FakeRunner()
    s = scheduler(runner)
    switch = Switch()
    log: list[int] = []
    stopping = counting_task([1], 10, log)
    release = runner.hold()
    doomed = call_in_thread(s, [("", _relay(stopping, log, switch, error))], switch)
    other = call_in_thread(s, [("", counting_task([2], 5))])
    wait_queued(s, 2)
    release.set()
    result, raised = doomed()
    assert raised is error and result is None
    assert len(log) == 2  # two steps ran; none after the switch
    assert other()[0] == [[2, 2, 4, 8, 16, 32]]
    assert s.queued == 0


def _relay(inner, log: list, switch: Switch, error: Exception):
    """`inner`'s items, ending the switch once two results have come back."""
    item = next(inner)
    while True:
        result = yield item
        try:
            item = inner.send(result)
        except StopIteration as stop:
            return stop.value
        if len(log) == 2:
            switch.error = error


def test_a_deadline_passed_while_queued_runs_nothing():
    runner = FakeRunner()
    s = scheduler(runner)
    release = runner.hold()
    join = call_in_thread(s, [("a", session_task("a"))], Deadline(time.monotonic() + 0.05))
    wait_queued(s, 1)
    time.sleep(0.1)
    release.set()
    assert isinstance(join()[1], DeadlineExceeded)
    assert runner.steps == [] and s.queued == 0


def test_a_failing_sequence_fails_only_its_call():
    runner = FakeRunner()
    s = scheduler(runner)
    release = runner.hold()
    bad = call_in_thread(s, [("", counting_task([BAD], 1)), ("", counting_task([5], 3))])
    good = call_in_thread(s, [("", counting_task([1], 2))])
    wait_queued(s, 3)
    release.set()
    assert isinstance(bad()[1], ValueError)
    assert good()[0] == [[1, 1, 2]]
    # The failed step was rerun item by item; the failed call's sibling left after it.
    assert [len(step) for step in runner.steps] == [3, 1, 1, 1, 1]
    assert s.queued == 0


def test_a_task_whose_post_processing_fails_fails_alone():
    def broken():
        yield StepItem("", [1], 1)
        raise RuntimeError("sampling failed")

    runner = FakeRunner()
    s = scheduler(runner)
    release = runner.hold()
    bad = call_in_thread(s, [("", broken())])
    good = call_in_thread(s, [("", counting_task([3], 2))])
    wait_queued(s, 2)
    release.set()
    assert isinstance(bad()[1], RuntimeError)
    assert good()[0] == [[3, 3, 6]]


def test_run_tasks_steps_in_lockstep_one_item_per_session():
    runner = FakeRunner()
    tasks = [("a", session_task("a", 2)), ("a", session_task("a", 1)), ("", session_task("", 1))]
    assert run_tasks(runner, tasks) == ["a", "a", ""]
    assert runner.sessions() == [["a", ""], ["a"], ["a"]]
    with pytest.raises(DeadlineExceeded):
        run_tasks(runner, [("", session_task(""))], Deadline(time.monotonic() - 1))


def test_step_items_give_each_item_its_solo_logits(tiny_loaded):
    """Cached items through runner.step, uncached ones through one padded forward: each result is
    last_logits of the item alone (hidden states only where asked), within float noise."""
    from specdec.models.scheduler import step_items

    runner = tiny_loaded["target"].runner
    runner.on_model_thread(runner.last_logits, "solo-a", [1, 2, 3], 1)
    items = [
        StepItem("step-a", [1, 2, 3, 4, 5], 2),  # fresh cached
        StepItem("", [3, 1, 4], 1),
        StepItem("", [2, 7, 1, 6, 2, 6], 3, hidden_from=2),
        StepItem("", [5], 1),
    ]
    together = runner.on_model_thread(step_items, runner, items)
    for item, result in zip(items, together, strict=True):
        alone = runner.on_model_thread(runner.last_logits, "", item.token_ids, item.num_last, item.hidden_from)
        torch.testing.assert_close(result.logits, alone.logits, rtol=1e-5, atol=1e-5)
        assert (result.hidden is None) == (alone.hidden is None)
        if alone.hidden is not None:
            torch.testing.assert_close(result.hidden, alone.hidden, rtol=1e-5, atol=1e-5)


def test_a_calls_prepare_gets_its_sequences_of_a_step_at_once_and_fails_only_that_call():
    runner = FakeRunner()
    s = scheduler(runner)
    seen: list[int] = []

    def doubled(results):
        seen.append(len(results))
        return [LogitsResult(2 * r.logits, 0) for r in results]

    def broken(results):
        raise ValueError("NaN logits")

    release = runner.hold()
    good = call_in_thread(s, [("", counting_task([i], 2)) for i in (1, 2, 3)], NO_DEADLINE, doubled)
    bad = call_in_thread(s, [("", counting_task([5], 2))], NO_DEADLINE, broken)
    wait_queued(s, 4)
    release.set()
    assert good()[0] == [[1, 2, 6], [2, 4, 12], [3, 6, 18]]
    assert isinstance(bad()[1], ValueError)
    assert seen == [3, 3] and [len(step) for step in runner.steps] == [4, 3]
    assert run_tasks(FakeRunner(), [("", counting_task([1], 2))], NO_DEADLINE, doubled) == [[1, 2, 6]]


def test_every_result_of_a_step_says_what_the_whole_step_carried_and_cost():
    """The K policy weighs its rows against the step's: its items, and their new rows past each cache."""
    from specdec.models.scheduler import step_items

    class Cached(FakeRunner):
        def step(self, items):
            results = super().step(items)
            return [LogitsResult(r.logits, 2 if i.session_id else 0) for r, i in zip(results, items, strict=True)]

    runner = Cached()
    items = [StepItem("a", [1, 2, 3], 1), StepItem("b", [1, 2, 3, 4, 5], 3)]
    results = runner.submit(step_items, runner, items).result()
    assert [(r.step_sequences, r.step_rows) for r in results] == [(2, 1 + 3)] * 2


def test_a_steps_laws_are_prepared_on_one_thread_and_the_forwards_keep_theirs():
    """Delivering a step wakes its callers on the other cores; the laws' small ops run on the model
    thread alone meanwhile (`threads.one_thread`), and the next forward gets its threads back."""
    runner = FakeRunner()
    s = scheduler(runner)
    runner.submit(torch.set_num_threads, 2).result()
    during = []

    def laws(results):
        during.append(torch.get_num_threads())
        return results

    join = call_in_thread(s, [("", counting_task([1], 2))], NO_DEADLINE, laws)
    assert join() == ([[1, 1, 2]], None)
    assert during == [1, 1] and runner.submit(torch.get_num_threads).result() == 2
