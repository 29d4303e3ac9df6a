"""ModelRunner.step as one flattened ragged forward: each item's logits, hidden states and cache
are what `last_logits` gives for it alone.

Tolerance: the batched forward changes only the row count of each linear layer's matmul (M = T
rows instead of the item's own), and a segment's attention calls the same SDPA kernel on the same
mask as the solo forward. So the results may differ by float32 rounding of those matmuls alone:
max abs diff <= 1e-5 on logits of magnitude ~2-5 and on hidden states of magnitude ~1-3 (measured:
<= 1e-6 with each of the three linear layouts, often 0). A wrong position, mask or cache slot moves
them by 1e-2 or more (mutation: every segment without a mask fails five of these tests by 0.08-2.7).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from specdec.models.ragged import RAGGED_ATTENTION, build_batch, supports_ragged
from specdec.models.runner import ModelRunner, SessionKVCache, StepItem

ATOL = 1e-5


def _runner(model, max_entries: int = 8, max_tokens: int = 10_000) -> ModelRunner:
    # No governor: both runners compared run at the same thread count.
    return ModelRunner(model, SessionKVCache(max_entries=max_entries, max_tokens=max_tokens))


@contextmanager
def _forwards(model) -> Iterator[list[int]]:
    """Counts the model's forwards inside the block: transformers' and the fused layers' calls."""
    from specdec.models import ragged

    calls: list[int] = []
    handle = model.register_forward_pre_hook(lambda *_: calls.append(1))
    fused = ragged.fused_forward
    ragged.fused_forward = lambda *args, **kwargs: calls.append(1) or fused(*args, **kwargs)
    try:
        yield calls
    finally:
        handle.remove()
        ragged.fused_forward = fused


def _solo(runner: ModelRunner, item: StepItem):
    return runner.last_logits(
        item.session_id, item.token_ids, item.num_last, item.hidden_from, item.input_hidden, item.exact_len
    )


def _warm(runner: ModelRunner) -> None:
    """Sessions in the four states the step mixes (the same calls on each runner compared)."""
    runner.last_logits("decode", [1, 2, 3, 4, 5, 6, 7, 1, 2], 1)
    # A verify that rolls back: the cache holds 3 drafts, the request keeps 1 and diverges after it.
    runner.last_logits("verify", [4, 4, 2, 6, 1, 3, 5, 7], 4)


MIXED = [
    StepItem("fresh", [3, 1, 4, 1, 5, 2], 1),  # (a) no entry yet: a prefill
    StepItem("decode", [1, 2, 3, 4, 5, 6, 7, 1, 2, 6], 1),  # (b) cached, one new token
    StepItem("verify", [4, 4, 2, 6, 1, 3, 2, 0, 7, 1], 4),  # (c) cached to [.., 3], then 4 new after a rollback
    StepItem("", [7, 6, 5, 4, 3], 2),  # (d) uncached
]


def _assert_same(batched, solo, hidden: bool = False) -> None:
    torch.testing.assert_close(batched.logits, solo.logits, atol=ATOL, rtol=0)
    assert batched.cached_tokens == solo.cached_tokens
    if hidden:
        torch.testing.assert_close(batched.hidden, solo.hidden, atol=ATOL, rtol=0)
    else:
        assert batched.hidden is None and solo.hidden is None


def test_the_tiny_models_take_the_ragged_path(tiny_loaded):
    assert supports_ragged(tiny_loaded["target"].runner.model)
    assert supports_ragged(tiny_loaded["draft"].runner.model)


def test_a_mixed_step_is_one_forward_equal_to_each_item_alone(tiny_loaded):
    model = tiny_loaded["target"].runner.model
    batched, solo = _runner(model), _runner(model)
    _warm(batched)
    _warm(solo)
    with _forwards(model) as calls:
        results = batched.step(MIXED)
    assert len(calls) == 1  # one forward for four items
    expected = [_solo(solo, item) for item in MIXED]
    for got, want in zip(results, expected, strict=True):
        _assert_same(got, want)
    assert [r.cached_tokens for r in results] == [0, 9, 6, 0]
    assert [r.step_sequences for r in results] == [4] * 4 and _solo(solo, MIXED[3]).step_sequences == 1
    assert model.config._attn_implementation == "sdpa"  # restored after the step
    # The caches continue as the solo ones do: one more round on each session.
    for session, tokens in (("fresh", [3, 1, 4, 1, 5, 2, 0, 4]), ("decode", [1, 2, 3, 4, 5, 6, 7, 1, 2, 6, 3])):
        assert batched.cache.token_ids(session) == solo.cache.token_ids(session)
        _assert_same(batched.last_logits(session, tokens, 2), solo.last_logits(session, tokens, 2))
    verify = [4, 4, 2, 6, 1, 3, 2, 0, 7, 1, 5, 5]
    _assert_same(batched.step([StepItem("verify", verify, 3)])[0], solo.last_logits("verify", verify, 3))


def test_steps_over_many_rounds_keep_matching(tiny_loaded):
    """Sessions joining and leaving, verifies rolling back at random, for 30 steps."""
    import numpy as np

    model = tiny_loaded["target"].runner.model
    batched, solo = _runner(model), _runner(model)
    rng = np.random.default_rng(3)
    history = {f"s{i}": rng.integers(0, 8, size=rng.integers(1, 6)).tolist() for i in range(5)}
    for _ in range(30):
        sessions = rng.choice(sorted(history), size=rng.integers(2, 6), replace=False)
        items = []
        for s in sessions:
            drafts = rng.integers(0, 8, size=rng.integers(0, 5)).tolist()
            items.append(StepItem(str(s), history[s] + drafts, len(drafts) + 1))
            keep = int(rng.integers(0, len(drafts) + 1))
            history[s] = (history[s] + drafts[:keep] + [int(rng.integers(0, 8))])[-40:]
        for got, item in zip(batched.step(items), items, strict=True):
            _assert_same(got, _solo(solo, item))
    assert batched.cache.hits > 40


def test_hidden_states_match_their_solo_rows(tiny_loaded):
    model = tiny_loaded["target"].runner.model
    batched, solo = _runner(model), _runner(model)
    for runner in (batched, solo):
        runner.last_logits("h1", [3, 1, 4, 1, 5], 1, hidden_from=0)
        runner.last_logits("h2", [2, 7, 1, 6, 2, 6], 3, hidden_from=2)
    items = [
        StepItem("h1", [3, 1, 4, 1, 5, 2, 6], 2, hidden_from=3),  # rows partly from the stored ones
        StepItem("h2", [2, 7, 1, 6, 0], 2, hidden_from=1),  # a rollback past the stored rows
        StepItem("plain", [1, 1, 2], 1),  # no hidden states wanted
        StepItem("", [5, 4, 3, 2], 1, hidden_from=0),
    ]
    for got, item in zip(batched.step(items), items, strict=True):
        _assert_same(got, _solo(solo, item), hidden=item.hidden_from is not None)


@pytest.fixture(scope="module")
def hidden_draft(tiny_model_dirs):
    from specdec.models.draft_artifact import CONDITIONING_TARGET_HIDDEN, build_draft
    from specdec.models.loading import load_causal_lm

    target, _ = load_causal_lm(tiny_model_dirs["target"])
    draft = build_draft(target, 1, [1], conditioning=CONDITIONING_TARGET_HIDDEN)
    with torch.no_grad():  # an untrained fuse, perturbed so that what it is fed matters
        generator = torch.Generator().manual_seed(7)
        for param in [*draft.model.layers.parameters(), *draft.hidden_fuse.parameters()]:
            param.add_(0.5 * torch.randn(param.shape, generator=generator) * (param.std() + 0.05))
    draft.eval()
    return draft


def test_a_hidden_state_draft_batches_with_exact_len(hidden_draft):
    assert supports_ragged(hidden_draft)
    batched, solo = _runner(hidden_draft), _runner(hidden_draft)
    generator = torch.Generator().manual_seed(1)

    def fed(n: int) -> torch.Tensor:
        return torch.randn((n, hidden_draft.config.hidden_size), generator=generator)  # [n, H]

    prefix_a, prefix_b = fed(6), fed(4)
    for runner in (batched, solo):
        # Positions past exact_len were fed the draft's own guesses: not reusable.
        runner.last_logits("a", [1, 2, 3, 4, 5, 6], 1, input_hidden=prefix_a, exact_len=4)
        runner.last_logits("b", [2, 3, 4, 5], 1, input_hidden=prefix_b)
    items = [
        StepItem("a", [1, 2, 3, 4, 5, 6, 7], 1, input_hidden=torch.cat([prefix_a, fed(1)]), exact_len=6),
        StepItem("b", [2, 3, 4, 5, 1], 1, input_hidden=torch.cat([prefix_b, fed(1)])),
        StepItem("", [4, 4, 4], 2, input_hidden=fed(3)),
    ]
    results = batched.step(items)
    assert [r.cached_tokens for r in results] == [4, 4, 0]
    for got, item in zip(results, items, strict=True):
        _assert_same(got, _solo(solo, item), hidden=True)
    # Items feeding hidden states and items feeding tokens alone, in one step.
    mixed = [StepItem("a", [1, 2, 3, 4, 5, 6, 7, 0], 1, input_hidden=fed(8)), StepItem("c", [1, 2], 1)]
    for got, item in zip(batched.step(mixed), mixed, strict=True):
        _assert_same(got, _solo(solo, item), hidden=item.input_hidden is not None)


def test_lru_bounds_hold_after_steps(tiny_loaded):
    model = tiny_loaded["target"].runner.model
    runner = _runner(model, max_entries=2, max_tokens=14)
    runner.step([StepItem(s, [1, 2, 3, 4, 5], 1) for s in ("a", "b", "c")])
    assert len(runner.cache) == 2 and runner.cache.token_ids("a") is None  # the oldest put evicted
    runner.step([StepItem("b", [1, 2, 3, 4, 5, 6], 1), StepItem("d", list(range(1, 8)) + [1, 2, 3], 1)])
    assert runner.cache.total_tokens <= 14 and len(runner.cache) <= 2
    runner.step([StepItem("e", [1] * 20, 1), StepItem("f", [2], 1)])  # longer than the budget: not kept
    assert runner.cache.token_ids("e") is None and runner.cache.total_tokens <= 14


def test_malformed_or_repeated_items_fail_before_anything_runs(tiny_loaded):
    model = tiny_loaded["target"].runner.model
    runner = _runner(model)
    runner.last_logits("a", [1, 2, 3], 1)
    with _forwards(model) as calls:
        with pytest.raises(ValueError, match="distinct"):
            runner.step([StepItem("a", [1, 2, 3, 4], 1), StepItem("a", [1, 2, 3, 5], 1)])
        with pytest.raises(ValueError, match="num_last"):
            runner.step([StepItem("a", [1, 2, 3, 4], 1), StepItem("b", [1], 2)])
    assert not calls and runner.cache.token_ids("a") == [1, 2, 3]


def test_other_attention_implementations_run_items_one_by_one(tiny_model_dirs):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dirs["target"], attn_implementation="eager").eval()
    assert not supports_ragged(model)
    batched, solo = _runner(model), _runner(model)
    with _forwards(model) as calls:
        results = batched.step(MIXED)
    assert len(calls) == len(MIXED)
    for got, item in zip(results, MIXED, strict=True):
        _assert_same(got, _solo(solo, item))


def test_segment_masks_are_the_solo_forwards(tiny_loaded):
    """A decode and a prefill need no mask (SDPA's own is_causal / full row); a verify after a
    cached prefix sees its cache and the new rows up to itself."""
    from transformers import DynamicCache

    config = tiny_loaded["target"].runner.model.config
    cached = DynamicCache(config=config)
    for layer in range(config.num_hidden_layers):
        cached.update(torch.zeros(1, 2, 5, 8), torch.zeros(1, 2, 5, 8), layer)
    batch = build_batch([cached, DynamicCache(config=config), cached], [1, 3, 3], torch.device("cpu"))
    assert batch.segments[0].mask is None and batch.segments[1].mask is None
    assert batch.position_ids.tolist() == [[5, 0, 1, 2, 5, 6, 7]]
    mask = batch.segments[2].mask  # [1, 1, 3, 8]
    assert mask[0, 0].int().tolist() == [[1] * 6 + [0, 0], [1] * 7 + [0], [1] * 8]
    assert RAGGED_ATTENTION not in (config._attn_implementation,)


def test_a_failed_step_drops_its_sessions_and_restores_the_model(tiny_loaded):
    """Mid-forward the sessions' caches are half extended: they are not put back, the others stay."""
    model = tiny_loaded["target"].runner.model
    runner, fresh = _runner(model), _runner(model)
    _warm(runner)
    runner.last_logits("bystander", [1, 2, 3], 1)

    def fail(*_):
        raise RuntimeError("injected")

    handle = model.model.norm.register_forward_pre_hook(fail)  # (after the layers, on both paths)
    try:
        with pytest.raises(RuntimeError, match="injected"):
            runner.step(MIXED)
    finally:
        handle.remove()
    assert model.config._attn_implementation == "sdpa"
    assert runner.cache.token_ids("decode") is None and runner.cache.token_ids("verify") is None
    assert runner.cache.token_ids("bystander") == [1, 2, 3]
    for got, item in zip(runner.step(MIXED), MIXED, strict=True):
        torch.testing.assert_close(got.logits, _solo(fresh, item).logits, atol=ATOL, rtol=0)


def test_fresh_items_with_one_prompt_compute_it_once(tiny_loaded):
    """The samples of one request (or chats under one system prompt) arrive as fresh items opening
    with the same tokens: the prefix runs once, the others start from copies of its entry, and every
    item's logits and cache are still what its solo forward gives."""
    model = tiny_loaded["target"].runner.model
    batched, solo = _runner(model), _runner(model)
    prompt = [(3 * i + 1) % 8 for i in range(20)]
    items = [
        StepItem("s/0", [*prompt, 1], 1),
        StepItem("s/1", [*prompt, 2, 5, 6], 3),  # a verify of drafts
        StepItem("s/2", [*prompt[:18], 6, 7, 4], 2),  # diverges at 18: 18 shared
        StepItem("other", [5, 5, 5, 1, 2], 1),  # no company: runs alone in the step
    ]
    with _forwards(model) as calls:
        results = batched.step(items)
    assert len(calls) == 2  # the shared 18 tokens once, then the step
    assert [r.cached_tokens for r in results] == [18, 18, 18, 0]
    for got, item in zip(results, items, strict=True):  # against uncached forwards
        torch.testing.assert_close(
            got.logits, solo.last_logits("", item.token_ids, item.num_last).logits, atol=ATOL, rtol=0
        )
    for item in items:  # the entries are the sessions' own and continue like uncached forwards
        assert batched.cache.token_ids(item.session_id) == list(item.token_ids)
        more = [*item.token_ids, 3]
        torch.testing.assert_close(
            batched.last_logits(item.session_id, more, 2).logits,
            solo.last_logits("", more, 2).logits,
            atol=ATOL,
            rtol=0,
        )


def test_a_new_session_starts_from_a_cached_session_under_the_same_prompt(tiny_loaded):
    """A later session whose prompt opens like a cached one's (a system prompt) copies its keys and
    values for the shared positions, whole or in part, and computes what it would alone."""
    model = tiny_loaded["target"].runner.model
    runner, solo = _runner(model), _runner(model)
    system = [(5 * i + 2) % 8 for i in range(17)]
    runner.last_logits("first", [*system, 1, 2, 3], 1)
    cases = [
        ("whole", [*system, 1, 2, 3, 4], 2, 19),
        ("part", [*system, 6, 6], 1, 17),
        ("short", system[:15] + [0], 1, 0),
    ]
    for session, tokens, num_last, shared in cases:
        got = runner.last_logits(session, tokens, num_last)
        assert got.cached_tokens == shared
        torch.testing.assert_close(got.logits, solo.last_logits("", tokens, num_last).logits, atol=ATOL, rtol=0)
    assert runner.cache.token_ids("first") == [*system, 1, 2, 3]  # the source is untouched
    more = [*system, 1, 2, 3, 5]
    torch.testing.assert_close(
        runner.last_logits("first", more, 1).logits, solo.last_logits("", more, 1).logits, atol=ATOL, rtol=0
    )
