"""Triton kernels behind `tokenmill.ops.triton_quant` (imported only when triton is installed).

One kernel, `qgemm_kernel`, specialised by constexprs into the four variants:

- BITS 4 (AutoAWQ GEMM layout, see `quantization/awq_format.py`) or 8 (int8 [N, K] + per-channel scale);
- USE_DOT: a `tl.dot` tile product (prefill, M >= 16 rows per tile) or a broadcast-multiply-and-sum
  over at most 8 rows (decode), which does not pad a handful of rows up to a 16-row MMA tile.

Each program owns a BLOCK_M x BLOCK_N tile of the output and one slice of the K tiles (split-K):
the int4 / int8 weight tile is dequantized in registers inside the K loop and never reaches memory
as floats. Program (m, n, s) writes its partial sum to out[s]; with one slice that is the result
(cast to the activation dtype by the store), with several the host sums the fp32 slices.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _w4_tile(qw_ptr, qz_ptr, s_ptr, k0, offs_k, offs_n, n_mask, N, GROUP: tl.constexpr):
    """Dequantized fp32 [BLOCK_K, BLOCK_N] tile of W^T; the K tile lies inside one group."""
    cols = offs_n // 8
    j = offs_n % 8
    shifts = ((j // 2) + (j % 2) * 4) * 4  # nibble (j//2 + 4*(j%2)) holds column 8c+j: ORDER's inverse
    q = tl.load(qw_ptr + offs_k[:, None] * (N // 8) + cols[None, :], mask=n_mask[None, :], other=0)
    g = k0 // GROUP
    z = tl.load(qz_ptr + g * (N // 8) + cols, mask=n_mask, other=0)
    s = tl.load(s_ptr + g * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    q = (q >> shifts[None, :]) & 0xF
    z = (z >> shifts) & 0xF
    return (q - z[None, :]).to(tl.float32) * s[None, :]


@triton.jit
def _w8_tile(qw_ptr, offs_k, offs_n, k_mask, n_mask, K):
    """int8 [N, K] read as an fp32 [BLOCK_K, BLOCK_N] tile of q^T (the scale comes after the K loop)."""
    ptrs = qw_ptr + offs_n[None, :].to(tl.int64) * K + offs_k[:, None]
    return tl.load(ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0).to(tl.float32)


@triton.jit
def _mac(acc, x, w, USE_DOT: tl.constexpr, PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr):
    """acc [BM, BN] += x [BM, BK] @ w [BK, BN], fp32 accumulation. UPCAST_DOT: the interpreter's tl.dot
    multiplies bfloat16 bit patterns (triton-lang/triton#11584), so there the rounded operands go in as fp32."""
    if USE_DOT:
        w = w.to(x.dtype)
        if UPCAST_DOT:
            acc = tl.dot(x.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w, acc, input_precision=PRECISION)
    else:
        acc += tl.sum(x.to(tl.float32)[:, :, None] * w[None, :, :], axis=1)
    return acc


@triton.jit
def _epilogue(acc, s_ptr, b_ptr, out_ptr, offs_m, offs_n, m_mask, n_mask, M, N, pid_k,
              BITS: tl.constexpr, HAS_BIAS: tl.constexpr):
    if BITS == 8:
        acc = acc * tl.load(s_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:  # once, in split 0: the host sums the splits
        bias = tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        acc = acc + tl.where(pid_k == 0, bias, 0.0)[None, :]
    ptrs = out_ptr + pid_k * M * N + offs_m[:, None] * N + offs_n[None, :]
    tl.store(ptrs, acc, mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def qgemm_kernel(x_ptr, qw_ptr, qz_ptr, s_ptr, b_ptr, out_ptr, M, N, K, stride_xm, stride_xk, tiles_per_split,
                 BITS: tl.constexpr, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, USE_DOT: tl.constexpr,
                 PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = offs_m < M, offs_n < N
    first = pid_k * tiles_per_split
    last = tl.minimum(first + tiles_per_split, tl.cdiv(K, BLOCK_K))
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for t in range(first, last):
        k0 = t * BLOCK_K
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        if BITS == 4:
            w = _w4_tile(qw_ptr, qz_ptr, s_ptr, k0, offs_k, offs_n, n_mask, N, GROUP)
        else:
            w = _w8_tile(qw_ptr, offs_k, offs_n, k_mask, n_mask, K)
        acc = _mac(acc, x, w, USE_DOT, PRECISION, UPCAST_DOT)
    _epilogue(acc, s_ptr, b_ptr, out_ptr, offs_m, offs_n, m_mask, n_mask, M, N, pid_k, BITS, HAS_BIAS)


INTERPRETED = type(qgemm_kernel).__name__ == "InterpretedFunction"  # TRITON_INTERPRET was set at import
