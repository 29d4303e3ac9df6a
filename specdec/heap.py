"""glibc's malloc kept from mapping and unmapping the services' large temporaries every step.

A batched step's laws are a few MB (8 rows of a 49,152-token vocabulary: 1.5 MB in float32, and as
much again for each temporary of the warping at T > 0), made and freed between forwards. glibc
serves a block that large with its own mmap and unmaps it when freed (its threshold adapts to the
largest block freed, yet a block of exactly that size is mapped again), so every step faults each
page in afresh: the same 4 blocks of 3.2 MB, allocated and freed 50 times, took 154,650 page faults.
`keep_heap_pages` sets glibc's mmap threshold (blocks below it come from the heap) and its trim
threshold (twice that: freed memory at the heap's top stays mapped): 0 faults. One process warping 8
rows at T = 1 took 2.83-2.95 ms before and 1.29-1.31 after (AMX Xeon, 2026-12-06); the target's
resident memory after loading and 50 steps of 8 sessions was the same (1,480 against 1,481 MB).
SPECDEC_MALLOC_MMAP_THRESHOLD_MB (default MMAP_THRESHOLD_MB; 0 leaves glibc's defaults). Other C
libraries are left alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

MMAP_THRESHOLD_MB = 64
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters


def keep_heap_pages() -> bool:
    """Whether glibc now serves blocks under SPECDEC_MALLOC_MMAP_THRESHOLD_MB from its heap and keeps
    twice that free at the heap's top; False where it was turned off or malloc is not glibc's."""
    text = os.environ.get("SPECDEC_MALLOC_MMAP_THRESHOLD_MB", str(MMAP_THRESHOLD_MB))
    try:
        megabytes = int(text)
    except ValueError:
        raise ValueError(f"SPECDEC_MALLOC_MMAP_THRESHOLD_MB must be a whole number of MB, got {text!r}") from None
    if megabytes <= 0:
        return False
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):  # no mallopt: not glibc (musl, macOS)
        return False
    size = megabytes << 20
    return bool(mallopt(_M_MMAP_THRESHOLD, size)) and bool(mallopt(_M_TRIM_THRESHOLD, 2 * size))
