"""The KV cache is an optimisation only: cached logits equal a full recompute."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specdec.core.tokens import common_prefix_length
from specdec.models.runner import MIN_SHARED_PREFIX, ModelRunner, SessionKVCache, StepItem


def _full_logits(model, tokens, num_last):
    with torch.inference_mode():
        return model(input_ids=torch.tensor([tokens])).logits[0, -num_last:].float()


def test_common_prefix_length():
    assert common_prefix_length([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix_length([], [1]) == 0
    assert common_prefix_length([1, 2], [1, 2, 3]) == 2


def test_cached_logits_match_recompute_through_rollbacks(tiny_loaded):
    model = tiny_loaded["target"].runner.model
    runner = ModelRunner(model, SessionKVCache(max_entries=4, max_tokens=10_000))
    rng = np.random.default_rng(0)
    tokens = [1, 2, 3]
    cached_seen = []
    for _ in range(40):
        # A verify-like step: prefix + up to 4 drafts, then keep a random part and add one token.
        drafts = rng.integers(0, 8, size=rng.integers(0, 5)).tolist()
        result = runner.last_logits("s", tokens + drafts, len(drafts) + 1)
        expected = _full_logits(model, tokens + drafts, len(drafts) + 1)
        torch.testing.assert_close(result.logits, expected, atol=1e-5, rtol=1e-5)
        cached_seen.append(result.cached_tokens)
        keep = int(rng.integers(0, len(drafts) + 1))
        tokens = tokens + drafts[:keep] + [int(rng.integers(0, 8))]
        if len(tokens) > 50:
            tokens = tokens[:3]  # a different conversation: the cache must roll back to the prompt
    assert runner.cache.hits > 30 and max(cached_seen) > 10


def test_draft_like_single_token_steps_hit_the_cache(tiny_loaded):
    model = tiny_loaded["draft"].runner.model
    runner = ModelRunner(model, SessionKVCache(max_entries=4, max_tokens=10_000))
    tokens = [1, 2, 3, 4]
    for step in range(10):
        result = runner.last_logits("d", tokens, 1)
        torch.testing.assert_close(result.logits, _full_logits(model, tokens, 1), atol=1e-5, rtol=1e-5)
        if step:
            assert result.cached_tokens == len(tokens) - 1
        tokens.append(step % 8)


def test_lru_bounds_entries_and_tokens(tiny_loaded):
    model = tiny_loaded["target"].runner.model
    runner = ModelRunner(model, SessionKVCache(max_entries=2, max_tokens=12))
    for session in ("a", "b", "c"):
        runner.last_logits(session, [1, 2, 3, 4, 5], 1)
    assert len(runner.cache) == 2  # "a" evicted by count
    runner.last_logits("d", list(range(1, 8)) * 1, 1)
    assert runner.cache.total_tokens <= 12
    # A miss still gives the right answer.
    result = runner.last_logits("a", [1, 2, 3, 4, 5], 1)
    assert result.cached_tokens == 0
    torch.testing.assert_close(result.logits, _full_logits(model, [1, 2, 3, 4, 5], 1), atol=1e-5, rtol=1e-5)


def test_batched_left_padded_logits_match_single(tiny_loaded):
    model = tiny_loaded["target"].runner.model
    runner = ModelRunner(model, SessionKVCache(max_entries=0, max_tokens=0))
    sequences = [[1, 2, 3], [4, 5, 6, 7, 1, 2], [3]]
    outputs = [r.logits for r in runner.batch_forward(sequences, [2, 3, 1])]
    for seq, n, out in zip(sequences, [2, 3, 1], outputs, strict=True):
        torch.testing.assert_close(out, _full_logits(model, seq, n), atol=1e-5, rtol=1e-5)


def test_continuing_after_a_turn_cut_mid_round_matches_recompute(tiny_loaded):
    """A turn that ends on EOS or a stop string can leave the cache holding positions past the
    history (drafts in flight, tokens after the cut). The next turn's prompt diverges there by
    more than the one position each round re-runs anyway, so only here would a stale position
    kept past the common prefix change the logits (and the hidden states a relay reads)."""
    model = tiny_loaded["target"].runner.model
    runner = ModelRunner(model, SessionKVCache(max_entries=4, max_tokens=10_000))
    rng = np.random.default_rng(1)
    for _ in range(20):
        context = rng.integers(0, 8, size=rng.integers(1, 8)).tolist()
        drafts = rng.integers(0, 8, size=rng.integers(1, 5)).tolist()
        runner.last_logits("s", context + drafts, len(drafts) + 1, hidden_from=0)
        kept = int(rng.integers(0, len(drafts)))  # the turn ended after drafts[:kept]
        # The next prompt starts with a token other than the cached one, and is scored only at its
        # last positions: the positions before those must come from the cache or run again.
        first = (drafts[kept] + int(rng.integers(1, 8))) % 8
        prompt = [first, *rng.integers(0, 8, size=rng.integers(1, 4)).tolist()]
        tokens = context + drafts[:kept] + prompt
        num_last = int(rng.integers(1, len(prompt)))
        hidden_from = int(rng.integers(0, len(tokens) - num_last + 1))
        cached = runner.last_logits("s", tokens, num_last, hidden_from=hidden_from)
        fresh = runner.last_logits("", tokens, num_last, hidden_from=hidden_from)
        torch.testing.assert_close(cached.logits, fresh.logits, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(cached.hidden, fresh.hidden, atol=1e-5, rtol=1e-5)
        assert cached.cached_tokens == len(context) + kept  # the whole common prefix, nothing past it


def _assert_reuses_with_every_row(runner, session, tokens, cached):
    """A call asking for hidden states from row 0 reuses `cached` positions and returns the rows
    an uncached forward gives."""
    result = runner.last_logits(session, tokens, 1, hidden_from=0)
    assert result.cached_tokens == cached
    uncached = ModelRunner(runner.model, SessionKVCache(max_entries=0, max_tokens=0))
    fresh = uncached.last_logits("", tokens, 1, hidden_from=0)
    torch.testing.assert_close(result.hidden, fresh.hidden, atol=1e-5, rtol=1e-5)


def test_a_target_asked_for_hidden_states_once_keeps_them_for_calls_that_did_not_ask(tiny_loaded):
    """A session's turn at K = 0 (no hidden states asked) followed by one with a hidden-state
    draft: the second asks for every row from 0 and still reuses every cached position."""
    model = tiny_loaded["target"].runner.model
    runner = ModelRunner(model, SessionKVCache(max_entries=4, max_tokens=10_000))
    runner.last_logits("other", [1, 2, 3], 1, hidden_from=0)  # some session asked: the runner keeps rows
    tokens = [4, 1, 5, 2, 6, 3, 7]
    runner.last_logits("s", tokens, 1)  # a K = 0 round: asks for none
    assert runner.cache.peek("s").hidden.shape[0] == len(tokens)
    _assert_reuses_with_every_row(runner, "s", [*tokens, 2, 5], len(tokens))


def test_a_sessions_hidden_rows_grow_in_place_and_what_is_returned_is_its_own():
    """Rounds of a decode with rollbacks: the kept rows are the cached ones then the new ones, as
    a concatenation would give, written into one buffer (not a copy of them all every round); the
    rows a call returns do not change when a later round writes over rows past its reuse."""
    from specdec.models.runner import _assemble_hidden

    generator = torch.Generator().manual_seed(0)
    stored = room = None
    reference = torch.empty(0, 4)
    length, first_room = 0, None
    for reuse_back, new in [(0, 5), (0, 3), (2, 4), (0, 1), (3, 2)]:  # rows rolled back, rows run
        reuse = max(0, length - reuse_back)
        ran = torch.randn(new, 4, generator=generator)
        hidden, stored, room = _assemble_hidden(stored, room, ran, reuse, reuse, keep=True)
        reference = torch.cat([reference[:reuse], ran])
        assert torch.equal(stored, reference) and torch.equal(hidden, ran)
        first_room = room if first_room is None else first_room
        assert room is first_room and stored.data_ptr() == room.data_ptr()  # in place, one buffer
        earlier, length = hidden, reuse + new
    kept = earlier.clone()
    _, stored, room = _assemble_hidden(stored, room, torch.zeros(2, 4), length - 2, None, keep=True)
    assert torch.equal(earlier, kept)  # those rows were written over; what was returned was not
    more = torch.randn(600, 4, generator=generator)  # past the room: a larger one, the rows carried over
    _, grown, bigger = _assemble_hidden(stored, room, more, length, None, keep=True)
    assert bigger is not room and bigger.shape[0] >= length + 600
    assert torch.equal(grown, torch.cat([stored[:length], more]))


def test_a_target_never_asked_for_hidden_states_keeps_none(tiny_loaded):
    model = tiny_loaded["target"].runner.model
    runner = ModelRunner(model, SessionKVCache(max_entries=4, max_tokens=10_000))
    runner.last_logits("s", [1, 2, 3, 4], 1)
    runner.step([StepItem("s", [1, 2, 3, 4, 5], 1), StepItem("t", [6, 7, 1], 1)])
    assert not runner.keeps_hidden
    assert runner.cache.peek("s").hidden is None and runner.cache.peek("t").hidden is None


def test_a_fork_carries_the_hidden_states_of_its_shared_prefix(tiny_loaded):
    """A new session under a prompt another session ran (a system prompt, a retried request)
    reuses those positions even when it asks for hidden states from row 0."""
    model = tiny_loaded["target"].runner.model
    runner = ModelRunner(model, SessionKVCache(max_entries=4, max_tokens=10_000))
    prompt = [(3 * i + 1) % 8 for i in range(MIN_SHARED_PREFIX + 4)]
    runner.last_logits("first", [*prompt, 1, 2], 1, hidden_from=0)
    _assert_reuses_with_every_row(runner, "second", [*prompt, 5, 6, 7], len(prompt))


def test_a_batched_step_keeps_the_rows_of_items_that_did_not_ask(tiny_loaded):
    model = tiny_loaded["target"].runner.model
    runner = ModelRunner(model, SessionKVCache(max_entries=4, max_tokens=10_000))
    runner.step([StepItem("a", [1, 2, 3, 4], 2), StepItem("b", [5, 6, 7], 1, hidden_from=0)])
    assert runner.cache.peek("a").hidden.shape[0] == 4
    _assert_reuses_with_every_row(runner, "a", [1, 2, 3, 4, 6], 4)


def test_last_logits_and_batch_forward_are_unchanged_by_batched_steps(tiny_loaded):
    """A step switches the model to ragged attention only while it runs: the other paths compute
    bit for bit what they computed before any step."""
    from specdec.models.runner import StepItem

    model = tiny_loaded["target"].runner.model
    runner = ModelRunner(model, SessionKVCache(max_entries=4, max_tokens=10_000))

    def outputs():
        solo = runner.last_logits("", [1, 2, 3, 4, 5], 3, hidden_from=1)
        batch = runner.batch_forward([[1, 2, 3], [4, 5, 6, 7, 1]], [1, 2])
        return [solo.logits, solo.hidden, *(r.logits for r in batch)]

    before = outputs()
    runner.step([StepItem("a", [1, 2, 3, 4], 2), StepItem("b", [5, 6], 1, hidden_from=0)])
    for old, new in zip(before, outputs(), strict=True):
        assert torch.equal(old, new)
    # A cached session continues through last_logits from where the step left it.
    result = runner.last_logits("a", [1, 2, 3, 4, 7], 1)
    assert result.cached_tokens == 4
    torch.testing.assert_close(result.logits, _full_logits(model, [1, 2, 3, 4, 7], 1), atol=1e-5, rtol=1e-5)


def test_close_frees_the_cache_and_ends_the_model_thread(tiny_loaded):
    from specdec.core.errors import Unavailable

    model = tiny_loaded["target"].runner.model
    owner = ModelRunner(model, SessionKVCache(max_entries=4, max_tokens=10_000))
    borrower = ModelRunner(model, SessionKVCache(max_entries=4, max_tokens=10_000))
    borrower.share_model_thread(owner)
    for runner in (owner, borrower):
        runner.on_model_thread(runner.last_logits, "s", [1, 2, 3], 1)
    borrower.close()  # a borrower ends nothing but itself
    assert len(borrower.cache) == 0 and len(owner.cache) == 1
    owner.on_model_thread(owner.last_logits, "s", [1, 2, 3, 4], 1)
    with pytest.raises(Unavailable, match="closed"):
        borrower.on_model_thread(borrower.last_logits, "s", [1, 2, 3], 1)
    # Closed from its own model thread (an op closing its runner): returns rather than waiting on itself.
    owner.on_model_thread(owner.close)
    owner.close()  # idempotent
    assert len(owner.cache) == 0
    with pytest.raises(Unavailable, match="closed"):
        owner.on_model_thread(owner.last_logits, "s", [1, 2, 3], 1)
    stranded = ModelRunner(model, SessionKVCache(max_entries=4, max_tokens=10_000))
    stranded.share_model_thread(owner)  # the owner's thread has ended: clear status, no hang
    with pytest.raises(Unavailable, match="ended"):
        stranded.on_model_thread(stranded.last_logits, "s", [1, 2, 3], 1)


@pytest.fixture
def float16_runner(tiny_loaded):
    """The tiny target (the compiled kernels attend it) with float16 caches; the model restored after."""
    from specdec.models.kv_cache import set_cache_dtype

    model = tiny_loaded["target"].runner.model
    runner = ModelRunner(model, SessionKVCache(max_entries=8, max_tokens=10_000))
    runner.on_model_thread(runner.store_caches_as, torch.float16)
    yield runner
    runner.close()
    set_cache_dtype(model, None)


def test_float16_caches_keep_verify_rows_and_batched_items_at_their_decodes_bits(float16_runner, tiny_loaded):
    """What losslessness needs of a float16 cache: a Verify's rows are the bits of one-token decodes
    of the same positions, alone or batched with another session, and the laws stay near the
    float32 cache's (the rounding is seen, and small)."""
    runner = float16_runner
    prompt = [(5 * i + 2) % runner.vocab_size for i in range(30)]  # past the compiled rows: a prompt
    drafts = [3, 1, 4, 1]
    run = lambda fn, *a: runner.on_model_thread(fn, *a)  # noqa: E731
    run(runner.last_logits, "verify", prompt, 1)
    verify = run(runner.last_logits, "verify", prompt + drafts, len(drafts) + 1).logits
    run(runner.last_logits, "decode", prompt, 1)
    for i in range(len(drafts) + 1):
        decode = run(runner.last_logits, "decode", prompt + drafts[:i], 1).logits
        assert torch.equal(decode[0], verify[i])
    run(runner.last_logits, "other", prompt[::-1], 1)
    batched = run(runner.step, [StepItem("decode", prompt + drafts, 5), StepItem("other", prompt[::-1] + [2], 2)])
    assert torch.equal(batched[0].logits, verify)
    assert all(layer.keys.dtype == torch.float16 for layer in runner.cache.peek("decode").kv.layers)
    exact = tiny_loaded["target"].runner  # the served runner: float32 caches
    wide = exact.on_model_thread(exact.last_logits, "float32-twin", prompt + drafts, len(drafts) + 1).logits
    assert not torch.equal(wide, verify)
    torch.testing.assert_close(verify, wide, rtol=0, atol=2e-2 * float(wide.abs().max()))
    exact.on_model_thread(exact.cache.drop, "float32-twin")


def test_float16_caches_need_the_compiled_kernel(tiny_loaded, monkeypatch):
    from specdec.models import ragged

    monkeypatch.setattr(ragged.panels, "kernel_library", lambda: None)
    plain = ModelRunner(tiny_loaded["target"].runner.model, SessionKVCache(8, 10_000))
    try:
        with pytest.raises(ValueError, match="compiled attention kernel"):
            plain.store_caches_as(torch.float16)
    finally:
        plain.close()
