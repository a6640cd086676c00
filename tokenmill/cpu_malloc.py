"""glibc malloc settings for tensor-sized blocks (BENCHMARKS.md, "Quantization", "W8A8 at batch 32").

By default glibc serves a block above its mmap threshold (128 KiB, rising to at most 32 MiB as such blocks
are freed) with a fresh mmap and unmaps it on free, and it returns freed heap above 128 KiB to the OS. A
tensor that size then costs a page fault per 4 KiB page on first touch, every time it is allocated:
oneDNN's scratchpads and the float32 outputs of a 2048-token chunk's int8 GEMMs are 10-40 MB each, and
such a GEMM took 16 ms instead of 5.5. With both thresholds at 256 MiB those blocks stay in the heap and
are reused warm. The cost: up to 256 MiB of freed heap may stay resident instead of going back to the OS.

Applied once the model and the KV cache are in place (worker/build.py), not at import: while a load
converts weights (float -> int8, say), the float copies it frees would otherwise stay in the heap, which
only shrinks from the top (an int8 + int8-head load kept 1.4 GB more resident). So the load's freed memory
goes back to the OS first (malloc_trim), then the thresholds rise for the steps. Skipped where the user set
MALLOC_MMAP_THRESHOLD_ or MALLOC_TRIM_THRESHOLD_ (glibc's own knobs win), or TOKENMILL_MALLOC_DEFAULTS=0,
or the libc is not glibc.
"""
from __future__ import annotations

import ctypes
import os
import platform

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
THRESHOLD_BYTES = 256 << 20
_USER_KNOBS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")


def tune_for_steps() -> bool:
    """Trims the heap and raises the thresholds; True when they were set."""
    if os.environ.get("TOKENMILL_MALLOC_DEFAULTS") == "0" or any(k in os.environ for k in _USER_KNOBS):
        return False
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(None)
        mallopt, malloc_trim = libc.mallopt, libc.malloc_trim
    except (OSError, AttributeError):
        return False
    malloc_trim(0)
    return bool(mallopt(M_MMAP_THRESHOLD, THRESHOLD_BYTES)) and bool(mallopt(M_TRIM_THRESHOLD, THRESHOLD_BYTES))
