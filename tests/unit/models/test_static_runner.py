"""The static-cache, compiled path gives the eager path's logits and keeps its cache semantics.

Compiled with backend="aot_eager" (dynamo's graph capture and functionalisation of the cache's
in-place writes, no code generation): inductor compiles each bucket in 35-65 s on this shared
2-core machine, so the inductor check is one bucket, marked slow.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specdec.models.runner import ModelRunner, SessionKVCache, StepItem
from specdec.models.static_runner import (
    StaticModelRunner,
    bucket_for,
    make_runner,
    use_static_path,
)

TEST_BUCKETS = (1, 2, 4, 8)
TOL = {"atol": 1e-5, "rtol": 1e-5}  # float32 noise: the static path attends over a longer, masked key range


def _full_logits(model, tokens, num_last):
    """[num_last, V] of one uncached eager forward: the reference."""
    with torch.inference_mode():
        return model(input_ids=torch.tensor([tokens])).logits[0, -num_last:].float()


@pytest.fixture(scope="module")
def model(tiny_loaded):
    return tiny_loaded["target"].runner.model


@pytest.fixture(scope="module")
def compiled(model):
    """One static runner for the module: each runner compiles its own graphs (seconds each here)."""
    import torch._dynamo.config

    strict = torch._dynamo.config.fail_on_recompile_limit_hit
    torch._dynamo.config.fail_on_recompile_limit_hit = True  # never a silent fall back to eager
    runner = StaticModelRunner(model, SessionKVCache(1, 1), max_len=64, buckets=TEST_BUCKETS, backend="aot_eager")
    # One step now allocates the working cache at 64 positions: allocated by whichever test ran
    # first, it had 24 when that was pair(max_len=24), and the later tests' positions overflowed
    # it (seen with the tests spread over xdist workers, in another order).
    runner.last_logits("allocate", [1], 1)
    yield runner
    torch._dynamo.config.fail_on_recompile_limit_hit = strict


@pytest.fixture()
def pair(compiled, model):
    """(the static runner with a fresh cache of the given bounds, an eager runner with its own)."""

    def make(max_entries=2, max_tokens=10_000, max_len=64):
        compiled.cache = SessionKVCache(max_entries, max_tokens)
        compiled.max_len = max_len  # positions past it run eagerly (the working cache has 64)
        compiled.compiled_forwards = compiled.eager_forwards = compiled.restores = 0
        return compiled, ModelRunner(model, SessionKVCache(max_entries, max_tokens))

    return make


def test_bucket_for_pads_up_and_falls_back_to_exact_shapes():
    assert bucket_for(1, 0, 64) == 1
    assert bucket_for(3, 10, 64) == 4
    assert bucket_for(16, 0, 64) == 16
    assert bucket_for(17, 0, 64) is None  # a prompt: eager
    assert bucket_for(3, 60, 64) == 4
    assert bucket_for(3, 61, 64) is None  # 4 would run past the cache's end


def test_use_static_path_auto_is_cuda_only():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert not use_static_path("auto", cpu)
    assert use_static_path("auto", cuda)
    assert use_static_path("on", cpu)
    assert not use_static_path("off", cuda)
    assert not use_static_path("on", cpu, needs_target_hidden=True)
    with pytest.raises(ValueError, match="compile must be one of"):
        use_static_path("yes", cpu)


def test_make_runner_selects_by_setting(model):
    cache = SessionKVCache(2, 100)
    assert isinstance(make_runner(model, cache, "on"), StaticModelRunner)
    runner = make_runner(model, cache, "auto")
    assert type(runner) is ModelRunner  # a CPU model under auto stays eager


def test_static_logits_and_cache_match_eager_through_rollbacks_and_evictions(model, pair):
    """Verify-like steps over three interleaved sessions with room for two: every call's logits
    equal a full recompute, and the cache behaves exactly as the eager runner's (reused prefix
    per call, hits, misses, the tokens each session holds)."""
    static, eager = pair(max_entries=2)
    rng = np.random.default_rng(0)
    history = {s: [1, 2, 3] for s in "abc"}
    for _ in range(36):
        session = "abc"[rng.choice(3, p=[0.45, 0.45, 0.1])]  # "c" now and then evicts one
        drafts = rng.integers(0, 8, size=rng.integers(0, 5)).tolist()
        tokens = history[session] + drafts
        got = static.last_logits(session, tokens, len(drafts) + 1)
        want = eager.last_logits(session, tokens, len(drafts) + 1)
        torch.testing.assert_close(got.logits, _full_logits(model, tokens, len(drafts) + 1), **TOL)
        assert got.cached_tokens == want.cached_tokens
        keep = int(rng.integers(0, len(drafts) + 1))  # the rollback: a rejection after `keep` drafts
        history[session] = tokens[: len(history[session]) + keep] + [int(rng.integers(0, 8))]
        if len(history[session]) > 40:
            history[session] = history[session][:3]  # another conversation from the same prompt
    assert (static.cache.hits, static.cache.misses) == (eager.cache.hits, eager.cache.misses)
    # Evictions, reuse, and sessions whose saved prefix went back into the working cache.
    assert static.cache.misses > 5 and static.cache.hits > 10 and static.restores > 5
    for session in "abc":
        assert static.cache.token_ids(session) == eager.cache.token_ids(session)
    assert static.compiled_forwards > 30


def test_evicted_resident_session_recomputes(model, pair):
    """The session whose keys/values sit in the working cache is evicted by the LRU: its next
    call is a miss and recomputes, never reading what the cache still holds."""
    static, _ = pair(max_entries=1)
    static.last_logits("a", [1, 2, 3, 4], 1)
    static.last_logits("b", [5, 6], 1)  # evicts "a" (one entry); "b" becomes resident
    result = static.last_logits("a", [1, 2, 3, 4, 5], 1)
    assert result.cached_tokens == 0
    torch.testing.assert_close(result.logits, _full_logits(model, [1, 2, 3, 4, 5], 1), **TOL)
    # "b" was saved when "a" took the working cache back, then evicted: a miss too.
    assert static.last_logits("b", [5, 6, 7], 1).cached_tokens == 0


def test_prompts_past_the_buckets_and_past_the_cache_run_eagerly(model, pair):
    static, _ = pair(max_len=24)
    prompt = [int(t) for t in np.random.default_rng(1).integers(0, 8, size=20)]
    first = static.last_logits("p", prompt, 2)  # 20 new tokens > 8: eager, on the static cache
    assert static.eager_forwards == 1
    torch.testing.assert_close(first.logits, _full_logits(model, prompt, 2), **TOL)
    step = static.last_logits("p", prompt + [3], 1)
    assert step.cached_tokens == 20 and static.compiled_forwards == 1
    torch.testing.assert_close(step.logits, _full_logits(model, prompt + [3], 1), **TOL)
    near_end = prompt + [3, 4, 5]  # 2 new after 21: bucket 2 fits (23 <= 24)
    torch.testing.assert_close(static.last_logits("p", near_end, 1).logits, _full_logits(model, near_end, 1), **TOL)
    long = near_end + [1, 2, 3]  # 26 tokens > 24: ModelRunner's DynamicCache path
    torch.testing.assert_close(static.last_logits("p", long, 3).logits, _full_logits(model, long, 3), **TOL)
    back = near_end[:10]  # rolled back under the cache's size: static again, from scratch
    assert static.last_logits("p", back, 1).cached_tokens == 0


def test_hidden_states_match_eager(model, pair):
    static, eager = pair()
    tokens = [1, 2, 3, 4, 5, 6, 7, 1, 2]  # 9 new tokens: eager; then the decode graph, then the other
    for extra, hidden_from in (([], 2), ([3], 3), ([7, 1], 4), ([2], 0)):
        tokens = tokens + extra
        got = static.last_logits("h", tokens, 1, hidden_from=hidden_from)
        want = eager.last_logits("h", tokens, 1, hidden_from=hidden_from)
        torch.testing.assert_close(got.logits, want.logits, **TOL)
        torch.testing.assert_close(got.hidden, want.hidden, **TOL)
        assert got.cached_tokens == want.cached_tokens


def test_step_is_last_logits_per_item(model, pair):
    static, _ = pair()
    items = [StepItem("x", [1, 2, 3], 1), StepItem("y", [4, 5, 6, 7], 2), StepItem("", [1, 1], 1)]
    results = static.step(items)
    for item, result in zip(items, results, strict=True):
        torch.testing.assert_close(result.logits, _full_logits(model, list(item.token_ids), item.num_last), **TOL)


@pytest.mark.slow
def test_inductor_compiled_decode_matches_eager(model):
    """The code inductor generates (one bucket: ~1 minute to compile here)."""
    static = StaticModelRunner(model, SessionKVCache(2, 1000), max_len=64, buckets=(1,))
    tokens = [1, 2, 3]
    for token in (4, 5, 6):
        tokens.append(token)
        result = static.last_logits("i", tokens, 1)
        torch.testing.assert_close(result.logits, _full_logits(model, tokens, 1), **TOL)
    assert static.compiled_forwards == 2  # the first call (4 new tokens) ran eagerly


def test_load_model_selects_the_static_runner_by_setting(tiny_model_dirs):
    """The service's hook: SPECDEC_TARGET_COMPILE=on gives a static runner (auto on a CPU does not)."""
    from specdec.rpc.model_service import load_model
    from specdec.settings import load_settings
    from target_service.settings import TargetSettings

    environ = {"SPECDEC_TARGET_COMPILE": "on", "SPECDEC_TARGET_STATIC_CACHE_LEN": "32"}
    settings = load_settings(TargetSettings, [], environ, model=tiny_model_dirs["target"], calibrate_max_rows=0)
    runner = load_model(settings, "target").runner
    assert isinstance(runner, StaticModelRunner) and runner.max_len == 32
    settings = load_settings(TargetSettings, [], {}, model=tiny_model_dirs["target"], calibrate_max_rows=0)
    assert type(load_model(settings, "target").runner) is ModelRunner
    with pytest.raises(SystemExit):
        load_settings(TargetSettings, [], {"SPECDEC_TARGET_COMPILE": "maybe"})


@pytest.fixture(scope="module")
def two_rows(model):
    """A static runner whose steps batch at most two sessions (more are split across steps)."""
    return StaticModelRunner(
        model, SessionKVCache(4, 10_000), max_len=64, buckets=TEST_BUCKETS, backend="aot_eager", batch_buckets=(1, 2)
    )


@pytest.mark.parametrize("rows", ["sixteen", "two"])
def test_batched_steps_match_eager_through_rollbacks_and_evictions(model, pair, two_rows, rows):
    """Steps of one to five sessions (decodes and verifies of up to 5 tokens, rollbacks, an entry
    bound that evicts, rows that change hands): every sequence's logits equal a full recompute and
    the cache behaves as the eager runner's."""
    static, eager = (
        pair(max_entries=4) if rows == "sixteen" else (two_rows, ModelRunner(model, SessionKVCache(4, 10_000)))
    )
    rng = np.random.default_rng(1)
    history = {s: [1 + i, 2, 3] for i, s in enumerate("abcde")}
    shared = 0
    for _ in range(24):
        sessions = rng.choice(list("abcde"), size=int(rng.integers(1, 6)), replace=False)
        drafts = {s: rng.integers(0, 8, size=rng.integers(0, 5)).tolist() for s in sessions}
        items = [StepItem(s, history[s] + drafts[s], len(drafts[s]) + 1) for s in sessions]
        got, want = static.step(items), eager.step(items)
        for item, g, w in zip(items, got, want, strict=True):
            torch.testing.assert_close(g.logits, _full_logits(model, list(item.token_ids), item.num_last), **TOL)
            assert g.cached_tokens == w.cached_tokens
            shared = max(shared, g.step_sequences)
        for s in sessions:
            keep = int(rng.integers(0, len(drafts[s]) + 1))
            history[s] = history[s] + drafts[s][:keep] + [int(rng.integers(0, 8))]
            if len(history[s]) > 40:
                history[s] = history[s][:3]
    assert (static.cache.hits, static.cache.misses) == (eager.cache.hits, eager.cache.misses)
    for s in "abcde":
        assert static.cache.token_ids(s) == eager.cache.token_ids(s)
    assert shared == (5 if rows == "sixteen" else 2)
    assert static.restores > 0


def test_a_step_mixes_batched_prompts_uncached_and_hidden_states(model, pair):
    """A prompt past the buckets runs alone, the rest share one compiled forward; hidden states
    and an uncached item come out as alone."""
    static, eager = pair()
    prompt = [int(t) for t in np.random.default_rng(2).integers(0, 8, size=20)]
    static.step([StepItem("d", [1, 2, 3], 1)])
    eager.step([StepItem("d", [1, 2, 3], 1)])
    items = [
        StepItem("p", prompt, 2),
        StepItem("d", [1, 2, 3, 4], 1, hidden_from=1),
        StepItem("", [5, 6], 1),
        StepItem("h", [7, 1, 2, 3], 2, hidden_from=0),
    ]
    before = (static.compiled_forwards, static.eager_forwards)
    got, want = static.step(items), eager.step(items)
    assert (static.compiled_forwards - before[0], static.eager_forwards - before[1]) == (1, 1)
    for item, g, w in zip(items, got, want, strict=True):
        torch.testing.assert_close(g.logits, _full_logits(model, list(item.token_ids), item.num_last), **TOL)
        if item.hidden_from is not None:
            torch.testing.assert_close(g.hidden, w.hidden, **TOL)
        assert g.cached_tokens == w.cached_tokens
    assert [r.step_sequences for r in got] == [1, 3, 3, 3]


def test_a_pad_row_never_overwrites_a_resident_prefix(model):
    """A step of three pads to four rows; the fourth row's resident holds too many positions for
    the pad row to write past them: the resident is saved first and later reads back what it held."""
    static = StaticModelRunner(model, SessionKVCache(8, 10_000), max_len=24, buckets=TEST_BUCKETS, backend="aot_eager")
    base = {s: [i + 1, 2, 3] for i, s in enumerate("abc")}
    long = [int(t) for t in np.random.default_rng(3).integers(0, 8, size=21)]
    static.step([StepItem(s, base[s], 1) for s in "abc"])  # rows 0-2
    static.step([StepItem("z", long, 1)])  # 21 new tokens: alone, eagerly, in row 0
    static.step([*(StepItem(s, [*base[s], 4], 1) for s in "abc"), StepItem("z", [*long, 5], 1)])
    assert static._resident(3) is not None and static._resident(3).length == 22  # z, in row 3
    # 3 new tokens each: a bucket of 4, which the pad row (row 3) cannot write after z's 22.
    items = [StepItem(s, [*base[s], 4, 5, 6, 7], 3) for s in "abc"]
    for item, result in zip(items, static.step(items), strict=True):
        torch.testing.assert_close(result.logits, _full_logits(model, list(item.token_ids), 3), **TOL)
    after = static.last_logits("z", [*long, 5, 6], 1)
    assert after.cached_tokens == 22
    torch.testing.assert_close(after.logits, _full_logits(model, [*long, 5, 6], 1), **TOL)
