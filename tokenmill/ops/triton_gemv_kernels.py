"""Triton kernel behind `tokenmill.ops.triton_gemv` (imported only when triton is installed).

One program owns BLOCK_N output columns of every row (at most 8 rows: decode steps) and walks all of K, so
no split-K partials and no second launch. The weight tile is loaded before the input tile it multiplies,
and the K loops are software-pipelined (NUM_STAGES), so the weight stream keeps several tiles in flight.
The prologue builds each K tile of the GEMV's input from what the
layer had before the op it replaces, rounded where the torch twins round (`_round`):

    PROLOGUE 0   a = x
    PROLOGUE 1   h = round(x + r)  (r_out <- h, stored by program 0)    a = round(g * round(h * rsqrt(mean(h^2) + eps)))
    PROLOGUE 2   x = [gate | up]                                        a = round(round(silu(gate)) * up)

PROLOGUE 1 reads its rows twice: once for the sum of squares, once in the main loop (both from L2: a row is
a few KB against the megabytes of weights each program streams).
"""
from __future__ import annotations

import triton
import triton.language as tl

from tokenmill.ops.triton_fused_kernels import _round


@triton.jit
def _input_tile(x_ptr, r_ptr, g_ptr, rows, m_mask, kk, k_mask, K, stride_x, stride_r, inv,
                PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    """The GEMV input's [BLOCK_M, BLOCK_K] tile at columns kk, in float32."""
    dtype = x_ptr.dtype.element_ty
    mask = m_mask[:, None] & k_mask[None, :]
    x = x_ptr + rows[:, None] * stride_x + kk[None, :]
    a = tl.load(x, mask=mask, other=0.0).to(tl.float32)
    if PROLOGUE == 1:
        if HAS_RESIDUAL:
            a = _round(a + tl.load(r_ptr + rows[:, None] * stride_r + kk[None, :], mask=mask, other=0.0)
                       .to(tl.float32), dtype)
        g = tl.load(g_ptr + kk, mask=k_mask, other=0.0).to(tl.float32)
        a = _round(g[None, :] * _round(a * inv[:, None], dtype), dtype)
    elif PROLOGUE == 2:
        up = tl.load(x + K, mask=mask, other=0.0).to(tl.float32)
        a = _round(_round(a / (1.0 + tl.exp(-a)), dtype) * up, dtype)
    return a


@triton.jit
def gemv_kernel(x_ptr, r_ptr, r_out_ptr, g_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_x, stride_r, stride_ro,
                stride_w, stride_y, eps, PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                HAS_BIAS: tl.constexpr, USE_DOT: tl.constexpr, PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAT_BLOCK: tl.constexpr,
                NUM_STAGES: tl.constexpr):
    """y[m, n] = sum_k a[m, k] w[n, k] (+ b[n]) for BLOCK_N columns n and all M <= BLOCK_M rows.

    One row (BLOCK_M 1): each thread multiplies and adds into its own slots of a [BLOCK_N, BLOCK_K] float32
    accumulator, reduced once after the loop, so the loop is loads and FMAs only. More rows: the rows padded
    to a 16-row tl.dot tile (tensor cores; the padding costs no memory traffic)."""
    pid = tl.program_id(0)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = cols < N
    rows = tl.arange(0, BLOCK_M)
    m_mask = rows < M
    dtype = x_ptr.dtype.element_ty
    inv = tl.zeros([BLOCK_M], dtype=tl.float32)
    if PROLOGUE == 1:  # the norm's statistic first: mean of squares of round(x + r) per row, in wide tiles
        ss = tl.zeros([BLOCK_M], dtype=tl.float32)
        for k0 in tl.range(0, K, STAT_BLOCK, num_stages=NUM_STAGES):
            kk = k0 + tl.arange(0, STAT_BLOCK)
            mask = m_mask[:, None] & (kk < K)[None, :]
            h = tl.load(x_ptr + rows[:, None] * stride_x + kk[None, :], mask=mask, other=0.0).to(tl.float32)
            if HAS_RESIDUAL:
                h = _round(h + tl.load(r_ptr + rows[:, None] * stride_r + kk[None, :], mask=mask, other=0.0)
                           .to(tl.float32), dtype)
                if pid == 0:  # the new residual, out of place: other programs still read r
                    tl.store(r_out_ptr + rows[:, None] * stride_ro + kk[None, :], h, mask=mask)
            ss += tl.sum(h * h, axis=1)
        inv = tl.math.rsqrt(ss / K + eps)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_row = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        kk = k0 + ks
        k_mask = kk < K
        w = tl.load(w_ptr + cols[:, None] * stride_w + kk[None, :], mask=n_mask[:, None] & k_mask[None, :],
                    other=0.0)
        a = _input_tile(x_ptr, r_ptr, g_ptr, rows, m_mask, kk, k_mask, K, stride_x, stride_r, inv,
                        PROLOGUE, HAS_RESIDUAL)
        if USE_DOT:  # a holds values of the activation dtype (rounded): the cast is exact
            if UPCAST_DOT:
                acc = tl.dot(a, tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
            else:
                acc = tl.dot(a.to(dtype), tl.trans(w), acc, input_precision=PRECISION)
        else:
            acc_row += w.to(tl.float32) * a
    if not USE_DOT:
        acc = tl.sum(acc_row, axis=1)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows[:, None] * stride_y + cols[None, :], acc, mask=m_mask[:, None] & n_mask[None, :])


INTERPRETED = type(gemv_kernel).__name__ == "InterpretedFunction"  # TRITON_INTERPRET was set at import
