"""Fused small ops for CPU decoding (ops/cpu_fused.c): add + RMSNorm, SiLU-and-mul, rotary in place.
Their pure-torch twins, and the path for every case these do not take, are the torch code in
layers/norm.py, layers/activation.py and layers/rotary.py. `TOKENMILL_DISABLE_CPU_FUSED=1` turns them off."""
from __future__ import annotations

import ctypes
from functools import lru_cache

import torch

from tokenmill.ops import native

_P, _I = ctypes.c_void_p, ctypes.c_int64
DTYPES = (torch.bfloat16, torch.float32)


@lru_cache(maxsize=1)
def _library():
    lib = native.load("cpu_fused.c", "TOKENMILL_DISABLE_CPU_FUSED")
    if lib is None:
        return None
    lib.tm_add_rmsnorm.argtypes = [_P, _P, _P, _P, _I, _I, ctypes.c_float, ctypes.c_int, ctypes.c_int]
    lib.tm_silu_mul.argtypes = [_P, _P, _I, _I, ctypes.c_int, ctypes.c_int]
    lib.tm_rotary.argtypes = [_P, _P, _P, _I, _I, _I, _I, ctypes.c_int, ctypes.c_int]
    for f in (lib.tm_add_rmsnorm, lib.tm_silu_mul, lib.tm_rotary):
        f.restype = None
    return lib


def usable(*tensors: torch.Tensor, multiple: int = 16) -> bool:
    """All on CPU, one dtype the kernels take, contiguous, last dim a multiple of `multiple`."""
    t0 = tensors[0]
    return (t0.device.type == "cpu" and _library() is not None and t0.dtype in DTYPES and
            all(t.dtype == t0.dtype and t.is_contiguous() and t.shape[-1] % multiple == 0 for t in tensors))


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Updates `residual` in place to x + residual; returns weight * norm(residual or x)."""
    out = torch.empty_like(x)
    t, d = x.shape
    _library().tm_add_rmsnorm(x.data_ptr(), None if residual is None else residual.data_ptr(), weight.data_ptr(),
                              out.data_ptr(), t, d, eps, int(x.dtype == torch.bfloat16), torch.get_num_threads())
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    t, two_i = gate_up.shape
    out = torch.empty(t, two_i // 2, dtype=gate_up.dtype)
    _library().tm_silu_mul(gate_up.data_ptr(), out.data_ptr(), t, two_i // 2, int(gate_up.dtype == torch.bfloat16),
                           torch.get_num_threads())
    return out


def rotary_(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, head_dim: int) -> None:
    """Rotates the first `num_heads` heads of each qkv row in place; cos/sin [T, head_dim]."""
    t, stride = qkv.shape
    _library().tm_rotary(qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), t, num_heads, head_dim, stride,
                         int(qkv.dtype == torch.bfloat16), torch.get_num_threads())
