"""Chunked prefill: a long prompt runs over several steps, each decoding stream keeps its steps,
and what the prompt's item receives is what it gets run whole."""

from __future__ import annotations

import torch
from test_scheduler import FakeRunner, call_in_thread, session_task, wait_queued

from specdec.models.runner import ModelRunner, SessionKVCache, StepItem
from specdec.models.scheduler import SchedulerLimits, StepScheduler


class FakeCache:
    """What a runner's cache tells the scheduler: the tokens each session's entry holds."""

    def __init__(self):
        self.held: dict[str, list[int]] = {}

    def token_ids(self, session: str) -> list[int] | None:
        return self.held.get(session)


class CachingRunner(FakeRunner):
    """A FakeRunner whose sessions keep the tokens of their last item, as ModelRunner's do."""

    def __init__(self):
        super().__init__()
        self.cache = FakeCache()
        self.new_tokens: list[int] = []  # per step, past what the sessions held

    def step(self, items):
        results = super().step(items)
        self.new_tokens.append(sum(len(i.token_ids) - len(self.cache.held.get(i.session_id, ()))for i in items))
        for item in items:
            if item.session_id:
                self.cache.held[item.session_id] = list(item.token_ids)
        return results


def prompt_task(session: str, length: int, num_last: int = 1, **fields):
    result = yield StepItem(session, [1] * length, num_last, **fields)
    return float(result.logits[0, 0])


def chunked(chunk: int = 256, **limits) -> tuple[StepScheduler, CachingRunner]:
    runner = CachingRunner()  # (the scheduler holds it weakly)
    return StepScheduler(runner, SchedulerLimits(batch_wait_s=0.0, prefill_chunk_tokens=chunk, **limits)), runner


def lengths(runner: CachingRunner) -> list[list[int]]:
    return [[len(item.token_ids) for item in step] for step in runner.steps]


def test_a_long_prompt_runs_in_chunks_and_its_item_gets_one_result():
    s, s_runner = chunked(256)
    assert s.run([("p", prompt_task("p", 600))]) == [600.0]  # (the fake logits: the sum of the tokens)
    assert lengths(s_runner) == [[256], [512], [600]]
    assert [step[0].num_last for step in s_runner.steps] == [1, 1, 1]


def test_a_decoding_stream_shares_every_step_with_the_chunks_instead_of_waiting_behind_them():
    s, s_runner = chunked(100)
    release = s_runner.hold()
    joins = [
        call_in_thread(s, [("a", session_task("a", steps=4))]),  # four decode steps
        call_in_thread(s, [("p", prompt_task("p", 350))]),
    ]
    wait_queued(s, 2)
    release.set()
    assert [join()[1] for join in joins] == [None, None]
    assert [sorted(step) for step in s_runner.sessions()] == [["a", "p"]] * 4
    assert [len(i.token_ids) for step in s_runner.steps for i in step if i.session_id == "p"] == [100, 200, 300, 350]


def test_what_does_not_split():
    s, s_runner = chunked(16)
    s.run([("v", prompt_task("v", 30, num_last=20))])  # beyond the logits rows: 10 <= 16 tokens
    s.run([("h", prompt_task("h", 40, hidden_from=0))])  # hidden states asked for: one forward
    s.run([("x", prompt_task("x", 40, exact_len=40))])  # a draft's item fed hidden states
    s.run([("", prompt_task("", 40))])  # uncached: nothing to hold the chunks
    assert lengths(s_runner) == [[30], [40], [40], [40]]
    s_runner.cache.held["c"] = [1] * 30
    s.run([("c", prompt_task("c", 50))])  # 30 cached: 20 left, past the chunk: 16 then the rest
    assert lengths(s_runner)[4:] == [[46], [50]]
    off, off_runner = chunked(0)
    off.run([("p", prompt_task("p", 600))])
    assert lengths(off_runner) == [[600]]


def test_a_runner_without_a_cache_never_splits():
    runner = FakeRunner()
    s = StepScheduler(runner, SchedulerLimits(batch_wait_s=0.0, prefill_chunk_tokens=8))
    s.run([("p", prompt_task("p", 40))])
    assert [len(step[0].token_ids) for step in runner.steps] == [40]


def test_chunks_count_against_the_step_token_budget():
    s, s_runner = chunked(64, max_batch_tokens=100)
    release = s_runner.hold()
    joins = [call_in_thread(s, [(name, prompt_task(name, 200))]) for name in ("p", "q")]
    wait_queued(s, 2)
    release.set()
    assert [join()[1] for join in joins] == [None, None]
    assert max(s_runner.new_tokens) <= 100, s_runner.new_tokens  # never two chunks of 64 in one step
    assert len(s_runner.steps) < 2 * 4


PROMPT = [(5 * i + 3) % 8 for i in range(40)]


def real_chunked(model) -> tuple[StepScheduler, ModelRunner, list[int]]:
    """A scheduler splitting prompts into chunks of 8 over a real runner, and the sequences of
    each step it runs."""
    runner = ModelRunner(model, SessionKVCache(max_entries=8, max_tokens=10_000))
    s = StepScheduler(runner, SchedulerLimits(batch_wait_s=0.0, prefill_chunk_tokens=8))
    steps: list[int] = []
    s.step_observers.append(lambda sequences, _: steps.append(sequences))
    return s, runner, steps


def item_task(session: str, tokens: list[int], num_last: int = 1):
    result = yield StepItem(session, tokens, num_last)
    return result


def test_chunked_logits_and_cache_are_the_whole_prompt_s(tiny_loaded):
    """Through the real runner: the prompt's logits (and the session's next round) are what one
    forward over the whole prompt gives, up to float32 noise of the kernels (ATOL as test_ragged)."""
    model = tiny_loaded["target"].runner.model
    whole = ModelRunner(model, SessionKVCache(max_entries=8, max_tokens=10_000))
    s, split, steps = real_chunked(model)
    for tokens, num_last in ((PROMPT, 3), ([*PROMPT, 1, 2], 2)):
        got = s.run([("s", item_task("s", tokens, num_last))])[0]
        want = whole.last_logits("s", tokens, num_last)
        torch.testing.assert_close(got.logits, want.logits, atol=1e-5, rtol=0)
    assert len(steps) == 5 + 1  # chunks to 8, 16, 24, 32, then the whole 40; the next round: one
    assert split.cache.token_ids("s") == [*PROMPT, 1, 2]


def test_a_new_session_under_a_cached_prompt_chunks_from_where_the_shared_part_ends(tiny_loaded):
    """A new session whose prompt another session already ran (a retry, a shared document) starts
    from that session's entry: its chunks begin past the shared positions instead of running
    them again from position 0."""
    model = tiny_loaded["target"].runner.model
    s, _, steps = real_chunked(model)
    s.run([("first", item_task("first", PROMPT))])
    steps.clear()
    tokens = [*PROMPT, 1, 2, 3]
    got = s.run([("second", item_task("second", tokens))])[0]
    assert steps == [1] and got.cached_tokens == len(PROMPT)  # one step over the last few tokens
    want = ModelRunner(model, SessionKVCache(max_entries=0, max_tokens=0)).last_logits("", tokens, 1)
    torch.testing.assert_close(got.logits, want.logits, atol=1e-5, rtol=0)
