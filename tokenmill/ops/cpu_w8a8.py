"""The passes around oneDNN's int8 GEMM in a W8A8 linear (ops/cpu_w8a8.c): per-row activation
quantization to unsigned codes, and the per-row rescale of the int32 products' float result. Their
pure-torch twins are quantization/int8.quantize_rows and the torch epilogue in Int8LinearMethod._w8a8;
both are bit-identical to these. `TOKENMILL_DISABLE_CPU_W8A8=1` turns them off."""
from __future__ import annotations

import ctypes
from functools import lru_cache

import torch

from tokenmill.ops import native

_P, _I = ctypes.c_void_p, ctypes.c_int64
DTYPES = (torch.bfloat16, torch.float32)
import os
SERIAL = int(os.environ.get("TM_W8A8_SERIAL", "0"))
def _threads(m): return 1 if m <= SERIAL else torch.get_num_threads()


@lru_cache(maxsize=1)
def _library():
    lib = native.load("cpu_w8a8.c", "TOKENMILL_DISABLE_CPU_W8A8")
    if lib is None:
        return None
    lib.tm_quantize_rows_u8.argtypes = [_P, _P, _P, _I, _I, _I, ctypes.c_float, ctypes.c_int, ctypes.c_int,
                                        ctypes.c_int]
    lib.tm_rescale_rows.argtypes = [_P, _P, _P, _P, _I, _I, ctypes.c_int, ctypes.c_int]
    lib.tm_quantize_rows_u8.restype = lib.tm_rescale_rows.restype = None
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
                                   int(x.dtype == torch.bfloat16), _threads(m))
    return xu, t


def rescale_rows(y: torch.Tensor, t: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """y float32 [>= M, N] (contiguous), t [M], bias float32 [N] or None -> (y[:M] * t[:, None] + bias) in
    `dtype`, rounded once."""
    m, n = t.shape[0], y.shape[1]
    out = torch.empty(m, n, dtype=dtype)
    _library().tm_rescale_rows(y.data_ptr(), t.data_ptr(), None if bias is None else bias.data_ptr(), out.data_ptr(),
                               m, n, int(dtype == torch.bfloat16), _threads(m))
    return out
