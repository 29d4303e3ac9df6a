"""The AMX products (kernels/amx.cpp): float32-accurate from the 4- and 8-bit copies, each row's
result independent of the rows and threads beside it, and used only where the CPU has the tiles.
The product tests need an AMX CPU (an Intel Xeon of Sapphire Rapids or later) and skip elsewhere."""

from __future__ import annotations

import pytest
import torch

from specdec.models import panels
from tests.unit.models.test_panels import _q4_weight, _q8_weight, assert_rows_alone

needs_amx = pytest.mark.skipif(not panels.amx_available(), reason="no AMX tiles on this CPU (or SPECDEC_AMX=off)")
FORMS = {"q4": (_q4_weight, panels.pack_q4), "q8": (_q8_weight, panels.pack_q8)}


@needs_amx
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize(("n", "k"), [(100, 64), (1536, 576), (200, 1536)])
@pytest.mark.parametrize("rows", [1, 18, 47])
def test_the_product_is_as_close_to_exact_as_float32_sums(form, n, k, rows):
    """Within a few float32 roundings of sum (|w| + |m|) |x| of the float64 product at every output
    (m: a 4-bit block's offset, summed apart: d * sum(q x) + m * sum(x)), inputs spanning six
    decades; a part of x dropped, an offset or scale misapplied: orders of magnitude more. The
    float32 panels kernel reaches 12 such units on these, this 8."""
    make, pack = FORMS[form]
    weight = make(n, k, rows + n)
    torch.manual_seed(rows + k)
    x = torch.randn(rows, k) * torch.logspace(-3, 3, k)[torch.randperm(k)]
    exact = x.double() @ weight.double().T
    blocks = weight.double().reshape(n, k // 32, 32)
    offset = blocks.amin(-1, keepdim=True).expand_as(blocks).reshape(n, k) if form == "q4" else 0.0
    unit = (x.double().abs() @ (weight.double().abs() + abs(offset)).T) * 2.0**-24
    got = panels.amx_product(x, pack(weight), n)
    assert got.shape == (rows, n) and got.dtype == torch.float32
    assert float(((got.double() - exact).abs() / unit).max()) <= 16


@needs_amx
@pytest.mark.parametrize("form", FORMS)
def test_a_rows_result_does_not_depend_on_the_rows_or_threads_beside_it(form):
    make, pack = FORMS[form]
    compact = pack(make(200, 576, 5))
    torch.manual_seed(1)
    # 47 rows: a full group of 32, then 15 (both tile shapes)
    assert_rows_alone(lambda rows: panels.amx_product(rows, compact, 200), torch.randn(47, 576))


@needs_amx
def test_bad_input_is_refused_before_the_kernel_reads_it():
    compact = panels.pack_q8(_q8_weight(40, 64, 2))
    for x, n in ((torch.randn(20, 65), 40), (torch.randn(20, 64, dtype=torch.float64), 40), (torch.randn(20, 64), 65)):
        with pytest.raises(ValueError, match="AMX product"):
            panels.amx_product(x, compact, n)
    with pytest.raises(ValueError, match="AMX product"):  # a float32 copy: no levels for the tiles
        panels.amx_product(torch.randn(20, 64), panels.pack(torch.randn(40, 64)), 40)


def test_the_tiles_are_used_only_where_the_cpu_has_them_and_not_switched_off(monkeypatch):
    try:
        monkeypatch.setattr(panels, "_cpu_flags", lambda: {"avx512f", "avx512bw", "avx2", "fma"})
        panels.amx_available.cache_clear()
        assert not panels.amx_available()
        with pytest.raises(RuntimeError, match="AMX tiles are unavailable"):
            panels.amx_product(torch.randn(20, 64), panels.pack_q8(_q8_weight(40, 64, 2)), 40)
        monkeypatch.undo()
        monkeypatch.setenv("SPECDEC_AMX", "off")
        panels.amx_available.cache_clear()
        assert not panels.amx_available()
    finally:
        monkeypatch.undo()
        panels.amx_available.cache_clear()
