"""Triton kernels behind `tokenmill.ops.triton_fused` (imported only when triton is installed).

Each kernel rounds where its torch twin (layers/norm.py, layers/activation.py, layers/rotary.py) rounds:
every intermediate that is a tensor of the activation dtype in torch goes through `_round`, the rest is
float32. Rows are addressed through their row stride; the last dimension is contiguous. Row indices are
int64 so that row * stride cannot overflow on long prompts.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _round(v, DTYPE: tl.constexpr):
    """The float32 value a tensor of DTYPE would hold (a no-op for float32)."""
    return v.to(DTYPE).to(tl.float32)


@triton.jit
def add_rmsnorm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, H, stride_x, stride_r, stride_o, eps,
                       HAS_RESIDUAL: tl.constexpr, BLOCK_H: tl.constexpr):
    """One program per row, the whole row in registers: r = x + r (stored), out = w * round(norm(r))."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < H
    dtype = x_ptr.dtype.element_ty
    h = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r_ptrs = r_ptr + row * stride_r + cols
        h = _round(h + tl.load(r_ptrs, mask=mask, other=0.0).to(tl.float32), dtype)
        tl.store(r_ptrs, h, mask=mask)
    inv = tl.math.rsqrt(tl.sum(h * h, axis=0) / H + eps)  # masked tail loads are 0: divide by H, not BLOCK_H
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, w * _round(h * inv, dtype), mask=mask)


@triton.jit
def rotary_kernel(qkv_ptr, cos_ptr, sin_ptr, num_heads, head_dim, stride_qkv, stride_cos, stride_sin,
                  BLOCK_HEADS: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """NeoX rotate-half in place on BLOCK_HEADS heads of one row: [x1, x2] -> [x1 c1 - x2 s1, x2 c2 + x1 s2]."""
    row = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_HEADS + tl.arange(0, BLOCK_HEADS)
    half = head_dim // 2
    cols = tl.arange(0, BLOCK_HALF)
    col_mask = cols < half
    mask = (heads < num_heads)[:, None] & col_mask[None, :]
    dtype = qkv_ptr.dtype.element_ty
    cos = cos_ptr + row * stride_cos + cols
    sin = sin_ptr + row * stride_sin + cols
    # both halves of the table are read: the twin multiplies by the full [T, head_dim] rows
    c1 = tl.load(cos, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(cos + half, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(sin, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(sin + half, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    p1 = qkv_ptr + row * stride_qkv + heads[:, None] * head_dim + cols[None, :]
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p1 + half, mask=mask, other=0.0).to(tl.float32)
    tl.store(p1, _round(x1 * c1, dtype) + _round(-x2 * s1, dtype), mask=mask)
    tl.store(p1 + half, _round(x2 * c2, dtype) + _round(x1 * s2, dtype), mask=mask)


@triton.jit
def silu_mul_kernel(gu_ptr, out_ptr, inter, stride_gu, stride_o, BLOCK: tl.constexpr):
    """out[t, i] = round(silu(gate[t, i])) * up[t, i] for a BLOCK-wide slice of one row of [gate | up]."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gu = gu_ptr + row * stride_gu + cols
    g = tl.load(gu, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu + inter, mask=mask, other=0.0).to(tl.float32)
    s = _round(g / (1.0 + tl.exp(-g)), gu_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_o + cols, s * u, mask=mask)


INTERPRETED = type(add_rmsnorm_kernel).__name__ == "InterpretedFunction"  # TRITON_INTERPRET was set at import
