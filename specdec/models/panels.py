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
BLOCK = 32  # inputs per quantization block (GGUF's Q4_1 and Q8_0)
# Past this many rows (a prompt's forward) MKL's blocked GEMM is faster and PlannedLinear uses it:
# SmolLM2 prompts on an AMX Xeon, panels against MKL (ms): from float32 panels 32 rows 63 / 70, 128
# 140 / 145, 256 263 / 253, 512 545 / 470; from the 4- and 8-bit copies 16 rows 31 / 58, 64 75 /
# 97, 128 140 / 136, 256 287 / 250.
MAX_ROWS = 128
# What kernels/amx.cpp runs (its tiles, bfloat16 conversions, AVX-512) as /proc/cpuinfo names it.
# Where the CPU has them, compact (4- and 8-bit) copies' products on the tiles serve prompts only,
# in the fused layers (`ragged._prompts_on_tiles`): never a call with decode or Verify rows, the
# head's included, which keep this kernel's bits (a Verify row must equal its decode, a batched row
# its solo self). SmolLM2's compact linears at 300 rows on an AMX Xeon, MKL from float32 against
# AMX (ms): 576 -> 1536 1.66 / 0.81, 1536 -> 576 1.63 / 0.98, 576 -> 576 0.58 / 0.42.
AMX_FLAGS = frozenset({"amx_tile", "amx_bf16", "avx512_bf16", "avx512f", "avx512bw", "avx512vl", "avx512dq"})
# What kernels/int8.cpp runs: the integer products of a model whose matmul_dtype is int8 (`Int8Q4Panels`).
INT8_FLAGS = frozenset({"avx2", "fma", "f16c"})  # AVX2's integer sums
VNNI_FLAGS = frozenset({"avx512_vnni", "avx512f", "avx512bw", "avx512vl", "avx512dq"})  # the same sums, 4x wider
# One library: the products here (and on AMX tiles, kernels/amx.cpp), the attention of ragged steps
# (kernels/attention.cpp, ragged.py) and whole decoder layers (kernels/layers.cpp, fused.py).
SOURCES = tuple(
    Path(__file__).with_name("kernels") / name
    for name in ("panels.cpp", "amx.cpp", "int8.cpp", "attention.cpp", "layers.cpp")
)
HEADERS = (Path(__file__).with_name("kernels") / "vector_math.h",)  # included by the sources (hashed with them)
PREBUILT_DIR = SOURCES[0].parent
# x86-64 micro-architecture levels and the /proc/cpuinfo flags each needs (the ones its code uses).
# Built with these flags and -march=<level>; no exceptions or RTTI, so it needs no C++ runtime.
FLAGS = ("-O3", "-mtune=generic", "-fPIC", "-fopenmp", "-fno-exceptions", "-fno-rtti")
LEVELS = {
    "x86-64-v4": {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx2", "fma", "f16c"},
    "x86-64-v3": {"avx2", "fma", "bmi2", "f16c"},
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
    sources = b"".join(source.read_bytes() for source in (*SOURCES, *HEADERS))
    key = sources + " ".join((level, *FLAGS, torch.__version__)).encode()
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
        objects, lib = [Path(scratch, f"{source.stem}.o") for source in SOURCES], Path(scratch, target.name)
        flags = [f"-march={level}", *FLAGS]
        # Linked by hand, without -fopenmp, so that the only OpenMP runtime it names is torch's.
        link = ["-shared", "-nodefaultlibs", str(runtime), f"-Wl,-rpath,{Path(runtime).parent}", "-lc", "-lm"]
        commands = [[compiler, *flags, "-c", str(src), "-o", str(obj)] for src, obj in zip(SOURCES, objects)]
        for command in (*commands, [compiler, *map(str, objects), *link, "-o", str(lib)]):
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
    missing = [str(source) for source in (*SOURCES, *HEADERS) if not source.exists()]
    if missing:  # an install without the package data
        return None, f"{', '.join(missing)} missing"
    try:
        lib = load(_find_or_build(level))
    except (OSError, RuntimeError) as failed:
        return None, str(failed)
    runtimes = _loaded_openmp_runtimes()
    if len(runtimes) > 1:
        return None, f"two OpenMP runtimes loaded ({', '.join(runtimes)})"
    return lib, ""


def _find_or_build(level: str) -> Path:
    """The library for `level`: prebuilt, cached, or built into the first cache that takes it."""
    name = library_name(level)
    found = next((d / name for d in (PREBUILT_DIR, *_cache_dirs()) if (d / name).exists()), None)
    if found is not None:
        return found
    failures = []
    for directory in _cache_dirs():
        try:
            return build(level, directory)
        except (OSError, RuntimeError) as failed:
            failures.append(str(failed))
    raise RuntimeError("; ".join(failures))


def load(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    ptr, size = ctypes.c_void_p, ctypes.c_long
    lib.panels_product.argtypes = [ptr, size, size, ptr, size, ptr]
    lib.panels_product.restype = None
    lib.panels_q4_product.argtypes = [ptr, size, size, ptr, ptr, ptr, size, ptr]
    lib.panels_q4_product.restype = None
    lib.panels_q8_product.argtypes = [ptr, size, size, ptr, ptr, size, ptr]
    lib.panels_q8_product.restype = None
    lib.ragged_attention_supports.argtypes = [size]
    lib.ragged_attention_supports.restype = ctypes.c_int
    lib.ragged_attention.argtypes = [ptr, size, size, ptr, size, size, ptr, size, size, ptr, size, size, size, size]
    lib.ragged_attention.argtypes += [ctypes.c_float, ptr, size]
    lib.ragged_attention.restype = None
    lib.decoder_layers.argtypes = [ptr, size, size, size, ptr, size, ctypes.c_float, ptr, ptr, ptr, size, size, size]
    lib.decoder_layers.argtypes += [size, ctypes.c_float, size, size]
    lib.decoder_layers.restype = ctypes.c_int
    lib.amx_request.argtypes = []
    lib.amx_request.restype = ctypes.c_int
    lib.amx_q4_product.argtypes = [ptr, size, size, ptr, ptr, ptr, size, ptr]
    lib.amx_q4_product.restype = ctypes.c_int
    lib.amx_q8_product.argtypes = [ptr, size, size, ptr, ptr, size, ptr]
    lib.amx_q8_product.restype = ctypes.c_int
    lib.int8_built.argtypes = []
    lib.int8_built.restype = ctypes.c_int
    lib.int8_products.argtypes = [ptr, size, size, ptr, size]
    lib.int8_products.restype = ctypes.c_int
    lib.int8_use_vnni.argtypes = [ctypes.c_int]
    lib.int8_use_vnni.restype = None
    lib.int8_use_vnni(int(VNNI_FLAGS <= _cpu_flags()))  # (the same bits either way: faster with VNNI)
    return lib


def _loaded_openmp_runtimes() -> list[str]:
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libgomp" in line}
    except OSError:
        return []
    return sorted({os.path.realpath(p) for p in paths})


def available() -> bool:
    return kernel_library() is not None


def kernel_library() -> ctypes.CDLL | None:
    """This process's compiled kernels (the products, ragged attention), or None (logged once)."""
    lib, why = _library()
    if lib is None:
        _log_unavailable(why)
    return lib


@functools.lru_cache(maxsize=1)
def _log_unavailable(why: str) -> None:
    log.info("the compiled kernels are unavailable (%s): MKL's products and SDPA serve", why)


def _in_panels(rows: torch.Tensor) -> torch.Tensor:
    """[N, C], a row per output -> [ceil(N / 32), C, 32] contiguous, zero past output N."""
    n, c = rows.shape
    count = -(-n // PANEL)
    padded = torch.nn.functional.pad(rows, (0, 0, 0, count * PANEL - n))
    return padded.reshape(count, PANEL, c).transpose(1, 2).contiguous()


def pack(weight: torch.Tensor) -> torch.Tensor:
    """W [N, K] float32 -> panels [ceil(N / 32), K, 32]."""
    return _in_panels(weight.detach().to(torch.float32))


def _block_levels(
    weight: torch.Tensor, offset: bool, tops: tuple[int, ...], low: int, high: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(q [N, K], d [N, K / 32], m [N, K / 32]) with every weight exactly q * d + m, q in low..high,
    one float16 d (and m) per block of 32 inputs, or None. m is the block's least value when
    `offset` (Q4_1), else 0 (Q8_0); d is tried as the float16 nearest the block's reach over each
    of `tops`, the largest |q| the quantizer may have given it."""
    n, k = weight.shape
    if k % BLOCK or n == 0:
        return None
    blocks = weight.detach().to(torch.float32).reshape(n, k // BLOCK, BLOCK)
    m = blocks.amin(-1, keepdim=True) if offset else torch.zeros_like(blocks[..., :1])
    reach = blocks.amax(-1, keepdim=True) - m if offset else blocks.abs().amax(-1, keepdim=True)
    d, q = torch.zeros_like(m), torch.zeros_like(blocks)
    solved = reach == 0  # a constant block: q = 0
    for top in tops:
        candidate = (reach / top).half().float()
        safe = torch.where(candidate > 0, candidate, torch.ones_like(candidate))
        levels = torch.round((blocks - m) / safe).clamp(low, high)
        fits = ~solved & (candidate > 0) & ((levels * candidate + m) == blocks).all(-1, keepdim=True)
        d, q, solved = torch.where(fits, candidate, d), torch.where(fits, levels, q), solved | fits
        if bool(solved.all()):
            break
    if not bool(solved.all()) or not torch.equal(q * d + m, blocks):
        return None
    return q.reshape(n, k), d.reshape(n, k // BLOCK), m.reshape(n, k // BLOCK)


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
    (GGUF's Q4_1; the packaged target's decoder weights are), else None."""
    found = _block_levels(weight, offset=True, tops=tuple(range(15, 0, -1)), low=0, high=15)
    if found is None:
        return None
    q, d, m = found
    q = _in_panels(q.to(torch.uint8))  # [P, K, 32]
    return Q4Panels((q[..., :16] | (q[..., 16:] << 4)).contiguous(), _in_panels(d), _in_panels(m))


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
    (GGUF's Q8_0: d near the block's largest |w| / 127; the packaged target's head), else None."""
    found = _block_levels(weight, offset=False, tops=(127, 126, 128, 125), low=-128, high=127)
    if found is None:
        return None
    q, d, _ = found
    return Q8Panels(_in_panels(q.to(torch.int8)), _in_panels(d))


def q8_rounded(weight: torch.Tensor) -> torch.Tensor:
    """W [N, K] (K a multiple of 32) rounded to 8-bit blocks as GGUF's Q8_0 quantizer rounds it: per
    32 inputs of an output, d = the block's largest |w| / 127 as a float16 and w = d * round(w / d),
    so that `pack_q8` finds it exact. For a draft, whose numerics never reach the output law."""
    n, k = weight.shape
    blocks = weight.detach().to(torch.float32).reshape(n, k // BLOCK, BLOCK)
    d = (blocks.abs().amax(-1, keepdim=True) / 127).half().float()
    levels = torch.round(blocks / torch.where(d > 0, d, torch.ones_like(d))).clamp(-128, 127)
    return (levels * d).reshape(n, k)


def pack_compact(weight: torch.Tensor) -> Q4Panels | Q8Panels | None:
    """The smallest exact compact form of W, if it has one."""
    return pack_q4(weight) or pack_q8(weight)


@dataclass(frozen=True)
class Int8Q4Panels:
    """A Q4Panels' weights laid out for products with int8 rows (kernels/int8.cpp)."""

    nibbles: torch.Tensor  # [P, K / 4, 64] uint8: byte 4j + i of group g, input 4g + i of outputs j / j + 16
    scale: torch.Tensor  # [P, K / 32, 32] float16 where all are exactly (`_narrowed`), else float32: d
    offset: torch.Tensor  # [P, K / 32, 32] m, as scale

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.nibbles.shape[0], self.nibbles.shape[1] * 4, PANEL)


@dataclass(frozen=True)
class Int8Q8Panels:
    """A Q8Panels' weights laid out for products with int8 rows."""

    levels: torch.Tensor  # [P, K / 4, 128] uint8: byte 64h + 4j + i of group g, q + 128 of input 4g + i, output 16h + j
    scale: torch.Tensor  # [P, K / 32, 32] float16 where all are exactly (`_narrowed`), else float32: d

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.levels.shape[0], self.levels.shape[1] * 4, PANEL)


INT8_FORMS = (Int8Q4Panels, Int8Q8Panels)


# The kernels' number for a copy's form (layers.cpp's Linear, int8.cpp's Part): 0 float32 panels, 1 / 2 the
# 4- / 8-bit copies, 3 / 4 those laid out for int8 rows, 5 / 6 the same with float16 scales.
_FORM_NUMBERS = {Q4Panels: 1, Q8Panels: 2, Int8Q4Panels: 3, Int8Q8Panels: 4}
COMPACT_FORMS, INT8_FORM_NUMBERS = frozenset({1, 2}), frozenset({3, 4, 5, 6})


def kernel_form(copy) -> tuple[int, list[torch.Tensor]]:
    """(the kernels' number for the copy's form, the tensors whose addresses follow it, in order)."""
    if isinstance(copy, (Q4Panels, Int8Q4Panels)):
        parts = [copy.nibbles, copy.scale, copy.offset]
    elif isinstance(copy, (Q8Panels, Int8Q8Panels)):
        parts = [copy.levels, copy.scale]
    else:
        parts = [copy]
    form = _FORM_NUMBERS.get(type(copy), 0)
    if isinstance(copy, INT8_FORMS) and half_scales(copy):
        form += 2
    return form, parts


def _in_groups_of_4(levels: torch.Tensor) -> torch.Tensor:
    """[P, K, L] (L bytes per input) -> [P, K / 4, L * 4]: each byte's 4 consecutive inputs side by side."""
    count, k, width = levels.shape
    return levels.reshape(count, k // 4, 4, width).transpose(2, 3).reshape(count, k // 4, width * 4).contiguous()


def _narrowed(*parts: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The parts as float16 when every value of every one is a float16 exactly (GGUF stores a block's
    d and m so: a decode streams a sixth fewer bytes of a 4-bit weight), else as they are."""
    if all(torch.equal(part.half().float(), part) for part in parts):
        return tuple(part.half() for part in parts)
    return parts


def half_scales(panels: Int8Q4Panels | Int8Q8Panels) -> bool:
    """Whether an int8 form's scales (and offsets) are float16 (`_narrowed`): int8.cpp's `half`."""
    return panels.scale.dtype == torch.float16


def to_int8(compact: Q4Panels | Q8Panels) -> Int8Q4Panels | Int8Q8Panels:
    """The same weights laid out for `product` with int8 rows."""
    if isinstance(compact, Q4Panels):
        return Int8Q4Panels(_in_groups_of_4(compact.nibbles), *_narrowed(compact.scale, compact.offset))
    count, k, _ = compact.levels.shape
    unsigned = (compact.levels.to(torch.int16) + 128).to(torch.uint8)  # [P, K, 32]: q + 128
    halves = unsigned.reshape(count, k, 2, 16).permute(0, 2, 1, 3)  # [P, 2, K, 16]
    grouped = _in_groups_of_4(halves.reshape(count * 2, k, 16)).reshape(count, 2, k // 4, 64)
    return Int8Q8Panels(grouped.transpose(1, 2).reshape(count, k // 4, 128).contiguous(), *_narrowed(compact.scale))


@functools.lru_cache(maxsize=1)
def int8_available() -> bool:
    """Whether int8 products run here: the CPU has AVX2 (AVX-512 VNNI: faster) and the kernels loaded."""
    if platform.machine() not in ("x86_64", "AMD64") or not os.path.exists("/proc/cpuinfo"):
        return False
    lib = kernel_library()
    return lib is not None and bool(lib.int8_built()) and INT8_FLAGS <= _cpu_flags()


def product(
    x: torch.Tensor,
    panels: torch.Tensor | Q4Panels | Q8Panels | Int8Q4Panels | Int8Q8Panels,
    out_features: int,
    lib: ctypes.CDLL | None = None,
) -> torch.Tensor:
    """x [M, K] float32 @ W^T -> [M, out_features], for W's `pack`, `pack_q4` or `pack_q8` (with
    this process's kernel unless another `load`ed one is given): all give the same bits. From
    `to_int8`'s forms, each row of x rounded to 8-bit blocks first (kernels/int8.cpp): other bits."""
    if lib is None:
        lib, why = _library()
        if lib is None:
            raise RuntimeError(f"the panels kernel is unavailable: {why}")
    if isinstance(panels, INT8_FORMS):
        return int8_products(x, [(panels, out_features)], lib)[0]
    kernels = (lib.panels_q4_product, lib.panels_q8_product, lib.panels_product)
    return _run(x, panels, out_features, "panels product", *kernels)[0]


def int8_products(
    x: torch.Tensor, copies: list[tuple[Int8Q4Panels | Int8Q8Panels, int]], lib: ctypes.CDLL | None = None
) -> list[torch.Tensor]:
    """`product` of x [M, K] float32 with each (int8 form, out_features) in one kernel call, as the
    fused layers run q / k / v and gate / up: x rounded once, every panel in one parallel loop, and
    each result the bits of its own one-copy call."""
    if lib is None:
        lib, why = _library()
        if lib is None:
            raise RuntimeError(f"the panels kernel is unavailable: {why}")
    x = x.contiguous()
    ys, table = [], []
    for copy, out_features in copies:
        _check(x, copy, out_features, "int8 products", dense=False)
        form, parts = kernel_form(copy)
        if form not in INT8_FORM_NUMBERS:
            raise ValueError(f"int8 products of a {type(copy).__name__}")
        y = torch.empty(x.shape[0], out_features, dtype=torch.float32)
        addresses = [t.data_ptr() for t in parts] + [0] * (3 - len(parts))
        table += [form, *addresses, out_features, y.data_ptr()]
        ys.append(y)
    parts_table = torch.tensor(table, dtype=torch.int64)
    if lib.int8_products(x.data_ptr(), x.shape[0], x.shape[1], parts_table.data_ptr(), len(copies)) != 0:
        raise MemoryError("the int8 products could not allocate their rows' levels")
    return ys


def _check(x: torch.Tensor, panels, out_features: int, what: str, dense: bool) -> None:
    """ValueError naming `what` unless x [M, K] float32 fits the copy (a float32 `pack` only if dense)."""
    count, k, width = panels.shape
    bad = x.dim() != 2 or x.shape[1] != k or x.dtype != torch.float32 or width != PANEL or count * PANEL < out_features
    if bad or (not dense and isinstance(panels, torch.Tensor)):
        raise ValueError(f"{what} of {tuple(x.shape)} {x.dtype} with panels {tuple(panels.shape)}")


def _run(x: torch.Tensor, panels, out_features: int, what: str, q4, q8, f32=None) -> tuple[torch.Tensor, int]:
    """(y, the kernel's status) of the kernel for the copy's form (q4 / q8 / f32) on x, after
    checking x against the copy (ValueError naming `what`)."""
    _check(x, panels, out_features, what, dense=f32 is not None)
    k = panels.shape[1]
    x = x.contiguous()
    y = torch.empty(x.shape[0], out_features, dtype=torch.float32)
    if isinstance(panels, Q4Panels):
        parts = (panels.nibbles.data_ptr(), panels.scale.data_ptr(), panels.offset.data_ptr())
        status = q4(x.data_ptr(), x.shape[0], k, *parts, out_features, y.data_ptr())
    elif isinstance(panels, Q8Panels):
        parts = (panels.levels.data_ptr(), panels.scale.data_ptr())
        status = q8(x.data_ptr(), x.shape[0], k, *parts, out_features, y.data_ptr())
    else:
        status = f32(x.data_ptr(), x.shape[0], k, panels.data_ptr(), out_features, y.data_ptr())
    return y, status


@functools.lru_cache(maxsize=1)
def amx_available() -> bool:
    """Whether `amx_product` runs here: the CPU has AMX tiles (and the AVX-512 parts amx.cpp uses),
    the kernels loaded, Linux granted the tiles' state, and SPECDEC_AMX is not "off"."""
    if os.environ.get("SPECDEC_AMX", "auto").lower() in ("off", "0", "false"):
        return False
    if platform.machine() not in ("x86_64", "AMD64") or not os.path.exists("/proc/cpuinfo"):
        return False
    if not AMX_FLAGS <= _cpu_flags():
        return False
    lib = kernel_library()
    if lib is None or not lib.amx_request():
        return False
    log.info("prompts of models with 4- and 8-bit weights run their products on AMX tiles")
    return True


def amx_product(x: torch.Tensor, panels: Q4Panels | Q8Panels, out_features: int) -> torch.Tensor | None:
    """x [M, K] float32 @ W^T on AMX tiles from W's compact copy (`amx_available` must be true):
    float32 sums of exact products, not `product`'s bits (kernels/amx.cpp). None when the kernel
    could not allocate its buffers (then `product` serves)."""
    if not amx_available():  # (it also asks Linux for the tiles: without that, their first use is SIGILL)
        raise RuntimeError("AMX tiles are unavailable here (amx_available)")
    lib = kernel_library()
    y, status = _run(x, panels, out_features, "AMX product", lib.amx_q4_product, lib.amx_q8_product)
    return y if status == 0 else None


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
