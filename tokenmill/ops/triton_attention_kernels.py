"""Triton kernels behind `tokenmill.ops.triton_attention` (imported only when triton is installed).

- `write_kv_kernel`: one program per (token, tile of KV heads) copies k/v rows into their cache slots.
- `rotary_write_kv_kernel`: rotary on the q and k heads of a qkv row, in place, and the k/v heads into
  the row's cache slot, one launch for what `rotary_kernel` and `write_kv_kernel` do in two.
- `unified_attention_kernel`: paged attention for a whole mixed step (decodes and prefill chunks), one
  program per (query tile of one sequence, KV head, KV split); see the module docstring of
  triton_attention.py for the grid diagram.
- `reduce_splits_kernel`: merges the split-KV partial outputs by their log-sum-exp.

Scores live in the log2 domain (scale * log2(e) folded into one multiply, exp2 instead of exp), so the
partial log-sum-exps written for split-KV are base-2 too; only these kernels read them.
"""
from __future__ import annotations

import triton
import triton.language as tl

from tokenmill.ops.triton_fused_kernels import _round


@triton.jit
def write_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, num_kv_heads,
                    stride_kt, stride_kh, stride_kd, stride_vt, stride_vh, stride_vd,
                    stride_kcb, stride_kcs, stride_kch, stride_kcd,
                    stride_vcb, stride_vcs, stride_vch, stride_vcd,
                    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                    HEAD_BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:  # padding row: its slot is -1 and nothing is written
        return
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    heads = tl.program_id(1) * HEAD_BLOCK + tl.arange(0, HEAD_BLOCK)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    mask = (heads < num_kv_heads)[:, None] & (offs_d < HEAD_DIM)[None, :]
    k = tl.load(k_ptr + t * stride_kt + heads[:, None] * stride_kh + offs_d[None, :] * stride_kd, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + heads[:, None] * stride_vh + offs_d[None, :] * stride_vd, mask=mask)
    tl.store(kc_ptr + blk * stride_kcb + off * stride_kcs + heads[:, None] * stride_kch + offs_d[None, :] * stride_kcd,
             k, mask=mask)
    tl.store(vc_ptr + blk * stride_vcb + off * stride_vcs + heads[:, None] * stride_vch + offs_d[None, :] * stride_vcd,
             v, mask=mask)


@triton.jit
def rotary_write_kv_kernel(qkv_ptr, cos_ptr, sin_ptr, kc_ptr, vc_ptr, slot_ptr, num_q_heads, num_kv_heads,
                           stride_qkv, stride_cos, stride_sin, stride_kcb, stride_kcs, stride_kch,
                           stride_vcb, stride_vcs, stride_vch,
                           BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_HEADS: tl.constexpr,
                           BLOCK_HALF: tl.constexpr):
    """BLOCK_HEADS heads of one qkv row, each as two halves [x1 | x2]:

        heads   0 .. Hq-1        Hq .. Hq+Hkv-1          Hq+Hkv .. Hq+2Hkv-1
                q: rotated       k: rotated, and into     v: into value_cache[slot]
                in place         key_cache[slot]

    The rotation rounds as rotary_kernel does, so q, k and the cache hold the same bits as rotary_kernel
    followed by write_kv_kernel. A row whose slot is -1 (padding) is rotated and writes no cache."""
    row = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_HEADS + tl.arange(0, BLOCK_HEADS)
    half: tl.constexpr = HEAD_DIM // 2
    cols = tl.arange(0, BLOCK_HALF)
    col_mask = (cols < half)[None, :]
    num_rotated = num_q_heads + num_kv_heads
    rotated = heads < num_rotated
    dtype = qkv_ptr.dtype.element_ty
    cos = cos_ptr + row * stride_cos + cols
    sin = sin_ptr + row * stride_sin + cols
    c1 = tl.load(cos, mask=cols < half, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(cos + half, mask=cols < half, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(sin, mask=cols < half, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(sin + half, mask=cols < half, other=0.0).to(tl.float32)[None, :]
    p1 = qkv_ptr + row * stride_qkv + heads[:, None] * HEAD_DIM + cols[None, :]
    in_row = (heads < num_rotated + num_kv_heads)[:, None] & col_mask
    x1 = tl.load(p1, mask=in_row, other=0.0).to(tl.float32)
    x2 = tl.load(p1 + half, mask=in_row, other=0.0).to(tl.float32)
    r1 = _round(x1 * c1, dtype) + _round(-x2 * s1, dtype)
    r2 = _round(x2 * c2, dtype) + _round(x1 * s2, dtype)
    rot_mask = rotated[:, None] & col_mask
    tl.store(p1, r1, mask=rot_mask)
    tl.store(p1 + half, r2, mask=rot_mask)
    slot = tl.load(slot_ptr + row).to(tl.int64)
    if slot >= 0:
        blk = slot // BLOCK_SIZE
        off = slot % BLOCK_SIZE
        k_mask = (rotated & (heads >= num_q_heads))[:, None] & col_mask
        pk = kc_ptr + blk * stride_kcb + off * stride_kcs + (heads - num_q_heads)[:, None] * stride_kch + cols[None, :]
        tl.store(pk, r1, mask=k_mask)
        tl.store(pk + half, r2, mask=k_mask)
        v_mask = in_row & ~rotated[:, None]
        pv = vc_ptr + blk * stride_vcb + off * stride_vcs + (heads - num_rotated)[:, None] * stride_vch + cols[None, :]
        tl.store(pv, x1, mask=v_mask)
        tl.store(pv + half, x2, mask=v_mask)


@triton.jit
def _find_seq(qsl_ptr, q_block, num_seqs, BLOCK_Q: tl.constexpr):
    """The sequence owning global query tile `q_block`. Sequence i's tiles start at qsl[i] // BLOCK_Q + i,
    an upper bound on the tiles before it that needs no prefix sum, and strictly increasing in i."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(qsl_ptr + mid) // BLOCK_Q + mid
        if first <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _dot(a, b, acc, PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr):
    """acc + a @ b in fp32. UPCAST_DOT: the interpreter's tl.dot multiplies bfloat16 bit patterns
    (triton-lang/triton#11584), so there bf16 operands go in as fp32 (their values are unchanged)."""
    if UPCAST_DOT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def unified_attention_kernel(
        q_ptr, kc_ptr, vc_ptr, out_ptr, part_out_ptr, part_lse_ptr, qsl_ptr, seq_lens_ptr, bt_ptr,
        num_seqs, scale_log2,
        stride_qt, stride_qh, stride_qd,
        stride_kb, stride_ks, stride_kh, stride_kd,
        stride_vb, stride_vs, stride_vh, stride_vd,
        stride_ot, stride_oh, stride_od, stride_bt,
        HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, TILE_N: tl.constexpr, SPLIT_KV: tl.constexpr,
        PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr):
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)

    seq = _find_seq(qsl_ptr, q_block, num_seqs, BLOCK_Q)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    local = q_block - (q_start // BLOCK_Q + seq)  # this program's tile within its sequence
    if local * BLOCK_Q >= q_len:  # the grid over-counts tiles (see _find_seq): spare programs leave
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context = seq_len - q_len  # cached tokens before the first query

    # Tile row r is query (local * BLOCK_Q + r // GROUP) and head (kv_head * GROUP + r % GROUP): the GROUP
    # query heads that share this KV head sit in adjacent rows, so every K/V tile is loaded once per group.
    rows = tl.arange(0, BLOCK_M)
    q_idx = local * BLOCK_Q + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (q_idx < q_len)  # BLOCK_M may exceed BLOCK_Q * GROUP (GROUP = 7)
    token = (q_start + q_idx).to(tl.int64)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = offs_d < HEAD_DIM
    q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    q_pos = context + q_idx  # absolute position: the row sees keys 0 .. q_pos

    # KV tiles: the sequence's tiles are cut into num_splits equal runs; this split takes its run,
    # clipped at the last key any row of this query tile may see (later tiles are all masked).
    kv_end = context + tl.minimum((local + 1) * BLOCK_Q, q_len)
    tiles_per_split = tl.cdiv(tl.cdiv(seq_len, TILE_N), num_splits)
    tile_lo = split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, tl.cdiv(kv_end, TILE_N))

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    for t in range(tile_lo, tile_hi):
        offs_n = t * TILE_N + tl.arange(0, TILE_N)
        n_ok = offs_n < kv_end
        # each key looks up its own block, so TILE_N need not match the cache's block size
        blk = tl.load(bt_ptr + seq * stride_bt + offs_n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
        slot = offs_n % BLOCK_SIZE
        k = tl.load(kc_ptr + blk[None, :] * stride_kb + slot[None, :] * stride_ks + kv_head * stride_kh
                    + offs_d[:, None] * stride_kd, mask=d_ok[:, None] & n_ok[None, :], other=0.0)
        s = _dot(q, k, tl.zeros([BLOCK_M, TILE_N], tl.float32), PRECISION, UPCAST_DOT) * scale_log2
        s = tl.where(row_ok[:, None] & (offs_n[None, :] <= q_pos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # a row with nothing visible yet keeps m = -inf; subtracting 0 instead avoids inf - inf = nan
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(vc_ptr + blk[:, None] * stride_vb + slot[:, None] * stride_vs + kv_head * stride_vh
                    + offs_d[None, :] * stride_vd, mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        acc = _dot(p.to(v.dtype), v, acc * alpha[:, None], PRECISION, UPCAST_DOT)
        m_i = m_new

    empty = l_i == 0.0  # padding rows, and rows whose keys all lie in other splits
    o = acc / tl.where(empty, 1.0, l_i)[:, None]
    if SPLIT_KV:
        # fp32 scratch [T, Hq, num_splits, HEAD_DIM_PAD] and lse [T, Hq, num_splits]; an empty segment
        # gets lse = -inf, i.e. weight 0 in the reduce
        row = (token * (tl.num_programs(1) * GROUP) + head) * num_splits + split
        lse = tl.where(empty, float("-inf"), m_i + tl.math.log2(tl.where(empty, 1.0, l_i)))
        tl.store(part_lse_ptr + row, lse, mask=row_ok)
        tl.store(part_out_ptr + row[:, None] * HEAD_DIM_PAD + offs_d[None, :], o, mask=row_ok[:, None])
    else:
        tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :] * stride_od,
                 o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def reduce_splits_kernel(part_out_ptr, part_lse_ptr, out_ptr, num_splits, stride_ot, stride_oh, stride_od,
                         HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr):
    """One program per (token, query head): out = sum_s w_s o_s / sum_s w_s with w_s = 2^(lse_s - max lse)."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    row = (t * tl.num_programs(1) + h) * num_splits
    offs_s = tl.arange(0, SPLITS_PAD)
    s_ok = offs_s < num_splits
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    lse = tl.load(part_lse_ptr + row + offs_s, mask=s_ok, other=float("-inf"))
    m = tl.max(lse, 0)
    w = tl.math.exp2(lse - tl.where(m == float("-inf"), 0.0, m))  # -inf -> weight 0
    o = tl.load(part_out_ptr + (row + offs_s)[:, None] * HEAD_DIM_PAD + offs_d[None, :], mask=s_ok[:, None],
                other=0.0)
    denom = tl.sum(w, 0)
    res = tl.sum(w[:, None] * o, 0) / tl.where(denom == 0.0, 1.0, denom)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + offs_d * stride_od, res.to(out_ptr.dtype.element_ty),
             mask=offs_d < HEAD_DIM)


INTERPRETED = type(unified_attention_kernel).__name__ == "InterpretedFunction"  # TRITON_INTERPRET set at import
