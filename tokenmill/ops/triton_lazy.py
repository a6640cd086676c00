"""Triton without importing it until a Triton kernel runs. Importing triton takes a tenth of a second or more at
startup, and once loaded, triton 3.x's nanobind bindings print pages of reference-leak reports when the
interpreter exits, so the CPU engine (which never launches a Triton kernel) must not load it. The launch
wrappers ask `installed()` and size grids with the two helpers below; the kernel modules
(`triton_*_kernels.py`) import triton itself, on first use."""
from __future__ import annotations

import importlib.util
from functools import lru_cache


@lru_cache(maxsize=1)
def installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """As triton.next_power_of_2: the least power of two >= n (0 for 0)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0
