"""The panels kernel: nn.Linear's product, each row's result independent of the rows and threads
beside it, clear errors on bad input, and a clear reason when it cannot be built."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

from specdec.models import panels


def test_the_kernel_builds_on_this_machine():
    # The CI machine is the one users run `make test` on: a silently missing kernel would leave the
    # services on the slower layouts with every test still green.
    assert panels.available(), panels._library()[1]


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 9, 16, 19])
@pytest.mark.parametrize(("k", "n"), [(576, 1536), (24, 40), (7, 33), (577, 32), (16, 1)])
def test_the_product_is_linears(rows, k, n):
    torch.manual_seed(rows * 1000 + k + n)
    weight, x = torch.randn(n, k), torch.randn(rows, k)
    got = panels.product(x, panels.pack(weight), n)
    torch.testing.assert_close(got, torch.nn.functional.linear(x, weight), rtol=1e-5, atol=1e-4)


def assert_rows_alone(run, x: torch.Tensor) -> None:
    """run(rows) on all of x's rows at once on two threads gives, bit for bit, each row alone and
    the rows five at a time on one thread."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        together = run(x)
        torch.set_num_threads(1)
        alone = torch.cat([run(x[i : i + 1]) for i in range(len(x))])
        in_fives = torch.cat([run(x[i : i + 5]) for i in range(0, len(x), 5)])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(together, alone) and torch.equal(together, in_fives)


def test_a_rows_result_does_not_depend_on_the_rows_or_threads_beside_it():
    """Bit for bit: so a Verify's rows equal their one-row decodes in every linear."""
    torch.manual_seed(0)
    weight, x = torch.randn(1536, 576), torch.randn(19, 576)
    packed = panels.pack(weight)
    assert_rows_alone(lambda rows: panels.product(rows, packed, 1536), x)


def test_bad_input_is_refused_before_the_kernel_reads_it():
    packed = panels.pack(torch.randn(40, 24))
    bad = [
        (torch.randn(3, 25), 40),  # K does not match
        (torch.randn(3, 24, dtype=torch.float64), 40),
        (torch.randn(24), 40),
        (torch.randn(3, 24), 65),  # more outputs than the panels hold
    ]
    for x, n in bad:
        with pytest.raises(ValueError, match="panels product"):
            panels.product(x, packed, n)


def test_a_strided_input_is_read_as_its_values():
    torch.manual_seed(1)
    weight, x = torch.randn(40, 24), torch.randn(24, 6).t()  # not contiguous
    torch.testing.assert_close(panels.product(x, panels.pack(weight), 40), x @ weight.t(), rtol=1e-5, atol=1e-5)


def test_pack_pads_the_last_panel_with_zeros():
    weight = torch.arange(33 * 3, dtype=torch.float32).reshape(33, 3)
    packed = panels.pack(weight)
    assert packed.shape == (2, 3, 32)
    assert torch.equal(packed[0, :, 5], weight[5]) and torch.equal(packed[1, :, 0], weight[32])
    assert not packed[1, :, 1:].any()


def test_without_a_compiler_the_build_says_why(tmp_path, monkeypatch):
    monkeypatch.setenv("CXX", "no-such-compiler")
    with pytest.raises(RuntimeError, match="no C\\+\\+ compiler"):
        panels.build("x86-64-v3", tmp_path)
    assert not list(tmp_path.iterdir())


def test_a_build_installs_a_loadable_library_under_its_level_and_source_digest(tmp_path):
    level = panels.cpu_level()
    if level is None:
        pytest.skip("not an x86-64 CPU with AVX2")
    built = panels.build(level, tmp_path)
    assert built.name == panels.library_name(level) and [p.name for p in tmp_path.iterdir()] == [built.name]
    assert panels.library_name(level) != panels.library_name("x86-64-v3" if level != "x86-64-v3" else "x86-64-v4")


def test_every_level_this_cpu_runs_computes_the_product(tmp_path):
    """The Docker image carries both builds; this CPU checks each it can run (v4 hosts: both)."""
    here = panels.cpu_level()
    if here is None:
        pytest.skip("not an x86-64 CPU with AVX2")
    torch.manual_seed(2)
    weight, x = torch.randn(100, 48), torch.randn(11, 48)
    order = list(panels.LEVELS)  # highest first
    for level in order[order.index(here) :]:
        lib = panels.load(panels.build(level, tmp_path))
        got = panels.product(x, panels.pack(weight), 100, lib)
        torch.testing.assert_close(got, x @ weight.t(), rtol=1e-5, atol=1e-5)


def test_the_level_follows_the_cpu_flags():
    v4 = {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx2", "fma", "bmi2", "f16c"}
    assert panels.cpu_level(v4) == "x86-64-v4"
    assert panels.cpu_level({"avx2", "fma", "bmi2", "f16c", "avx512f"}) == "x86-64-v3"
    assert panels.cpu_level({"avx2", "fma", "bmi2"}) is None  # float16 caches need F16C
    assert panels.cpu_level({"sse4_2", "avx"}) is None


def test_the_library_shares_torchs_openmp_runtime():
    """A second runtime would give the model thread a second team (specdec.models.openmp_env)."""
    assert panels.available()
    assert len(panels._loaded_openmp_runtimes()) == 1


def test_with_every_linear_on_panels_a_batched_step_gives_each_item_exactly_its_solo_logits():
    """Attention runs per session and norms per row, so once no product mixes rows, a Verify or a
    decode batched with others computes bit for bit what it computes alone."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from specdec.models.cpu_layout import use_layout_plans
    from specdec.models.layouts import PANELS

    # SmolLM2-135M's widths: at these, MKL's products of a row differ by the rows beside it.
    config = LlamaConfig(
        vocab_size=50,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=2,
        num_attention_heads=9,
        num_key_value_heads=3,
    )
    torch.manual_seed(3)
    model = LlamaForCausalLM(config).eval()
    use_layout_plans(model, PANELS)
    assert_a_batched_step_gives_solo_logits(model, {"a": [1, 2, 3, 4, 5, 6], "b": [7, 8, 9], "c": [10, 11, 12, 13]})


def assert_a_batched_step_gives_solo_logits(model, prompts: dict[str, list[int]]):
    """One step of a decode, a Verify of K = 4 and one of K = 2 after `prompts` ("a", "b", "c")
    gives each item, bit for bit, its logits run alone; returns the runner that ran them alone."""
    from specdec.models.runner import ModelRunner, SessionKVCache, StepItem

    batched, alone = ModelRunner(model, SessionKVCache(8, 10_000)), ModelRunner(model, SessionKVCache(8, 10_000))
    for runner in (batched, alone):
        for session, tokens in prompts.items():
            runner.last_logits(session, tokens, 1)
    items = [
        StepItem("a", [*prompts["a"], 20], 1),  # a decode
        StepItem("b", [*prompts["b"], 21, 22, 23, 24], 5),  # a Verify of K = 4
        StepItem("c", [*prompts["c"], 25, 26], 3),
    ]
    for got, item in zip(batched.step(items), items, strict=True):
        assert torch.equal(got.logits, alone.last_logits(item.session_id, item.token_ids, item.num_last).logits)
    return alone


def _q4_weight(n: int, k: int, seed: int) -> torch.Tensor:
    """Exactly a Q4_1 dequantization, as GGUF's: w = d * q + m in float32, d and m float16."""
    torch.manual_seed(seed)
    q = torch.randint(0, 16, (n, k // 32, 32)).float()
    d = (torch.rand(n, k // 32, 1) * 0.01).half().float()
    m = (-torch.rand(n, k // 32, 1) * 0.05).half().float()
    q[:, 0, :] = q[:, 0, :].clamp(max=14)  # a block whose largest level is not 15
    q[:, 1, :] = 0  # a constant block
    return (q * d + m).reshape(n, k)


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 19])
@pytest.mark.parametrize(("n", "k"), [(100, 576), (576, 1536), (32, 64)])
def test_a_4_bit_weight_gives_the_float32_panels_bits_from_its_compact_copy(rows, n, k):
    weight = _q4_weight(n, k, rows + n)
    compact = panels.pack_q4(weight)
    assert compact is not None and compact.nibbles.dtype == torch.uint8
    padded = -(-n // 32) * 32
    stored = compact.nibbles.numel() + 4 * (compact.scale.numel() + compact.offset.numel())  # bytes
    assert stored == padded * k * 3 // 4
    x = torch.randn(rows, k)
    assert torch.equal(panels.product(x, compact, n), panels.product(x, panels.pack(weight), n))


def test_only_weights_that_are_exactly_4_bit_blocks_pack_compact():
    weight = _q4_weight(64, 64, 0)
    assert panels.pack_q4(weight) is not None
    nudged = weight.clone()
    nudged[3, 40] = torch.nextafter(nudged[3, 40], torch.tensor(1.0))  # one weight one ulp off
    assert panels.pack_q4(nudged) is None
    assert panels.pack_q4(torch.randn(64, 64)) is None
    assert panels.pack_q4(_q4_weight(64, 64, 1)[:, :48]) is None  # inputs not in blocks of 32
    assert panels.pack_q4(torch.zeros(40, 32)) is not None


def test_the_avx2_build_gives_the_same_4_and_8_bit_products(tmp_path):
    if panels.cpu_level() is None:
        pytest.skip("not an x86-64 CPU with AVX2")
    weight, x = _q4_weight(70, 96, 5), torch.randn(11, 96)
    lib = panels.load(panels.build("x86-64-v3", tmp_path))
    expected = panels.product(x, panels.pack(weight), 70, lib)
    assert torch.equal(panels.product(x, panels.pack_q4(weight), 70, lib), expected)
    torch.testing.assert_close(expected, x @ weight.t(), rtol=1e-5, atol=1e-5)
    weight = _q8_weight(70, 96, 6)
    expected = panels.product(x, panels.pack(weight), 70, lib)
    assert torch.equal(panels.product(x, panels.pack_q8(weight), 70, lib), expected)


def _q8_weight(n: int, k: int, seed: int) -> torch.Tensor:
    """Exactly a Q8_0 dequantization, as GGUF's: w = d * q in float32, d float16, |q| <= 127."""
    torch.manual_seed(seed)
    q = torch.randint(-127, 128, (n, k // 32, 32)).float()
    q[:, :, 0] = -127  # each block's largest |q| is 127, as the quantizer makes it
    q[:, 1, :] = q[:, 1, :].clamp(-126, 126)  # ... or, rounded, 126
    d = (torch.rand(n, k // 32, 1) * 0.001).half().float()
    return (q * d).reshape(n, k)


@pytest.mark.parametrize("rows", [1, 4, 9])
@pytest.mark.parametrize(("n", "k"), [(100, 576), (49, 64)])
def test_an_8_bit_weight_gives_the_float32_panels_bits_from_its_compact_copy(rows, n, k):
    weight = _q8_weight(n, k, rows + n)
    compact = panels.pack_compact(weight)
    assert isinstance(compact, panels.Q8Panels) and panels.pack_q4(weight) is None
    x = torch.randn(rows, k)
    assert torch.equal(panels.product(x, compact, n), panels.product(x, panels.pack(weight), n))


def test_only_weights_that_are_exactly_8_bit_blocks_pack_as_such():
    weight = _q8_weight(64, 64, 0)
    nudged = weight.clone()
    nudged[5, 9] = torch.nextafter(nudged[5, 9], torch.tensor(1.0))
    assert panels.pack_q8(weight) is not None and panels.pack_q8(nudged) is None
    assert panels.pack_compact(torch.randn(64, 64)) is None
    assert isinstance(panels.pack_compact(_q4_weight(64, 64, 2)), panels.Q4Panels)  # the smaller form first


def test_a_weight_rounded_to_8_bit_blocks_packs_as_such_within_half_a_level():
    torch.manual_seed(3)
    weight = torch.randn(70, 96) * 0.05
    weight[4, 32:64] = 0.0  # a zero block stays zero
    rounded = panels.q8_rounded(weight)
    compact = panels.pack_q8(rounded)
    assert compact is not None and panels.pack_q8(weight) is None
    d = weight.reshape(70, 3, 32).abs().amax(-1, keepdim=True) / 127  # each block's level
    error = (rounded - weight).reshape(70, 3, 32).abs()
    assert bool((error <= d * 0.502).all()) and bool((rounded[4, 32:64] == 0).all())
    assert torch.equal(panels.q8_rounded(rounded), rounded)  # already blocks: unchanged
    x = torch.randn(5, 96)
    assert torch.equal(panels.product(x, compact, 70), panels.product(x, panels.pack(rounded), 70))


def test_a_read_only_cache_falls_back_to_the_temporary_directory(tmp_path, monkeypatch):
    if panels.cpu_level() is None:
        pytest.skip("not an x86-64 CPU with AVX2")
    blocked = tmp_path / "a-file"
    blocked.write_text("")  # a cache under a file cannot be made, not even by root (a read-only home)
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocked / "cache"))
    monkeypatch.delenv("SPECDEC_KERNEL_CACHE", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(panels, "PREBUILT_DIR", tmp_path / "none")
    panels._library.cache_clear()
    try:
        lib, why = panels._library()
        assert lib is not None, why
        assert [p.name for p in (tmp_path / "tmp").iterdir()] == [f"specdec-kernels-{os.getuid()}"]
    finally:
        panels._library.cache_clear()
