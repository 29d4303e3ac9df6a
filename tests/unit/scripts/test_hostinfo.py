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


def test_steal_is_the_eighth_counter_of_the_cpu_line_in_seconds():
    import os

    tick = os.sysconf("SC_CLK_TCK")
    stat = f"cpu  310407 0 33457 7018125 3003 0 598 {3 * tick} 0 0\ncpu0 1 2 3 4 5 6 7 8 9 10\n"
    assert hostinfo.steal_seconds(stat) == 3.0
    assert hostinfo.steal_seconds("cpu 1 2 3\n") is None and hostinfo.steal_seconds("intr 5\n") is None
    assert hostinfo.steal_seconds() is None or hostinfo.steal_seconds() >= 0  # this machine's, if Linux
