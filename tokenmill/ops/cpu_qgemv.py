"""Batch-1 GEMVs over int8 and int4 weights (ops/cpu_qgemv.c), for decoding with quantized weights.

Layouts (see the C file): int8 [N/16, K, 16] bytes, 16-row panels of k lines or (AVX-512) k-quad lines; int4
[N/16, K/2, 16] bytes holding two k each, with per-group scales (float16) and zero points (uint8)
[N/16, K/G, 16]. The pure-torch twins are the
dequantizing references in quantization/int8.py and quantization/awq_format.py; `int4_reference`
here computes from this module's own layout, for tests of the packing.
"""
from __future__ import annotations

import ctypes
from functools import lru_cache

import torch

from tokenmill.ops import native

_P = ctypes.c_void_p
_I = ctypes.c_int64


@lru_cache(maxsize=1)
def _library():
    lib = native.load("cpu_qgemv.c", "TOKENMILL_DISABLE_CPU_QGEMV")
    if lib is None:
        return None
    lib.tm_qgemv_s8.argtypes = [_P, _P, _P, _P, _P, _I, _I, ctypes.c_int, ctypes.c_int]
    lib.tm_qgemv_u4.argtypes = [_P, _P, _P, _P, _P, _P, _I, _I, _I, ctypes.c_int, ctypes.c_int]
    lib.tm_qgemm_s8.argtypes = [_P, _P, _P, _P, _P, _I, _I, _I, ctypes.c_int, ctypes.c_int]
    lib.tm_qgemm_u4_bf16.argtypes = [_P, _P, _P, _P, _P, _P, _I, _I, _I, _I, ctypes.c_int]
    lib.tm_qgemm_s8.restype = lib.tm_qgemm_u4_bf16.restype = None
    lib.tm_dequant_s8.argtypes = [_P, _P, _P, _I, _I, ctypes.c_int, ctypes.c_int]
    lib.tm_dequant_u4.argtypes = [_P, _P, _P, _P, _I, _I, _I, ctypes.c_int, ctypes.c_int]
    lib.tm_qgemv_s8.restype = lib.tm_qgemv_u4.restype = lib.tm_dequant_s8.restype = lib.tm_dequant_u4.restype = None
    lib.tm_qgemv_int16_rows.restype = lib.tm_qgemv_u4_layout.restype = lib.tm_qgemv_s8_layout.restype = ctypes.c_int
    return lib


def available() -> bool:
    return _library() is not None


def int16_rows() -> bool:
    """Whether the int8 and int4 kernels multiply bfloat16 rows in integers (AVX-512 VNNI and AVX2 builds):
    see `int16_twin`. int8 scales x per block of INT8_BLOCK along K (when K is a multiple of it), int4 per AWQ
    group."""
    return bool(_library().tm_qgemv_int16_rows())


INT8_BLOCK = 64  # S8_BLOCK in the C file


def int16_twin(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """The values the integer path multiplies for float rows x [M, K]: per group of K, x scaled by 2^(14 - e)
    (max |x| < 2^e), rounded half away from zero to int16, and scaled back (float64)."""
    xg = x.double().view(x.shape[0], -1, group_size)
    e = torch.frexp(xg.abs().amax(-1, keepdim=True))[1].double()
    scaled = xg * torch.exp2(14 - e)
    return (torch.trunc(scaled + torch.copysign(torch.full_like(scaled, 0.5), scaled)) * torch.exp2(e - 14)).view_as(x)


def supports(n: int, k: int, group_size: int | None = None) -> bool:
    if n % 16:
        return False
    if group_size is None:  # int8: k-quad lines hold whole quads, the portable kernels read k in pairs
        return k % (4 if int8_layout() == 1 else 2) == 0
    return k % group_size == 0 and group_size % 16 == 0


def int4_layout() -> int:
    """The int4 panel layout this build reads: 1 for dword lines (AVX-512), 0 for byte lines."""
    return _library().tm_qgemv_u4_layout() if _library() is not None else 0


def int8_layout() -> int:
    """The int8 panel layout this build reads: 1 for k-quad lines (AVX-512), 0 for k lines."""
    return _library().tm_qgemv_s8_layout() if _library() is not None else 0


def pack_int8(q: torch.Tensor) -> torch.Tensor:
    """int8 [N, K] -> bytes [N/16, K, 16] in the layout the build reads (ops/cpu_qgemv.c):
    k lines P[b][k][r] = q[16 b + r][k], or k-quad lines P[b][k/4][r][k % 4] = q + 128 (K % 4 == 0; stored as
    q ^ 0x80 in an int8 tensor, the same byte)."""
    n, k = q.shape
    if int8_layout() == 1:
        flipped = (q.view(torch.uint8) ^ 0x80).view(torch.int8)
        return flipped.view(n // 16, 16, k // 4, 4).transpose(1, 2).reshape(n // 16, k, 16).contiguous()
    return q.view(n // 16, 16, k).transpose(1, 2).contiguous()


def unpack_int8(packed: torch.Tensor) -> torch.Tensor:
    """pack_int8's panels -> int8 [N, K] codes."""
    blocks, k, _ = packed.shape
    if int8_layout() == 1:
        q = packed.view(blocks, k // 4, 16, 4).transpose(1, 2).reshape(blocks * 16, k)
        return (q.view(torch.uint8) ^ 0x80).view(torch.int8)
    return packed.transpose(1, 2).reshape(blocks * 16, k)


def pack_int4(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int):
    """q [N, K] in 0..15, scales (float16 values) and zeros [K/G, N] -> (bytes [N/16, K/2, 16], S float16 and
    Z uint8 [N/16, K/G, 16]): AWQ's own scales and zero points, 3 bytes per row and group.
    The bytes hold 64-byte lines of 8 k x 16 rows in the layout the build reads (ops/cpu_qgemv.c)."""
    n, k = q.shape
    if int4_layout() == 1:
        # dword lines: row r's dword holds q[r][k0 + kk] at nibble p, kk = 0, 2, 4, 6, 1, 3, 5, 7 for p = 0..7;
        # as bytes (little-endian), byte m = nibbles p = 2m (low) and 2m + 1 (high)
        q8 = q.to(torch.uint8).view(n // 16, 16, k // 8, 8)
        lo, hi = q8[..., [0, 4, 1, 5]], q8[..., [2, 6, 3, 7]]
        packed = (lo | (hi << 4)).permute(0, 2, 1, 3).reshape(n // 16, k // 2, 16).contiguous()
    else:  # byte lines: P[b][k2][r] = q[16 b + r][2 k2] | q[16 b + r][2 k2 + 1] << 4
        q2 = q.to(torch.uint8).view(n // 16, 16, k // 2, 2)
        packed = (q2[..., 0] | (q2[..., 1] << 4)).transpose(1, 2).contiguous()

    def panels(t):
        return t.t().reshape(n // 16, 16, k // group_size).transpose(1, 2).contiguous()

    s16 = scales.to(torch.float16)
    if not torch.equal(s16.float(), scales.float()):  # AWQ's scales are fp16; the kernels read them as such
        raise ValueError("int4 scales must be float16 values")
    return packed, panels(s16), panels(zeros.to(torch.uint8))


MAX_ROWS = 8  # the multi-row kernels take up to this many rows per call


def _out(x: torch.Tensor, n: int):
    return torch.empty(x.shape[0], n, dtype=torch.bfloat16 if x.dtype == torch.bfloat16 else torch.float32)


def _args(x, bias):
    """bfloat16 rows go in as they are (the kernel widens them); other dtypes as float32."""
    xf = x.contiguous() if x.dtype == torch.bfloat16 else x.float().contiguous()
    bf = None if bias is None else bias.float().contiguous()
    return xf, bf


def gemv_int8(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None):
    """x [M, K] (M <= MAX_ROWS) -> [M, N]; scales float32 [N]; bias float32 [N] or None. Output in bf16 for a
    bf16 x."""
    n, k = packed.shape[0] * 16, packed.shape[1]
    xf, bf = _args(x, bias)
    y = _out(x, n)
    args = (None if bf is None else bf.data_ptr(), y.data_ptr())
    if x.shape[0] == 1:
        _library().tm_qgemv_s8(packed.data_ptr(), scales.data_ptr(), xf.data_ptr(), *args, n, k,
                               int(y.dtype == torch.bfloat16), torch.get_num_threads())
    else:
        _library().tm_qgemm_s8(packed.data_ptr(), scales.data_ptr(), xf.data_ptr(), *args, x.shape[0], n, k,
                               int(y.dtype == torch.bfloat16), torch.get_num_threads())
    return y if x.dtype in (torch.bfloat16, torch.float32) else y.to(x.dtype)


def gemv_int4(x: torch.Tensor, packed: torch.Tensor, s: torch.Tensor, z: torch.Tensor, group_size: int,
              bias: torch.Tensor | None = None):
    n, k = packed.shape[0] * 16, packed.shape[1] * 2
    xf, bf = _args(x, bias)
    y = _out(x, n)
    if x.shape[0] > 1:
        if x.dtype != torch.bfloat16:  # the multi-row int4 kernel is bf16-only: one row at a time
            return torch.cat([gemv_int4(r, packed, s, z, group_size, bias) for r in x.split(1)])
        _library().tm_qgemm_u4_bf16(packed.data_ptr(), s.data_ptr(), z.data_ptr(), xf.data_ptr(),
                                    None if bf is None else bf.data_ptr(), y.data_ptr(), x.shape[0], n, k, group_size,
                                    torch.get_num_threads())
        return y
    _library().tm_qgemv_u4(packed.data_ptr(), s.data_ptr(), z.data_ptr(), xf.data_ptr(),
                           None if bf is None else bf.data_ptr(), y.data_ptr(), n, k, group_size,
                           int(y.dtype == torch.bfloat16), torch.get_num_threads())
    return y if x.dtype in (torch.bfloat16, torch.float32) else y.to(x.dtype)


def _dense_out(n: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    """W^T [K, N]; returned as its transpose, W [N, K], a view the GEMM reads directly."""
    return torch.empty(k, n, dtype=torch.bfloat16 if dtype == torch.bfloat16 else torch.float32)


def dequant_int8(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Panels -> W [N, K] (bfloat16 for a bfloat16 `dtype`, else float32), a transposed view."""
    n, k = packed.shape[0] * 16, packed.shape[1]
    w = _dense_out(n, k, dtype)
    _library().tm_dequant_s8(packed.data_ptr(), scales.data_ptr(), w.data_ptr(), n, k,
                             int(w.dtype == torch.bfloat16), torch.get_num_threads())
    return w.t()


def dequant_int4(packed: torch.Tensor, s: torch.Tensor, z: torch.Tensor, group_size: int,
                 dtype: torch.dtype) -> torch.Tensor:
    n, k = packed.shape[0] * 16, packed.shape[1] * 2
    w = _dense_out(n, k, dtype)
    _library().tm_dequant_u4(packed.data_ptr(), s.data_ptr(), z.data_ptr(), w.data_ptr(), n, k, group_size,
                             int(w.dtype == torch.bfloat16), torch.get_num_threads())
    return w.t()
