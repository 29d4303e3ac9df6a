"""What a benchmark's numbers were measured on: the CPUs this process may use, the CPU's model and
its widest vector instructions.

The same VM type lands on different hosts: on 2026-12-02 one had AVX alone (a SmolLM2 decode step
75 ms, a prompt token ~3 ms) and the next AVX-512 (31 ms, ~1.4 ms), which moves every ratio that
weighs prompts against decoding; on 2026-12-03 an Intel host with AMX (bfloat16 tiles) too.
Compare figures only within one `isa` and `cpu`.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

_CPUINFO = Path("/proc/cpuinfo")
_STAT = Path("/proc/stat")


def cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 0


def steal_seconds(stat: str | None = None) -> float | None:
    """CPU seconds the hypervisor has given to other guests since boot, summed over this VM's CPUs
    (/proc/stat's `steal`; None where there is no such file). A run whose difference is large met
    a slow spell of the VM, not of the code: a shared VM drifts by 30% between runs."""
    if stat is None:
        try:
            stat = _STAT.read_text()
        except OSError:
            return None
    fields = stat.split("\n", 1)[0].split()
    if len(fields) < 9 or fields[0] != "cpu":
        return None
    return int(fields[8]) / os.sysconf("SC_CLK_TCK")


def _cpuinfo_field(name: str, text: str) -> str:
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == name:
            return value.strip()
    return ""


def vector_isa(flags: set[str]) -> str:
    """The widest x86 vector extension among `flags` ("" for none of them or another architecture),
    "+amx" where the CPU also has bfloat16 matrix tiles (MATMUL_DTYPE=bfloat16 pays there)."""
    for isa, flag in (("avx512", "avx512f"), ("avx2", "avx2"), ("avx", "avx")):
        if flag in flags:
            return isa + ("+amx" if "amx_bf16" in flags else "")
    return ""


def describe(cpuinfo: str | None = None) -> dict:
    """{"cpus", "cpu" (model name), "isa"}; `cpuinfo`: the text of /proc/cpuinfo (read when None)."""
    if cpuinfo is None:
        try:
            cpuinfo = _CPUINFO.read_text()
        except OSError:
            cpuinfo = ""
    model = _cpuinfo_field("model name", cpuinfo) or platform.processor() or platform.machine()
    return {"cpus": cpus(), "cpu": model, "isa": vector_isa(set(_cpuinfo_field("flags", cpuinfo).split()))}


def summary(info: dict) -> str:
    """'2 CPUs (AMD EPYC, avx512)'."""
    details = ", ".join(part for part in (info["cpu"], info["isa"]) if part)
    return f"{info['cpus']} CPUs ({details})" if details else f"{info['cpus']} CPUs"
