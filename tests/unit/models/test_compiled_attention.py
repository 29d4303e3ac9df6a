"""The compiled ragged attention (kernels/attention.cpp): SDPA's result for decode and Verify rows,
each row's bits independent of the rows, segments and threads beside it, the cache buffers
extended as DynamicCache would, and every cached forward of the runner taking it alone or batched."""

from __future__ import annotations

import pytest
import torch

from specdec.models import panels
from specdec.models.kv_cache import new_cache
from specdec.models.ragged import COMPILED_MAX_ROWS, build_batch, compiled_attention_ok


class Heads:
    """Sessions of one attention layer: cache buffers as ReservedLayer keeps them, and a step's rows."""

    def __init__(self, heads: int, kv_heads: int, dim: int, seed: int = 0):
        self.heads, self.kv_heads, self.dim = heads, kv_heads, dim
        self.gen = torch.Generator().manual_seed(seed)

    def randn(self, *shape) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen)

    def buffers(self, past: int, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = (torch.zeros(1, self.kv_heads, capacity, self.dim) for _ in range(2))
        keys[:, :, :past] = self.randn(1, self.kv_heads, past, self.dim)
        values[:, :, :past] = self.randn(1, self.kv_heads, past, self.dim)
        return keys, values


def _attend(
    lib, query, key, value, segments, heads: int, kv_heads: int, dim: int, prefixes=None, half: bool = False
) -> torch.Tensor:
    """The kernel over one layer: query [1, Hq, T, D], key/value [1, Hkv, T, D]; segments: (start,
    rows, past, key buffer, value buffer) each; prefixes: per segment None or the (keys, values)
    [1, Hkv, P, D] of a shared prefix it reads first (past counts them; its buffers hold the rest);
    half: the buffers (a prefix's too) are float16. Returns [1, T, Hq, D]."""

    def prefix_columns(prefix):
        if prefix is None:
            return [0, 0, 0, 0]
        keys, values = prefix
        assert keys.stride(1) == values.stride(1) and keys.stride(2) == dim and keys.stride(3) == 1
        return [keys.data_ptr(), values.data_ptr(), keys.stride(1) // dim, keys.shape[2]]

    prefixes = prefixes or [None] * len(segments)
    table = torch.tensor(
        [
            [s, n, p, kb.data_ptr(), vb.data_ptr(), kb.shape[2], *prefix_columns(prefix)]
            for (s, n, p, kb, vb), prefix in zip(segments, prefixes, strict=True)
        ],
        dtype=torch.int64,
    )
    out = torch.full((1, query.shape[2], heads, dim), float("nan"))
    lib.ragged_attention(
        query.data_ptr(), query.stride(2), query.stride(1), key.data_ptr(), key.stride(2), key.stride(1),
        value.data_ptr(), value.stride(2), value.stride(1), table.data_ptr(), len(segments), heads, kv_heads,
        dim, dim**-0.5, out.data_ptr(), int(half),
    )
    return out


def _step(h: Heads, shapes: list[tuple[int, int]]):
    """Query/key/value rows of a step whose segments are (past, rows) each, laid out as the model's
    projections leave them ([1, T, H, D] viewed as [1, H, T, D])."""
    total = sum(n for _, n in shapes)
    query = h.randn(1, total, h.heads, h.dim).transpose(1, 2)
    key = h.randn(1, total, h.kv_heads, h.dim).transpose(1, 2)
    value = h.randn(1, total, h.kv_heads, h.dim).transpose(1, 2)
    segments, start = [], 0
    for past, n in shapes:
        segments.append((start, n, past, *h.buffers(past, past + n + 5)))
        start += n
    return query, key, value, segments


def _reference(query, key, value, segments) -> torch.Tensor:
    outs = []
    for start, n, past, kb, vb in segments:
        keys = torch.cat([kb[:, :, :past], key[:, :, start : start + n]], dim=2)
        values = torch.cat([vb[:, :, :past], value[:, :, start : start + n]], dim=2)
        mask = torch.ones(n, past + n, dtype=torch.bool).tril(past)
        q = query[:, :, start : start + n]
        attended = torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
        outs.append(attended.transpose(1, 2))
    return torch.cat(outs, dim=1)


def _levels(tmp_path_factory) -> list:
    """The library this process uses, and the AVX2 build where this CPU runs AVX-512 too."""
    libs = [panels.kernel_library()]
    if panels.cpu_level() == "x86-64-v4":
        libs.append(panels.load(panels.build("x86-64-v3", tmp_path_factory.mktemp("v3"))))
    return libs


@pytest.fixture(scope="module")
def libs(tmp_path_factory):
    assert panels.available(), panels._library()[1]
    return _levels(tmp_path_factory)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim"), [(9, 3, 64), (4, 2, 8), (2, 2, 16), (4, 1, 24), (2, 1, 80), (4, 2, 128)]
)
def test_decode_and_verify_rows_are_sdpa(libs, heads, kv_heads, dim):
    h = Heads(heads, kv_heads, dim, seed=dim)
    # A decode after 0, 1 and 400 positions, Verify rows, a prompt-sized segment, 17 = past a vector.
    query, key, value, segments = _step(h, [(400, 1), (0, 1), (1, 3), (37, 5), (0, COMPILED_MAX_ROWS), (17, 2)])
    expected = _reference(query, key, value, segments)
    for lib in libs:
        assert lib.ragged_attention_supports(dim)
        fresh = [(s, n, p, kb.clone(), vb.clone()) for s, n, p, kb, vb in segments]
        got = _attend(lib, query, key, value, fresh, heads, kv_heads, dim)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=2e-6)
        for start, n, past, kb, vb in fresh:  # the new rows appended after the cached ones
            torch.testing.assert_close(kb[:, :, past : past + n], key[:, :, start : start + n], rtol=0, atol=0)
            torch.testing.assert_close(vb[:, :, past : past + n], value[:, :, start : start + n], rtol=0, atol=0)


def test_unsupported_head_sizes_are_refused(libs):
    for lib in libs:
        assert not lib.ragged_attention_supports(12) and not lib.ragged_attention_supports(7)
        assert lib.ragged_attention_supports(64) and lib.ragged_attention_supports(8)


def test_a_rows_bits_do_not_depend_on_the_rows_segments_or_threads_beside_it(libs):
    """A segment batched with others, alone, and each Verify row as the one-row decode of its
    position: the same bits. This is what makes a batched step give each item its solo logits."""
    h = Heads(9, 3, 64, seed=1)
    query, key, value, segments = _step(h, [(30, 5), (300, 1), (7, 4)])
    threads = torch.get_num_threads()
    for lib in libs:
        try:
            torch.set_num_threads(2)
            copies = [(s, n, p, kb.clone(), vb.clone()) for s, n, p, kb, vb in segments]
            together = _attend(lib, query, key, value, copies, 9, 3, 64)
            torch.set_num_threads(1)
            start, n, past, kb, vb = segments[0]
            kb, vb = kb.clone(), vb.clone()
            for i in range(n):  # row i alone: a decode after past + i positions (rows before it cached)
                rows = slice(start + i, start + i + 1)
                one = [(0, 1, past + i, kb, vb)]
                alone = _attend(lib, query[:, :, rows], key[:, :, rows], value[:, :, rows], one, 9, 3, 64)
                assert torch.equal(alone[0, 0], together[0, start + i])
            for s, n, p, kb, vb in segments[1:]:
                rows = slice(s, s + n)
                one = [(0, n, p, kb.clone(), vb.clone())]
                alone = _attend(lib, query[:, :, rows], key[:, :, rows], value[:, :, rows], one, 9, 3, 64)
                assert torch.equal(alone[0], together[0, rows])
        finally:
            torch.set_num_threads(threads)


def test_a_segment_after_a_shared_prefix_reads_it_as_one_buffer(libs):
    """A forked session (`kv_cache.fork_cache`) reads its first positions from the shared prefix's
    buffer, whose heads lie its root's length apart, and the rest from its own: the bits of the
    same positions in one buffer, its new rows appended to its own buffer after the prefix."""
    h = Heads(9, 3, 64, seed=2)
    query, key, value, segments = _step(h, [(300, 1), (30, 5), (41, 3)])
    together = [(s, n, p, kb.clone(), vb.clone()) for s, n, p, kb, vb in segments]
    shares = (0, 30, 40)  # positions each segment's prefix holds: none, all it has cached, most of it
    for lib in libs:
        fresh = [(s, n, p, kb.clone(), vb.clone()) for s, n, p, kb, vb in together]
        whole = _attend(lib, query, key, value, fresh, 9, 3, 64)
        split, prefixes = [], []
        for (start, n, past, kb, vb), share in zip(together, shares, strict=True):
            root_k, root_v = (torch.randn(1, 3, share + 7, 64) for _ in range(2))  # a root holding 7 more
            root_k[:, :, :share], root_v[:, :, :share] = kb[:, :, :share], vb[:, :, :share]
            own_k, own_v = torch.zeros_like(kb), torch.zeros_like(vb)
            own_k[:, :, : past - share], own_v[:, :, : past - share] = kb[:, :, share:past], vb[:, :, share:past]
            split.append((start, n, past, own_k, own_v))
            prefixes.append((root_k[:, :, :share], root_v[:, :, :share]) if share else None)
        got = _attend(lib, query, key, value, split, 9, 3, 64, prefixes)
        assert torch.equal(got, whole)
        for (start, n, past, own_k, own_v), share in zip(split, shares, strict=True):
            assert torch.equal(own_k[:, :, past - share : past - share + n], key[:, :, start : start + n])
            assert torch.equal(own_v[:, :, past - share : past - share + n], value[:, :, start : start + n])


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (4, 2, 8), (2, 1, 80)])
def test_float16_caches_attend_as_float32_ones_holding_the_rounded_keys_and_values(libs, heads, kv_heads, dim):
    """A float16 cache (KV_CACHE_DTYPE): new rows appended rounded to nearest even (torch's
    `.half()`), and every row, new ones included, attends exactly as over float32 buffers holding
    those rounded values (a conversion that widens exactly, then the same arithmetic), a shared
    prefix's positions too. So a float16 model's Verify rows still get their decodes' bits."""
    h = Heads(heads, kv_heads, dim, seed=3)
    query, key, value, segments = _step(h, [(400, 1), (0, 1), (37, 5), (0, COMPILED_MAX_ROWS), (30, 3)])
    key, value = key * 40, value * 40  # magnitudes where float16 rounding moves the last bits a lot
    rounded_key, rounded_value = key.half().float(), value.half().float()
    share = 20  # the last segment reads its first 20 positions from a shared prefix
    *plain, (start, n, past, kb, vb) = segments
    own_k, own_v = torch.zeros_like(kb), torch.zeros_like(vb)
    own_k[:, :, : past - share], own_v[:, :, : past - share] = kb[:, :, share:past], vb[:, :, share:past]
    segments = [*plain, (start, n, past, own_k, own_v)]
    prefix = (kb[:, :, :share].contiguous(), vb[:, :, :share].contiguous())
    prefixes = [None] * len(plain) + [prefix]
    for lib in libs:
        halves = [(s, n, p, kb.half(), vb.half()) for s, n, p, kb, vb in segments]
        got = _attend(lib, query, key, value, halves, heads, kv_heads, dim, prefixes=[
            None if pre is None else tuple(t.half() for t in pre) for pre in prefixes
        ], half=True)
        singles = [(s, n, p, kb.half().float(), vb.half().float()) for s, n, p, kb, vb in segments]
        want = _attend(lib, query, rounded_key, rounded_value, singles, heads, kv_heads, dim, prefixes=[
            None if pre is None else tuple(t.half().float() for t in pre) for pre in prefixes
        ])
        assert torch.equal(got, want)
        assert not torch.equal(want, _attend(lib, query, key, value, [
            (s, n, p, kb.clone(), vb.clone()) for s, n, p, kb, vb in segments
        ], heads, kv_heads, dim, prefixes=prefixes))  # the rounding is seen: the test can fail
        for (start, n, past, kb, vb), (_, _, _, halved_k, halved_v), pre in zip(segments, halves, prefixes):
            at = past - (share if pre is not None else 0)
            assert torch.equal(halved_k[:, :, at : at + n], key[:, :, start : start + n].half())
            assert torch.equal(halved_v[:, :, at : at + n], value[:, :, start : start + n].half())


def test_a_cache_layer_reserves_then_extends_as_update_would():
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1)
    like = torch.empty(1, 2, 0, 8)
    written, updated = new_cache(config), new_cache(config)
    for rows in (3, 1, 70, 2):  # past the first buffer's room: it grows, keeping what it held
        k, v = torch.randn(1, 2, rows, 8), torch.randn(1, 2, rows, 8)
        layer = written.layers[0]
        key_at, value_at, capacity = layer.reserve(rows, like)
        length = layer.own_length()
        assert capacity >= length + rows and key_at == layer._key_buffer.data_ptr()
        layer._key_buffer[:, :, length : length + rows] = k  # as the kernel writes them
        layer._value_buffer[:, :, length : length + rows] = v
        layer.extend(rows)
        updated.update(k, v, 0)
        assert torch.equal(written.layers[0].keys, updated.layers[0].keys)
        assert torch.equal(written.layers[0].values, updated.layers[0].values)
    written.crop(50 - written.get_seq_length())  # a rollback keeps working on the extended views
    assert written.get_seq_length() == 50 and torch.equal(written.layers[0].keys, updated.layers[0].keys[:, :, :50])


def test_the_tiny_models_run_the_compiled_kernels_alone_and_batched(tiny_loaded, monkeypatch):
    """The services' tiny pair (head size 8) takes the kernels (the fused layers, whose attention is
    this kernel), so the law tests through the real services run them; a solo forward and a
    batched step both do, for decode and Verify rows, and a prompt does not."""
    from specdec.models import ragged

    runner = tiny_loaded["target"].runner
    assert compiled_attention_ok(runner.model) and runner.on_model_thread(runner.fuses_layers)
    calls = []
    original = ragged.fused_forward

    def spy(model, batch, *args, **kwargs):
        calls.append(batch.compiled.indices)
        return original(model, batch, *args, **kwargs)

    monkeypatch.setattr(ragged, "fused_forward", spy)
    from specdec.models.runner import StepItem

    prompt = [t % runner.vocab_size for t in range(1, COMPILED_MAX_ROWS + 5)]
    runner.on_model_thread(runner.last_logits, "kernel-a", prompt, 1)
    assert not calls  # a prompt's rows go to transformers' forward and SDPA
    runner.on_model_thread(runner.last_logits, "kernel-a", [*prompt, 3], 1)
    assert calls == [frozenset({0})]
    calls.clear()
    other = prompt[::-1]  # no prefix in common: no fork reading a shared prefix (SDPA's cascade path)
    runner.on_model_thread(runner.last_logits, "kernel-b", other, 1)
    calls.clear()
    items = [StepItem("kernel-a", [*prompt, 3, 4, 5, 6], 4), StepItem("kernel-b", [*other, 2], 2)]
    runner.on_model_thread(runner.step, items)
    assert calls == [frozenset({0, 1})]


def test_a_model_in_bfloat16_keeps_sdpa(tiny_model_dirs):
    from specdec.models.loading import load_causal_lm

    model, _ = load_causal_lm(str(tiny_model_dirs["target"]), dtype="bfloat16")
    assert not compiled_attention_ok(model)


def test_segments_past_the_row_limit_keep_sdpa_and_after_a_shared_prefix_take_the_kernel(tiny_loaded):
    from specdec.models.kv_cache import SharedRoot, fork_cache
    from specdec.models.ragged import _compile_segments

    config = tiny_loaded["target"].runner.model.config
    runner = tiny_loaded["target"].runner
    runner.on_model_thread(runner.last_logits, "kernel-p", [t % runner.vocab_size for t in range(1, 40)], 1)
    source = runner.cache.peek("kernel-p").kv
    forked = fork_cache(source, 30, config)
    assert isinstance(forked.layers[0].prefix_root, SharedRoot)
    lengths = [COMPILED_MAX_ROWS + 1, COMPILED_MAX_ROWS, 2]
    batch = build_batch([new_cache(config), new_cache(config), forked], lengths, torch.device("cpu"))
    assert _compile_segments(batch, config, torch.float32).compiled.indices == frozenset({1, 2})


def test_without_the_compiled_library_steps_attend_in_sdpa_with_the_same_laws(tiny_loaded, monkeypatch):
    """A host without a compiler (or not x86-64) serves as before the kernel: SDPA per segment."""
    from specdec.models import ragged
    from specdec.models.runner import ModelRunner, SessionKVCache, StepItem

    served = tiny_loaded["target"].runner
    monkeypatch.setattr(ragged.panels, "kernel_library", lambda: None)
    plain = ModelRunner(served.model, SessionKVCache(8, 10_000))
    try:
        assert not compiled_attention_ok(plain.model) and not plain.on_model_thread(plain._compiled_ok)
        prompt = [t % plain.vocab_size for t in range(3, 30)]
        items = [StepItem("fallback-a", [*prompt, 1, 2], 2), StepItem("fallback-b", prompt[::-1] + [4], 1)]

        def prefill_then_step(runner):
            for item in items:
                runner.on_model_thread(runner.last_logits, item.session_id, item.token_ids[: -item.num_last], 1)
            return runner.on_model_thread(runner.step, items)

        got = prefill_then_step(plain)
        monkeypatch.undo()  # the served runner's rows may take the kernels from here on
        expected = prefill_then_step(served)
        for g, e in zip(got, expected, strict=True):
            torch.testing.assert_close(g.logits, e.logits, rtol=1e-5, atol=1e-5)
    finally:
        plain.close()
        served.on_model_thread(served.cache.drop, "fallback-a")
        served.on_model_thread(served.cache.drop, "fallback-b")
