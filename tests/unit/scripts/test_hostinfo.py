"""The host a benchmark ran on, as its header and JSON record it."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "scripts"))

import hostinfo

CPUINFO = """processor\t: 0
model name\t: AMD EPYC
flags\t\t: fpu sse sse2 avx fma avx2 avx512f avx512bw
"""


def test_the_widest_vector_extension_is_named():
    assert hostinfo.vector_isa({"sse2", "avx", "fma"}) == "avx"
    assert hostinfo.vector_isa({"avx", "avx2"}) == "avx2"
    assert hostinfo.vector_isa({"avx", "avx2", "avx512f"}) == "avx512"
    assert hostinfo.vector_isa({"avx2", "avx512f", "amx_tile", "amx_bf16"}) == "avx512+amx"
    assert hostinfo.vector_isa({"neon"}) == ""


def test_describe_reads_the_model_and_flags():
    info = hostinfo.describe(CPUINFO)
    assert info["cpu"] == "AMD EPYC" and info["isa"] == "avx512" and info["cpus"] >= 1
    assert hostinfo.summary(info) == f"{info['cpus']} CPUs (AMD EPYC, avx512)"


def test_a_machine_without_cpuinfo_still_describes_itself():
    info = hostinfo.describe("")
    assert info["isa"] == "" and hostinfo.summary(info).startswith(f"{info['cpus']} CPUs")
