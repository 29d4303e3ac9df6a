"""Shared prefixes stored once (`kv_cache.fork_cache`, cascade attention in `ragged._after_prefix`):
sessions that open alike read one copy of the prefix's keys/values, and each still computes what
it would alone.

Tolerance as in test_ragged.py (ATOL 1e-5 on logits of magnitude ~2-5): splitting a softmax over
two halves and merging them by their log-sum-exps changes only float rounding (measured <= 1e-6);
a missed prefix, a wrong mask row or a wrong head group moves logits by 1e-2 or more.
The tiny models hold 64 positions, so these tests lower MIN_STORED_ONCE to 16.
"""

from __future__ import annotations

import pytest
import torch

from specdec.models import runner as runner_module
from specdec.models.cpu_layout import planned_linears
from specdec.models.kv_cache import ReservedLayer, fork_cache, new_cache, shared_prefix
from specdec.models.layouts import WEIGHT_MAJOR
from specdec.models.runner import ModelRunner, SessionKVCache, StepItem

ATOL = 1e-5


@pytest.fixture
def stored_once(monkeypatch):
    monkeypatch.setattr(runner_module, "MIN_STORED_ONCE", 16)


def _runner(model, max_entries: int = 32, max_tokens: int = 10_000) -> ModelRunner:
    return ModelRunner(model, SessionKVCache(max_entries=max_entries, max_tokens=max_tokens))


def _roots(runner: ModelRunner, sessions) -> set[int]:
    return {id(shared_prefix(runner.cache.peek(s).kv)[0]) for s in sessions}


def _same_as_alone(got, alone: ModelRunner, tokens, num_last) -> None:
    want = alone.last_logits("", tokens, num_last).logits
    torch.testing.assert_close(got.logits, want, atol=ATOL, rtol=0)


PROMPT = [(3 * i + 1) % 8 for i in range(30)]


def test_samples_of_one_prompt_store_it_once_and_compute_what_they_would_alone(tiny_loaded, stored_once):
    model = tiny_loaded["target"].runner.model
    runner, alone = _runner(model), _runner(model)
    items = [
        StepItem("s/0", [*PROMPT, 1], 1),
        StepItem("s/1", [*PROMPT, 2, 5, 6], 3),  # a verify of drafts: rows masked among their own
        StepItem("s/2", [*PROMPT[:24], 6, 7, 4], 2),  # diverges at 24: 24 shared
        StepItem("plain", [5, 5, 5, 1, 2], 1),  # no prefix: the plain path in the same step
    ]
    for got, item in zip(runner.step(items), items, strict=True):
        _same_as_alone(got, alone, item.token_ids, item.num_last)
    sessions = ["s/0", "s/1", "s/2"]
    assert None not in _roots(runner, sessions) and len(_roots(runner, sessions)) == 1
    assert shared_prefix(runner.cache.peek("plain").kv) == (None, 0)
    # The 24 shared positions once, then each session's own: 7 + 9 + 3, and 5 for "plain".
    assert runner.cache.total_tokens == 24 + (31 - 24) + (33 - 24) + (27 - 24) + 5
    for round_ in range(3):  # decoding on, batched and alone, each still as it would be alone
        for session in sessions:
            tokens = [*runner.cache.token_ids(session), round_ + 1]
            _same_as_alone(runner.last_logits(session, tokens, 1), alone, tokens, 1)
        steps = [StepItem(s, [*runner.cache.token_ids(s), 2, 3], 2) for s in sessions]
        for got, item in zip(runner.step(steps), steps, strict=True):
            _same_as_alone(got, alone, item.token_ids, item.num_last)


@pytest.fixture
def weight_major(tiny_loaded):
    """The tiny target with every linear as (W @ x^T)^T, a layout the services choose for some row
    counts: its outputs are transposed views, so a query's last dimension is not contiguous."""
    model = tiny_loaded["target"].runner.model
    plans = {id(linear.plan): linear.plan for group in planned_linears(model).values() for linear in group}
    assert plans, "the loaded target's linears are planned"
    kept = {key: (plan.default, plan.by_rows) for key, plan in plans.items()}
    for plan in plans.values():
        plan.default, plan.by_rows = WEIGHT_MAJOR, {}
    yield model
    for key, plan in plans.items():
        plan.default, plan.by_rows = kept[key]


def test_the_prefix_is_read_right_whatever_the_layout_of_the_query(weight_major, stored_once, monkeypatch):
    """The flash kernel cascade attention calls takes its inputs' strides on trust: a query whose
    last dimension is strided was misread (here 1.2e-3 off; on SmolLM2's 8-decode steps up to
    1.2x the largest |logit|). Cascade attention serves segments after a prefix too long for the
    compiled kernel (`COMPILED_MAX_ROWS`): the rest of a prompt under a cached one."""
    from specdec.models import ragged

    cascades = []
    original = ragged._after_prefix

    def spy(module, query, segments, scale):
        cascades.append(len(segments))
        return original(module, query, segments, scale)

    monkeypatch.setattr(ragged, "_after_prefix", spy)
    runner, alone = _runner(weight_major), _runner(weight_major)
    runner.last_logits("first", [*PROMPT, 1, 2, 3], 1)
    sessions = ["second", "third", "fourth"]
    tail = [6, 2] * 9  # past the compiled kernel's rows
    assert len(tail) > ragged.COMPILED_MAX_ROWS
    # Prompts' rest after the cached prefix (rows through a reshape that keeps the strided view), then decodes.
    items = [StepItem("second", [*PROMPT, *tail], 2), StepItem("third", [*PROMPT, 5, *tail], 1)]
    items.append(StepItem("fourth", [*PROMPT, 4], 1))
    for _ in range(2):
        for got, item in zip(runner.step(items), items, strict=True):
            _same_as_alone(got, alone, item.token_ids, item.num_last)
        items = [StepItem(s, [*runner.cache.token_ids(s), 7], 1) for s in sessions]
    assert cascades and len(_roots(runner, ["first", *sessions])) == 1


def test_a_session_under_a_cached_prompt_reads_it_and_the_source_still_matches(tiny_loaded, stored_once):
    model = tiny_loaded["target"].runner.model
    runner, alone = _runner(model), _runner(model)
    runner.last_logits("first", [*PROMPT, 1, 2, 3], 1)
    got = runner.last_logits("second", [*PROMPT, 4, 4], 2)
    assert got.cached_tokens == 30
    _same_as_alone(got, alone, [*PROMPT, 4, 4], 2)
    assert len(_roots(runner, ["first", "second"])) == 1  # the source moved its 30 into the prefix
    assert runner.cache.total_tokens == 30 + 3 + 2
    # A third, sharing more with the second than the prefix: reads the prefix, copies the rest.
    third = [*PROMPT, 4, 5]
    _same_as_alone(runner.last_logits("third", third, 1), alone, third, 1)
    assert len(_roots(runner, ["first", "second", "third"])) == 1
    more = [*PROMPT, 1, 2, 3, 5]
    _same_as_alone(runner.last_logits("first", more, 1), alone, more, 1)


@pytest.mark.parametrize("once", [False, True], ids=["copied", "stored-once"])
def test_new_sessions_of_one_step_each_read_their_own_longest_cached_prompt(tiny_loaded, monkeypatch, once):
    """Chats re-sent whole (a stateless API's next turn) share only the system prompt with each
    other, but each its whole history with the cached entry of its previous turn."""
    if once:
        monkeypatch.setattr(runner_module, "MIN_STORED_ONCE", 16)
    model = tiny_loaded["target"].runner.model
    runner, alone = _runner(model), _runner(model)
    system = PROMPT[:20]
    histories = [[*system, *([1, 2] * 6)], [*system, *([5, 3] * 6)]]  # 32 tokens each, 20 in common
    for i, history in enumerate(histories):
        runner.last_logits(f"turn-1/{i}", [*history, 7], 1)
    items = [StepItem(f"turn-2/{i}", [*history, 7, 6, 4], 1) for i, history in enumerate(histories)]
    for got, item in zip(runner.step(items), items, strict=True):
        assert got.cached_tokens == 33, "the cached turn serves all of this one but the new tokens"
        _same_as_alone(got, alone, item.token_ids, item.num_last)


def test_a_rollback_into_the_prefix_makes_the_positions_the_sessions_own(tiny_loaded, stored_once):
    model = tiny_loaded["target"].runner.model
    runner, alone = _runner(model), _runner(model)
    runner.step([StepItem("a", [*PROMPT, 1], 1), StepItem("b", [*PROMPT, 2], 1)])
    diverged = [*PROMPT[:20], 7, 7, 7]  # cached to 20, inside the 30 shared
    got = runner.last_logits("a", diverged, 1)
    assert got.cached_tokens == 20
    _same_as_alone(got, alone, diverged, 1)
    assert shared_prefix(runner.cache.peek("a").kv) == (None, 0)
    assert runner.cache.total_tokens == 30 + 1 + 23  # b's prefix and own position, a's own 23
    more = [*PROMPT, 2, 6]
    _same_as_alone(runner.last_logits("b", more, 2), alone, more, 2)


def test_evicting_readers_frees_the_prefix_and_the_others_keep_reading_it(tiny_loaded, stored_once):
    model = tiny_loaded["target"].runner.model
    runner, alone = _runner(model, max_entries=3), _runner(model)
    runner.step([StepItem(f"s/{i}", [*PROMPT, i], 1) for i in range(3)])
    assert runner.cache.total_tokens == 30 + 3
    runner.last_logits("other", [6, 6, 6, 6], 1)  # evicts s/0, the oldest
    assert runner.cache.token_ids("s/0") is None and runner.cache.total_tokens == 30 + 2 + 4
    tokens = [*PROMPT, 2, 5]
    _same_as_alone(runner.last_logits("s/2", tokens, 2), alone, tokens, 2)
    runner.cache.drop("s/1")
    runner.cache.drop("s/2")
    assert runner.cache.total_tokens == 4  # no reader left: the prefix is no longer counted


@pytest.mark.parametrize("half", [False, True], ids=["float32", "float16"])
def test_a_forked_sessions_short_rows_run_fused_with_the_bits_of_a_private_copy(
    tiny_loaded, stored_once, monkeypatch, request, half
):
    """Decode and Verify rows after a shared prefix take the fused layers (the compiled attention
    reads the prefix's buffer, then the session's own), and give exactly what the same session
    gives in a cache of its own: a fork changes where keys live, never a row's bits; with float16
    caches (KV_CACHE_DTYPE) too, the shared prefix held in float16."""
    from specdec.models import ragged
    from specdec.models.kv_cache import set_cache_dtype

    model = tiny_loaded["target"].runner.model
    if half:
        set_cache_dtype(model, torch.float16)
        request.addfinalizer(lambda: set_cache_dtype(model, None))  # the session's model, shared
    shared, private = _runner(model), _runner(model)
    fused = []
    original = ragged.fused_forward

    def spy(m, batch, *args, **kwargs):
        fused.append(batch)
        return original(m, batch, *args, **kwargs)

    monkeypatch.setattr(ragged, "fused_forward", spy)
    for runner in (shared, private):
        runner.last_logits("first", [*PROMPT, 1, 2, 3], 1)
    monkeypatch.setattr(runner_module, "MIN_STORED_ONCE", 10_000)  # the private runner copies prefixes
    private.last_logits("second", [*PROMPT, 4, 4], 2)
    monkeypatch.setattr(runner_module, "MIN_STORED_ONCE", 16)
    fused.clear()
    shared.last_logits("second", [*PROMPT, 4, 4], 2)
    assert len(_roots(shared, ["first", "second"])) == 1 and shared_prefix(private.cache.peek("second").kv)[1] == 0
    assert len(fused) == 1  # the fork's two new rows ran fused
    prefix_keys = shared.cache.peek("second").kv.layers[0].prefix_keys
    assert prefix_keys.dtype == (torch.float16 if half else torch.float32)
    for tokens, last in (([5], 1), ([6, 7, 1], 3), ([2], 1)):  # a decode, a Verify, a decode after it
        second = [*shared.cache.token_ids("second"), *tokens]
        items = [StepItem("second", second, last), StepItem("first", [*PROMPT, 1, 2, 3, 4], 1)]
        fused.clear()
        got = shared.step(items)
        assert len(fused) == 1 and fused[0].compiled.indices == frozenset({0, 1})
        want = [private.last_logits(item.session_id, item.token_ids, item.num_last) for item in items]
        for g, w in zip(got, want, strict=True):
            assert torch.equal(g.logits, w.logits)


def test_short_prefixes_are_copied_and_other_devices_paths_never_share(tiny_loaded):
    model = tiny_loaded["target"].runner.model
    runner = _runner(model)  # MIN_STORED_ONCE as shipped: more than these 30 positions
    runner.step([StepItem("a", [*PROMPT, 1], 1), StepItem("b", [*PROMPT, 2], 1)])
    assert shared_prefix(runner.cache.peek("a").kv) == (None, 0)
    assert runner.cache.total_tokens == 2 * 31


def test_a_layer_after_a_prefix_refuses_the_models_own_update():
    config = _config()
    source = new_cache(config)
    keys, values = torch.randn(1, 2, 20, 8), torch.randn(1, 2, 20, 8)
    source.update(keys, values, 0)
    fork = fork_cache(source, 16, config)
    layer = fork.layers[0]
    assert isinstance(layer, ReservedLayer) and layer.prefix_len == 16 and layer.own_length() == 0
    assert layer.prefix_keys.data_ptr() == source.layers[0].prefix_keys.data_ptr()  # one copy
    # The source: its 16 in the prefix, its other 4 in a buffer of their own, the same values.
    src = source.layers[0]
    assert torch.equal(torch.cat([src.prefix_keys, src.keys], dim=2), keys)
    assert torch.equal(torch.cat([src.prefix_values, src.values], dim=2), values)
    with pytest.raises(RuntimeError, match="ragged attention only"):
        fork.update(keys[:, :, :1], values[:, :, :1], 0)
    fork.crop(-10)  # to 6 positions: copied out of the prefix, which it no longer reads
    assert layer.prefix_keys is None and torch.equal(layer.keys, keys[:, :, :6])


def _config():
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2
    )
