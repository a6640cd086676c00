"""Fused small ops for the GPU path (Triton): add + RMSNorm, rotary in place, SiLU-and-mul.

    add_rmsnorm(x, residual, weight, eps) -> out   x [T, H]; residual (or None) updated in place to
                                                   x + residual; out = weight * rmsnorm(residual or x)
    rotary_(qkv, cos, sin, num_heads, head_dim)    NeoX rotate-half, in place, on the first num_heads
                                                   heads of each qkv row [T, >= num_heads * head_dim];
                                                   cos/sin [T, head_dim]; the rest of the row untouched
    silu_mul(gate_up) -> out                       [T, 2I] -> [T, I]: silu(gate) * up

They are the GPU counterparts of `ops/cpu_fused.py`: one launch where the torch path runs a handful of
elementwise ops. Their pure-torch twins, the oracle in tests/test_triton_fused.py and the path for every
case these do not take, are the torch code in layers/norm.py, layers/activation.py and layers/rotary.py;
the kernels (`triton_fused_kernels.py`) round to the activation dtype where that torch code does.

Tensors are float32, float16 or bfloat16, 2-D with a contiguous last dimension (rows may be strided);
anything else is refused with an error. No host-device syncs: launch parameters come from shapes only.
The layers call these for CUDA tensors only (`usable`); on CPU the kernels run only under Triton's
interpreter (TRITON_INTERPRET=1, set before this module's kernels are first used).
`TOKENMILL_DISABLE_TRITON_FUSED=1` turns them off; an op that raises (`give_up`) turns them off too, with
one warning, and the layers go on with their torch paths.
"""
from __future__ import annotations

import os
from functools import lru_cache

import torch

from tokenmill.ops import triton_lazy as triton  # cdiv, next_power_of_2; triton loads with the kernels
from tokenmill.ops.failure_latch import FailureLatch

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
DISABLE_ENV = "TOKENMILL_DISABLE_TRITON_FUSED"
MAX_HIDDEN = 65536  # add_rmsnorm keeps a whole row in registers
_SILU_BLOCK = 1024
_ROTARY_TILE = 2048  # heads x half-head elements per rotary program
_failure = FailureLatch("Triton fused ops failed (%s); add+RMSNorm, rotary and SiLU-and-mul run as torch ops "
                        "from now on")  # tripped by give_up; then usable() is False for good


def available() -> bool:
    """True when triton is importable and the ops are not turned off by TOKENMILL_DISABLE_TRITON_FUSED."""
    return triton.installed() and not os.environ.get(DISABLE_ENV)


def usable(*tensors: torch.Tensor) -> bool:
    """What the layers ask before calling an op: available, all on CUDA, one dtype the kernels take,
    contiguous last dimensions (the ops refuse anything else)."""
    t0 = tensors[0]
    return (t0.is_cuda and not _failure and available() and t0.dtype in DTYPES and
            all(t.dtype == t0.dtype and t.device == t0.device and _unit_last_stride(t) for t in tensors))


def give_up(error: Exception) -> None:
    """A layer's op raised (a Triton compile failure on this GPU, say: before any kernel ran, so nothing was
    written): one warning, and the layers take their torch paths from now on instead of crashing a step."""
    _failure.trip(error)


@lru_cache(maxsize=1)
def _kernels():
    from tokenmill.ops import triton_fused_kernels
    return triton_fused_kernels


# ---------------------------------------------------------------- validation

def _unit_last_stride(t: torch.Tensor) -> bool:
    return t.dim() >= 1 and (t.stride(-1) == 1 or t.shape[-1] <= 1)


def _check_rows(name: str, t: torch.Tensor, device: torch.device) -> None:
    if t.dtype not in DTYPES:
        raise TypeError(f"{name} must be one of {DTYPES}, got {t.dtype}")
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D [T, features], got shape {tuple(t.shape)}")
    if not _unit_last_stride(t):
        raise ValueError(f"{name} needs a contiguous last dimension (strides {t.stride()}); pass .contiguous()")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device}")


def _num_warps(block: int) -> int:
    return 4 if block < 2048 else 8 if block < 8192 else 16


# ---------------------------------------------------------------- launch parameters (shapes only)

def norm_launch(hidden: int) -> dict:
    """Block and warps for add_rmsnorm: one program per row, the whole row in one block."""
    block = triton.next_power_of_2(hidden)
    return dict(BLOCK_H=block, num_warps=_num_warps(block))


def rotary_launch(num_heads: int, head_dim: int) -> tuple[int, dict]:
    """(head blocks per row, kernel parameters) for rotary_: a tile of heads x half a head per program."""
    block_half = triton.next_power_of_2(head_dim // 2)
    block_heads = min(triton.next_power_of_2(num_heads), max(1, _ROTARY_TILE // block_half))
    return triton.cdiv(num_heads, block_heads), dict(BLOCK_HEADS=block_heads, BLOCK_HALF=block_half, num_warps=4)


def silu_launch(inter: int) -> tuple[int, dict]:
    """(column blocks per row, kernel parameters) for silu_mul."""
    block = min(triton.next_power_of_2(inter), _SILU_BLOCK)
    return triton.cdiv(inter, block), dict(BLOCK=block, num_warps=4)


# ---------------------------------------------------------------- public ops

def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """out = weight * rmsnorm(x + residual), with `residual` updated in place to x + residual (in x's dtype);
    residual None: weight * rmsnorm(x). out's dtype is weight * x's, as in the torch path."""
    _check_rows("x", x, x.device)
    t, h = x.shape
    if residual is not None:
        _check_rows("residual", residual, x.device)
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError(f"residual must match x ({tuple(x.shape)}, {x.dtype}), "
                             f"got {tuple(residual.shape)}, {residual.dtype}")
    if weight.dtype not in DTYPES or tuple(weight.shape) != (h,) or weight.device != x.device:
        raise ValueError(f"weight must be a ({h},) tensor of {DTYPES} on {x.device}, "
                         f"got {tuple(weight.shape)}, {weight.dtype} on {weight.device}")
    if h > MAX_HIDDEN:
        raise ValueError(f"hidden size {h} over the {MAX_HIDDEN} one program holds")
    out = torch.empty(t, h, device=x.device, dtype=torch.promote_types(x.dtype, weight.dtype))
    if t == 0 or h == 0:
        return out
    r = x if residual is None else residual  # an unused stand-in pointer when there is no residual
    _kernels().add_rmsnorm_kernel[(t,)](x, r, weight.contiguous(), out, h, x.stride(0), r.stride(0), out.stride(0),
                                        float(eps), HAS_RESIDUAL=residual is not None, **norm_launch(h))
    return out


def rotary_(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, head_dim: int) -> None:
    """Rotates the first `num_heads` heads of each qkv row in place (NeoX rotate-half); cos/sin [T, head_dim]."""
    _check_rows("qkv", qkv, qkv.device)
    t, width = qkv.shape
    if head_dim <= 0 or head_dim % 2 or num_heads < 0 or num_heads * head_dim > width:
        raise ValueError(f"{num_heads} heads of an even head_dim {head_dim} must fit in qkv rows of {width}")
    for name, table in (("cos", cos), ("sin", sin)):
        _check_rows(name, table, qkv.device)
        if tuple(table.shape) != (t, head_dim) or table.dtype != qkv.dtype:
            raise ValueError(f"{name} must be [{t}, {head_dim}] in {qkv.dtype}, got {tuple(table.shape)}, {table.dtype}")
    if t == 0 or num_heads == 0:
        return
    head_blocks, params = rotary_launch(num_heads, head_dim)
    _kernels().rotary_kernel[(t, head_blocks)](qkv, cos, sin, num_heads, head_dim, qkv.stride(0), cos.stride(0),
                                               sin.stride(0), **params)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] = [gate | up] -> [T, I] = silu(gate) * up, in float32 with silu rounded as the torch path does."""
    _check_rows("gate_up", gate_up, gate_up.device)
    t, two_i = gate_up.shape
    if two_i % 2:
        raise ValueError(f"gate_up must have an even last dimension, got {two_i}")
    inter = two_i // 2
    out = torch.empty(t, inter, device=gate_up.device, dtype=gate_up.dtype)
    if t == 0 or inter == 0:
        return out
    col_blocks, params = silu_launch(inter)
    _kernels().silu_mul_kernel[(t, col_blocks)](gate_up, out, inter, gate_up.stride(0), out.stride(0), **params)
    return out
