"""W8A8 passes in C (ops/cpu_w8a8.c): per-row activation quantization to int8 codes; the per-row rescale of
oneDNN's float result; and, on CPUs with AMX-INT8, the whole product on AMX tiles with both scales applied in
its epilogue. Their pure-torch twins are quantization/int8.quantize_rows, the torch epilogue in
Int8LinearMethod._w8a8 and int8.w8a8_linear_ref; all are bit-identical to these.
`TOKENMILL_DISABLE_CPU_W8A8=1` turns them off."""
from __future__ import annotations

import ctypes
from functools import lru_cache

import torch

from tokenmill.ops import native

_P, _I = ctypes.c_void_p, ctypes.c_int64
DTYPES = (torch.bfloat16, torch.float32)


@lru_cache(maxsize=1)
def _library():
    lib = native.load("cpu_w8a8.c", "TOKENMILL_DISABLE_CPU_W8A8")
    if lib is None:
        return None
    lib.tm_quantize_rows_u8.argtypes = [_P, _P, _P, _I, _I, _I, ctypes.c_float, ctypes.c_int, ctypes.c_int,
                                        ctypes.c_int]
    lib.tm_rescale_rows.argtypes = [_P, _P, _P, _P, _I, _I, ctypes.c_int, ctypes.c_int]
    lib.tm_w8a8_amx.argtypes = [_P, _P, _P, _P, _P, _P, _I, _I, _I, ctypes.c_int, ctypes.c_int]
    lib.tm_quantize_rows_u8.restype = lib.tm_rescale_rows.restype = lib.tm_w8a8_amx.restype = None
    lib.tm_amx_init.restype = ctypes.c_int
    return lib


def usable(x: torch.Tensor) -> bool:
    return _library() is not None and x.device.type == "cpu" and x.dtype in DTYPES and x.dim() == 2 and \
        x.is_contiguous()


def quantize_rows_u8(x: torch.Tensor, rows: int, qmax: int, zero_point: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (xu uint8 [rows, K] = per-row int8 codes + zero_point, wrapping (0: the int8 codes' bits);
    padding rows = zero_point; t float32 [M], the row scales)."""
    m, k = x.shape
    xu = torch.empty(rows, k, dtype=torch.uint8)
    t = torch.empty(m, dtype=torch.float32)
    _library().tm_quantize_rows_u8(x.data_ptr(), xu.data_ptr(), t.data_ptr(), m, rows, k, float(qmax), zero_point,
                                   int(x.dtype == torch.bfloat16), torch.get_num_threads())
    return xu, t


def rescale_rows(y: torch.Tensor, t: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """y float32 [>= M, N] (contiguous), t [M], bias float32 [N] or None -> (y[:M] * t[:, None] + bias) in
    `dtype`, rounded once."""
    m, n = t.shape[0], y.shape[1]
    out = torch.empty(m, n, dtype=dtype)
    _library().tm_rescale_rows(y.data_ptr(), t.data_ptr(), None if bias is None else bias.data_ptr(), out.data_ptr(),
                               m, n, int(dtype == torch.bfloat16), torch.get_num_threads())
    return out


@lru_cache(maxsize=1)
def amx_available() -> bool:
    """Built with AMX-INT8 (gcc -march=native on such a CPU) and the kernel granted the tile state."""
    lib = _library()
    return lib is not None and "amx_int8" in native.cpu_flags() and bool(lib.tm_amx_init())


def amx_supports(n: int, k: int) -> bool:
    return n % 32 == 0 and k % 64 == 0


def pack_amx(q: torch.Tensor) -> torch.Tensor:
    """int8 [N, K] -> B tiles [N/16, K/64, 16, 16, 4]: P[b, c, r, j, i] = q[16 b + j, 64 c + 4 r + i]."""
    n, k = q.shape
    return q.reshape(n // 16, 16, k // 64, 16, 4).permute(0, 2, 3, 1, 4).contiguous()


def unpack_amx(packed: torch.Tensor) -> torch.Tensor:
    """pack_amx's inverse: int8 [N, K]."""
    nb, kc = packed.shape[:2]
    return packed.permute(0, 3, 1, 2, 4).reshape(nb * 16, kc * 64)


def amx_rows(m: int) -> int:
    """Rows of the codes buffer for m rows: whole 16-row tiles."""
    return (m + 15) // 16 * 16


def w8a8_amx(xq: torch.Tensor, t: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
             bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """xq int8 [amx_rows(M), K] (padding rows zero), t float32 [M], packed from pack_amx, scales float32 [N],
    bias float32 [N] or None -> ((xq @ q^T) * t[:, None] * scales + bias) [M, N] in dtype, rounded once."""
    m, k, n = t.shape[0], xq.shape[1], packed.shape[0] * 16
    out = torch.empty(m, n, dtype=dtype)
    _library().tm_w8a8_amx(xq.data_ptr(), t.data_ptr(), packed.data_ptr(), scales.data_ptr(),
                           None if bias is None else bias.data_ptr(), out.data_ptr(), m, n, k,
                           int(dtype == torch.bfloat16), torch.get_num_threads())
    return out
