"""The `panels` product: x @ W^T on a copy of W repacked into 32-output panels (kernels/panels.cpp).

MKL's float32 kernels read W once for 1-3 rows and switch at 4 to one that costs about a third
more, though a forward's few rows are cheap beside streaming its weights from memory; this kernel
streams each panel once for all rows (kernels/panels.cpp says how, and why each row's result is
the same whatever the rows and threads beside it). It is one more layout for the calibration to
time (`specdec.models.cpu_layout`), not a replacement: where MKL is faster, MKL stays.

Weights that are exactly 4- or 8-bit blocks (a GGUF model's Q4_1 / Q8_0 weights, dequantized to
float32 when it loaded, as the packaged target's are) get a compact copy instead (`pack_compact`):
the kernel rebuilds each float32 weight exactly from it, so the products are the same bits from a
sixth or a third of the memory traffic.

The kernel is C++ built for the CPU's x86-64 level (v4: AVX-512, v3: AVX2 + FMA) and linked to
the OpenMP runtime torch loaded, so its threads are the model thread's team (a second runtime
would mean a second team: `specdec.models.openmp_env`). A library built beforehand
(`python -m specdec.models.panels --build`, as the Docker image's build stage does) is used if
present, else one is built into the user cache (or, where that cannot be written, the temporary
directory) with the C++ compiler (`CXX`, default g++; about a second) and kept there. Without a
compiler, on another CPU or if anything fails, the layout is unavailable and the service logs why
once: the other layouts serve as before.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import glob
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

PANEL = 32  # outputs per panel: the kernel's two 16-float vectors
# Past this many rows (a prompt's forward) MKL's blocked GEMM is faster and PlannedLinear uses it:
# SmolLM2 prompts on an AMX Xeon, panels against MKL (ms): from float32 panels 32 rows 63 / 70, 128
# 140 / 145, 256 263 / 253, 512 545 / 470; from the 4- and 8-bit copies 16 rows 31 / 58, 64 75 /
# 97, 128 140 / 136, 256 287 / 250.
MAX_ROWS = 128
SOURCE = Path(__file__).with_name("kernels") / "panels.cpp"
PREBUILT_DIR = SOURCE.parent
# x86-64 micro-architecture levels and the /proc/cpuinfo flags each needs (the ones its code uses).
# Built with these flags and -march=<level>; no exceptions or RTTI, so it needs no C++ runtime.
FLAGS = ("-O3", "-mtune=generic", "-fPIC", "-fopenmp", "-fno-exceptions", "-fno-rtti")
LEVELS = {
    "x86-64-v4": {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx2", "fma"},
    "x86-64-v3": {"avx2", "fma", "bmi2"},
}


def cpu_level(flags: set[str] | None = None) -> str | None:
    """The highest level in LEVELS this CPU runs (None: not x86-64 Linux, or too old)."""
    if flags is None:
        if platform.machine() not in ("x86_64", "AMD64") or not os.path.exists("/proc/cpuinfo"):
            return None
        flags = _cpu_flags()
    return next((level for level, needs in LEVELS.items() if needs <= flags), None)


def _cpu_flags() -> set[str]:
    with open("/proc/cpuinfo") as info:
        for line in info:
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    return set()


def _openmp_runtime() -> str | None:
    """torch's own libgomp (the CPU and CUDA wheels carry one), which the library links to."""
    found = sorted(glob.glob(str(Path(torch.__file__).parent / "lib" / "libgomp*.so*")))
    return found[0] if found else None


def library_name(level: str) -> str:
    key = SOURCE.read_bytes() + " ".join((level, *FLAGS, torch.__version__)).encode()
    digest = hashlib.sha256(key).hexdigest()[:12]
    return f"panels-{level}-{digest}.so"


def _cache_dirs() -> list[Path]:
    """Where a built library is kept: SPECDEC_KERNEL_CACHE if set, else the user cache, then the
    temporary directory (a read-only home, as under a read-only root filesystem)."""
    explicit = os.environ.get("SPECDEC_KERNEL_CACHE")
    if explicit:
        return [Path(explicit)]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return [Path(base) / "specdec" / "kernels", Path(tempfile.gettempdir()) / f"specdec-kernels-{os.getuid()}"]


def build(level: str, directory: Path) -> Path:
    """Compile the kernel for `level` into directory; raises RuntimeError with the reason."""
    compiler = shutil.which(os.environ.get("CXX", "g++"))
    if compiler is None:
        raise RuntimeError(f"no C++ compiler ({os.environ.get('CXX', 'g++')}) on PATH")
    runtime = _openmp_runtime()
    if runtime is None:
        raise RuntimeError("torch carries no libgomp to link against")
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / library_name(level)
    with tempfile.TemporaryDirectory(dir=directory) as scratch:
        obj, lib = Path(scratch, "panels.o"), Path(scratch, target.name)
        flags = [f"-march={level}", *FLAGS]
        # Linked by hand, without -fopenmp, so that the only OpenMP runtime it names is torch's.
        link = ["-shared", "-nodefaultlibs", str(runtime), f"-Wl,-rpath,{Path(runtime).parent}", "-lc", "-lm"]
        compile_ = [compiler, *flags, "-c", str(SOURCE), "-o", str(obj)]
        for command in (compile_, [compiler, str(obj), *link, "-o", str(lib)]):
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"{' '.join(command)} failed: {done.stderr.strip()[-400:]}")
        os.replace(lib, target)  # atomic: processes building at once each install a whole file
    return target


@functools.lru_cache(maxsize=1)
def _library() -> tuple[ctypes.CDLL | None, str]:
    """(the loaded kernel, '') or (None, why it is unavailable); tried once per process."""
    level = cpu_level()
    if level is None:
        return None, "this CPU is not x86-64 with AVX2 + FMA"
    if not SOURCE.exists():  # an install without the package data
        return None, f"{SOURCE} is missing"
    name = library_name(level)
    path = next((d / name for d in (PREBUILT_DIR, *_cache_dirs()) if (d / name).exists()), None)
    failures = []
    for directory in [] if path else _cache_dirs():
        try:
            path = build(level, directory)
            break
        except (OSError, RuntimeError) as failed:
            failures.append(str(failed))
    try:
        lib = load(path) if path else None
    except OSError as failed:
        failures.append(str(failed))
        lib = None
    if lib is None:
        return None, "; ".join(failures)
    runtimes = _loaded_openmp_runtimes()
    if len(runtimes) > 1:
        return None, f"two OpenMP runtimes loaded ({', '.join(runtimes)})"
    return lib, ""


def load(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    ptr, size = ctypes.c_void_p, ctypes.c_long
    lib.panels_product.argtypes = [ptr, size, size, ptr, size, ptr]
    lib.panels_product.restype = None
    lib.panels_q4_product.argtypes = [ptr, size, size, ptr, ptr, ptr, size, ptr]
    lib.panels_q4_product.restype = None
    lib.panels_q8_product.argtypes = [ptr, size, size, ptr, ptr, size, ptr]
    lib.panels_q8_product.restype = None
    return lib


def _loaded_openmp_runtimes() -> list[str]:
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libgomp" in line}
    except OSError:
        return []
    return sorted({os.path.realpath(p) for p in paths})


def available() -> bool:
    lib, why = _library()
    if lib is None:
        _log_unavailable(why)
    return lib is not None


@functools.lru_cache(maxsize=1)
def _log_unavailable(why: str) -> None:
    log.info("the panels matmul layout is unavailable (%s); the other layouts serve", why)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """W [N, K] float32 -> panels [ceil(N / 32), K, 32], zero past row N."""
    n, k = weight.shape
    count = -(-n // PANEL)
    padded = torch.zeros(count * PANEL, k, dtype=torch.float32)
    padded[:n] = weight.detach()
    return padded.reshape(count, PANEL, k).transpose(1, 2).contiguous()


@dataclass(frozen=True)
class Q4Panels:
    """W exactly as 4-bit blocks (w = d * q + m per 32 inputs of an output), in panels."""

    nibbles: torch.Tensor  # [P, K, 16] uint8: byte j holds output j (low 4 bits) and j + 16 (high)
    scale: torch.Tensor  # [P, K / 32, 32] float32: d
    offset: torch.Tensor  # [P, K / 32, 32] float32: m

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.nibbles.shape[0], self.nibbles.shape[1], PANEL)


def pack_q4(weight: torch.Tensor) -> Q4Panels | None:
    """W [N, K] as Q4Panels when every weight is exactly d * q + m of a 4-bit block dequantization
    (GGUF's Q4_1: m the block's least value, d a float16; the packaged target's decoder weights
    are), else None. Found from the values alone, then checked weight by weight."""
    n, k = weight.shape
    if k % 32 or n == 0:
        return None
    blocks = weight.detach().to(torch.float32).reshape(n, k // 32, 32)
    m = blocks.amin(-1, keepdim=True)
    span = blocks.amax(-1, keepdim=True) - m
    d = torch.zeros_like(m)
    q = torch.zeros_like(blocks)
    solved = span == 0  # a constant block: q = 0
    for top in range(15, 0, -1):  # the largest q in the block: 15 unless the quantizer rounded it down
        candidate = (span / top).half().float()
        safe = torch.where(candidate > 0, candidate, torch.ones_like(candidate))
        levels = torch.round((blocks - m) / safe).clamp(0, 15)
        fits = ~solved & (candidate > 0) & ((levels * candidate + m) == blocks).all(-1, keepdim=True)
        d, q, solved = torch.where(fits, candidate, d), torch.where(fits, levels, q), solved | fits
        if bool(solved.all()):
            break
    if not bool(solved.all()) or not torch.equal(q * d + m, blocks):
        return None
    count = -(-n // PANEL)
    pad = count * PANEL - n
    q = torch.nn.functional.pad(q.reshape(n, k), (0, 0, 0, pad)).to(torch.uint8)
    q = q.reshape(count, PANEL, k).transpose(1, 2)  # [P, K, 32]
    nibbles = (q[..., :16] | (q[..., 16:] << 4)).contiguous()

    def per_panel(values: torch.Tensor) -> torch.Tensor:  # [N, K/32, 1] -> [P, K/32, 32]
        padded = torch.nn.functional.pad(values.reshape(n, k // 32), (0, 0, 0, pad))
        return padded.reshape(count, PANEL, k // 32).transpose(1, 2).contiguous()

    return Q4Panels(nibbles, per_panel(d), per_panel(m))


@dataclass(frozen=True)
class Q8Panels:
    """W exactly as 8-bit blocks (w = d * q per 32 inputs of an output), in panels."""

    levels: torch.Tensor  # [P, K, 32] int8: q
    scale: torch.Tensor  # [P, K / 32, 32] float32: d

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.levels.shape[0], self.levels.shape[1], PANEL)


def pack_q8(weight: torch.Tensor) -> Q8Panels | None:
    """W [N, K] as Q8Panels when every weight is exactly d * q of an 8-bit block dequantization
    (GGUF's Q8_0: d = a float16 near the block's largest |w| / 127), else None; checked weight
    by weight."""
    n, k = weight.shape
    if k % 32 or n == 0:
        return None
    blocks = weight.detach().to(torch.float32).reshape(n, k // 32, 32)
    top = blocks.abs().amax(-1, keepdim=True)
    d = torch.zeros_like(top)
    q = torch.zeros_like(blocks)
    solved = top == 0
    for largest in (127, 126, 128, 125):  # the largest |q|: 127 unless d's rounding moved it
        candidate = (top / largest).half().float()
        safe = torch.where(candidate > 0, candidate, torch.ones_like(candidate))
        levels = torch.round(blocks / safe).clamp(-128, 127)
        fits = ~solved & (candidate > 0) & ((levels * candidate) == blocks).all(-1, keepdim=True)
        d, q, solved = torch.where(fits, candidate, d), torch.where(fits, levels, q), solved | fits
        if bool(solved.all()):
            break
    if not bool(solved.all()) or not torch.equal(q * d, blocks):
        return None
    count = -(-n // PANEL)
    pad = count * PANEL - n
    q = torch.nn.functional.pad(q.reshape(n, k), (0, 0, 0, pad)).to(torch.int8)
    levels = q.reshape(count, PANEL, k).transpose(1, 2).contiguous()  # [P, K, 32]
    scale = torch.nn.functional.pad(d.reshape(n, k // 32), (0, 0, 0, pad))
    return Q8Panels(levels, scale.reshape(count, PANEL, k // 32).transpose(1, 2).contiguous())


def pack_compact(weight: torch.Tensor) -> Q4Panels | Q8Panels | None:
    """The smallest exact compact form of W, if it has one."""
    return pack_q4(weight) or pack_q8(weight)


def product(
    x: torch.Tensor, panels: torch.Tensor | Q4Panels | Q8Panels, out_features: int, lib: ctypes.CDLL | None = None
) -> torch.Tensor:
    """x [M, K] float32 @ W^T -> [M, out_features], for W's `pack`, `pack_q4` or `pack_q8` (with
    this process's kernel unless another `load`ed one is given). All give the same bits."""
    if lib is None:
        lib, why = _library()
        if lib is None:
            raise RuntimeError(f"the panels kernel is unavailable: {why}")
    count, k, width = panels.shape
    if x.dim() != 2 or x.shape[1] != k or x.dtype != torch.float32 or width != PANEL or count * PANEL < out_features:
        raise ValueError(f"panels product of {tuple(x.shape)} {x.dtype} with panels {tuple(panels.shape)}")
    x = x.contiguous()
    y = torch.empty(x.shape[0], out_features, dtype=torch.float32)
    if isinstance(panels, Q4Panels):
        lib.panels_q4_product(
            x.data_ptr(), x.shape[0], k, panels.nibbles.data_ptr(), panels.scale.data_ptr(),
            panels.offset.data_ptr(), out_features, y.data_ptr(),
        )
    elif isinstance(panels, Q8Panels):
        lib.panels_q8_product(
            x.data_ptr(), x.shape[0], k, panels.levels.data_ptr(), panels.scale.data_ptr(), out_features, y.data_ptr()
        )
    else:
        lib.panels_product(x.data_ptr(), x.shape[0], k, panels.data_ptr(), out_features, y.data_ptr())
    return y


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Build the panels kernel beside its source (Docker build stage).")
    parser.add_argument("--build", action="store_true", help="build one library per x86-64 level in LEVELS")
    args = parser.parse_args(argv)
    if not args.build:
        parser.print_help()
        return 2
    if platform.machine() not in ("x86_64", "AMD64"):
        print(f"panels: nothing to build on {platform.machine()} (x86-64 only); the other layouts serve")
        return 0
    for level in LEVELS:
        print(build(level, PREBUILT_DIR))
    return 0


if __name__ == "__main__":
    sys.exit(main())
