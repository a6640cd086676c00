"""Weight-only quantized GEMMs on AMX-BF16 tiles (ops/cpu_qgemm_amx.c), for bfloat16 steps with more rows
than the GEMVs take. They read the int8 and int4 panels of ops/cpu_qgemv.py as stored, so a layer keeps one
copy of its codes. `twin` is the pure-torch oracle: the codes, zero points and scales applied in float32,
each group's dot product scaled on its own. `TOKENMILL_DISABLE_CPU_QGEMM_AMX=1` turns the kernels off."""
from __future__ import annotations

import ctypes
from functools import lru_cache

import torch

from tokenmill.ops import cpu_qgemv, native

_P, _I = ctypes.c_void_p, ctypes.c_int64
# Above this many rows int4 layers go back to dequantizing once per call: widening the nibbles once per
# row chunk then costs more than the dequantized weight's pass (2048-row gate_up of Qwen2.5-0.5B: 28.7 ms
# against 27.5; 1536 rows 13.6 against 11.1; 1024 rows 8.7 against 8.3; 512 rows 4.6 against 5.0).
INT4_MAX_ROWS = 1024
# Where this GEMM is available, weight-only layers keep the few-row GEMVs only up to this many rows. Per
# 4864 x 896 layer the GEMM costs ~180 us (int4) / ~300 (int8) at 1-16 rows, the GEMVs 90-120 / 190-220 at
# 1 row, 240 / 320 at 4 and 420 / 440 at 8; steps of up to this many rows also keep the one-call decode step
# (worker/cpu_decode_step.py). AWQ + int8 head, 0.5B shape, decode step: B = 5 39.1 -> 36.0 ms, B = 6
# 44.7 -> 38.0, B = 8 55.1 -> 39.2 against a cap of 8; B <= 4 unchanged.
GEMV_ROWS = 4


@lru_cache(maxsize=1)
def _library():
    lib = native.load("cpu_qgemm_amx.c", "TOKENMILL_DISABLE_CPU_QGEMM_AMX")
    if lib is None:
        return None
    lib.tm_qgemm_amx_bf16.argtypes = [ctypes.c_int, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I, ctypes.c_int]
    lib.tm_qgemm_amx_bf16.restype = None
    lib.tm_qgemm_amx_available.restype = ctypes.c_int
    return lib


@lru_cache(maxsize=1)
def available() -> bool:
    """Built with AMX-BF16, the kernel granted the tile state, and the panels in the AVX-512 layouts (int8
    k-quad lines, int4 dword lines)."""
    lib = _library()
    return lib is not None and "amx_bf16" in native.cpu_flags() and bool(lib.tm_qgemm_amx_available()) and \
        cpu_qgemv.available() and cpu_qgemv.int4_layout() == 1 and cpu_qgemv.int8_layout() == 1


def supports(n: int, k: int, group_size: int | None = None) -> bool:
    return n % 32 == 0 and k % 32 == 0 and (group_size is None or group_size % 32 == 0)


def _padded(x: torch.Tensor) -> torch.Tensor:
    """x bf16 [M, K] with whole 16-row tiles (the tiles read them; padding rows are not written out)."""
    x = x.contiguous()
    m = x.shape[0]
    if m % 16 == 0:
        return x
    xp = torch.zeros((m + 15) // 16 * 16, x.shape[1], dtype=x.dtype)
    xp[:m] = x
    return xp


def _run(bits, x, packed, s, z, n, k, group_size, bias):
    if not available():  # also what asks Linux for the tile state, without which a tile instruction faults
        raise RuntimeError("AMX-BF16 kernels are not available on this CPU")
    xp = _padded(x)
    y = torch.empty(x.shape[0], n, dtype=torch.bfloat16)
    _library().tm_qgemm_amx_bf16(bits, packed.data_ptr(), s.data_ptr(), 0 if z is None else z.data_ptr(),
                                 xp.data_ptr(), None if bias is None else bias.data_ptr(), y.data_ptr(),
                                 x.shape[0], n, k, group_size, torch.get_num_threads())
    return y


def gemm_int8(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None):
    """x bf16 [M, K], packed from cpu_qgemv.pack_int8, scales and bias float32 [N] -> bf16 [M, N]."""
    n, k = packed.shape[0] * 16, packed.shape[1]
    return _run(8, x, packed, scales, None, n, k, k, bias)


def gemm_int4(x: torch.Tensor, packed: torch.Tensor, s: torch.Tensor, z: torch.Tensor, group_size: int,
              bias: torch.Tensor | None = None):
    """x bf16 [M, K], (packed, s, z) from cpu_qgemv.pack_int4 (dword lines), bias float32 [N] -> bf16 [M, N]."""
    n, k = packed.shape[0] * 16, packed.shape[1] * 2
    return _run(4, x, packed, s, z, n, k, group_size, bias)


def twin(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, group_size: int,
         bias: torch.Tensor | None = None) -> torch.Tensor:
    """The kernels' math in float32: q [N, K] codes, scales and zeros [N, K/G] (zeros None for int8):
    y = sum_g s[:, g] * (x_g @ (q_g - z_g)^T) (+ bias), rounded once to bf16."""
    n, k = q.shape
    xg = x.float().view(-1, k // group_size, group_size)
    w = q.float().view(n, k // group_size, group_size)
    if zeros is not None:
        w = w - zeros.float()[..., None]
    dots = torch.einsum("mgk,ngk->mgn", xg, w)                     # [M, K/G, N]
    y = (dots * scales.float().t()[None]).sum(1)
    return (y if bias is None else y + bias.float()).to(torch.bfloat16)
