"""GEMV kernels for batch-1 decoding, and the same for a few rows (bfloat16 and float32 weights).

oneDNN's and `F.linear`'s kernels reach about half of the memory bandwidth for a single row (see
BENCHMARKS.md), and on AVX2 torch's M=1 mm reaches a quarter of it on small matrices; a weight repacked
into 16-row panels (VNNI pairs for bfloat16) and read as one stream gets much closer. The C source sits
beside this file and is built by `ops/native.py`: AVX512-BF16 intrinsics where the CPU has them, portable
vectorized C elsewhere (AVX2 + FMA at least); without gcc or such a CPU, `available()` is False and the
caller keeps its other path. `TOKENMILL_DISABLE_CPU_GEMV=1` turns it off.
The pure-torch twin (the oracle in tests) is `F.linear`.
"""
from __future__ import annotations

import ctypes
from functools import lru_cache

import torch

from tokenmill.ops import native


@lru_cache(maxsize=1)
def _library():
    lib = native.load("cpu_gemv.c", "TOKENMILL_DISABLE_CPU_GEMV")
    if lib is None:
        return None
    fns = {torch.bfloat16: lib.tm_gemv_bf16_vnni, torch.float32: lib.tm_gemv_f32}
    for fn in fns.values():
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                       ctypes.c_int64, ctypes.c_int]
        fn.restype = None
    rows = {torch.bfloat16: lib.tm_gemm_rows_bf16, torch.float32: lib.tm_gemm_rows_f32}
    for fn in rows.values():
        fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int]
        fn.restype = None
    return fns, rows


def available() -> bool:
    return _library() is not None


DTYPES = (torch.bfloat16, torch.float32)


def supports(weight: torch.Tensor) -> bool:
    n, k = weight.shape
    pairs_ok = k % 2 == 0 or weight.dtype == torch.float32
    return weight.dtype in DTYPES and weight.device.type == "cpu" and n % 16 == 0 and pairs_ok


def pack(weight: torch.Tensor) -> torch.Tensor:
    """bfloat16 [N, K] -> [N/16, K/2, 16, 2]; float32 [N, K] -> [N/16, K, 16] (see cpu_gemv.c)."""
    n, k = weight.shape
    w = weight.detach()
    if w.dtype == torch.float32:
        return w.view(n // 16, 16, k).transpose(1, 2).contiguous()
    return w.view(n // 16, 16, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def gemv(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [1, K] -> [1, N], in the packed weight's dtype."""
    n = packed.shape[0] * 16
    k = packed.shape[1] * (2 if packed.dtype == torch.bfloat16 else 1)
    x = x.contiguous()
    y = torch.empty(1, n, dtype=packed.dtype)
    _library()[0][packed.dtype](packed.data_ptr(), x.data_ptr(), None if bias is None else bias.data_ptr(),
                                y.data_ptr(), n, k, torch.get_num_threads())
    return y


MAX_ROWS = 8  # rows per weight pass of gemm_rows, which takes any count (in chunks of 8); layers take it up to kernel_rows


def gemm_rows(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K], M >= 2 -> [M, N]: each weight panel read once per MAX_ROWS rows (decode batches)."""
    n = packed.shape[0] * 16
    k = packed.shape[1] * (2 if packed.dtype == torch.bfloat16 else 1)
    x = x.contiguous()
    y = torch.empty(x.shape[0], n, dtype=packed.dtype)
    _library()[1][packed.dtype](packed.data_ptr(), x.data_ptr(), None if bias is None else bias.data_ptr(),
                                y.data_ptr(), x.shape[0], n, k, torch.get_num_threads())
    return y
