"""Paged attention and the KV-cache write for the GPU path, as Triton kernels with pure-torch twins.

    write_kv(k, v, key_cache, value_cache, slot_mapping)        k/v [T, Hkv, D] into their slots (-1: none)
    rotary_write_kv(qkv, cos, sin, num_q_heads, num_kv_heads, key_cache, value_cache, slot_mapping)
                                  rotary on qkv's q and k heads in place, then k/v into their slots: one launch
    paged_attention(q, key_cache, value_cache, query_start_loc, seq_lens, block_tables, scale,
                    max_query_len, max_seq_len, out=None, num_kv_splits=None)   -> [T, Hq, D]

Layouts are the engine's (attention/backend.py): q [T, Hq, D] flat over the step's tokens, caches
[num_blocks, block_size, Hkv, D], query_start_loc int32 [S+1], seq_lens int32 [S] (cached + new),
block_tables int32 [S, max_blocks]. Sequence i's n_i queries are the last n_i of its seq_lens[i]
positions, so query j sees keys 0 .. seq_len - n_i + j (causal against its cached prefix); its keys
and values are already in the cache (write_kv runs first). Decodes are sequences with n_i = 1.

One launch serves the whole mixed step ("unified attention", as vLLM's triton_unified_attention):

    grid axis 0: query tiles of all sequences,   T // BLOCK_Q + S of them (an upper bound, no prefix sum)
    grid axis 1: KV heads                        Hkv
    grid axis 2: KV splits                       num_kv_splits (1 unless split-KV)

      query_start_loc  0   1   2             7   8           (BLOCK_Q = 4: A, B decodes, C 5 new, D 1)
      tokens           A | B | C C C C C     | D |
      axis 0 program   0   1   2       3       4   5         grid: 8 // 4 + 4 = 6 programs; seq i's tiles
      owner            A   B   C       C       D   D         start at qsl[i] // BLOCK_Q + i (D: 7 // 4 + 3);
      tile in seq      0   0   0       1       0   1*        a program binary-searches query_start_loc for
                                                             its sequence; * = past the end: it returns
      axis 1: program (x, h) loads K/V of head h once for its BLOCK_Q queries x GROUP query heads
      axis 2: program (x, h, s) walks KV tiles [s * per_split, (s + 1) * per_split) of its sequence,
              clipped to the tile's causal limit; partial out + log-sum-exp go to fp32 scratch and
              reduce_splits_kernel merges them (empty segments have lse = -inf, weight 0)

Each program keeps an online softmax in fp32 over its KV tiles; a tile row is (query, head), BLOCK_M =
BLOCK_Q * GROUP rounded up to a power of two >= 16 (tl.dot's minimum), rows past BLOCK_Q * GROUP are
masked. Head dims that are not powers of two are padded with masks. No host-device syncs: the grid and
constexprs come from shapes and the host ints max_query_len / max_seq_len (which only steer tile sizes
and the split count; results never depend on them). The block sizes are first guesses, to be tuned on a GPU.

The pure-torch twins `write_kv_ref` / `paged_attention_ref` (per sequence, float32 math) are the oracle
and the CPU fallback. On CPU the kernels run only under Triton's interpreter (TRITON_INTERPRET=1, set
before this module's kernels are first used); there bf16 tile products go in as fp32 (UPCAST_DOT, see
triton_quant.py for why).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch

from tokenmill.ops import triton_lazy as triton  # cdiv, next_power_of_2; triton loads with the kernels

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)
NOMINAL_SMS = 132  # H100 / H200: what the split choice aims to fill when no GPU is there to ask
TILE_N = 32  # keys per KV tile (any block size works: each key looks up its own block)
MAX_BLOCK_M = 64
MIN_TILES_PER_SPLIT = 4  # a split below 128 keys costs more in scratch traffic than it saves
MAX_KV_SPLITS = 64
MAX_SCRATCH_FLOATS = 1 << 24  # 64 MB of fp32 partial outputs at most, whatever the batch


def available() -> bool:
    """True when triton is importable (on CPU the kernels then still need TRITON_INTERPRET=1)."""
    return triton.installed()


@lru_cache(maxsize=1)
def _kernels():
    from tokenmill.ops import triton_attention_kernels
    return triton_attention_kernels


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ---------------------------------------------------------------- pure-torch twins (the oracle)

def write_kv_ref(k: torch.Tensor, v: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    """key_cache[slot // block_size, slot % block_size] = k (same for v), for every row whose slot is >= 0."""
    block_size = key_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    key_cache[slots // block_size, slots % block_size] = k[keep]
    value_cache[slots // block_size, slots % block_size] = v[keep]


def rotary_write_kv_ref(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_q_heads: int,
                        num_kv_heads: int, key_cache: torch.Tensor, value_cache: torch.Tensor,
                        slot_mapping: torch.Tensor) -> None:
    """The twin of rotary_write_kv: layers/rotary.py's torch rotation of the q and k heads, written back into
    qkv, then write_kv_ref of the k and v heads."""
    from tokenmill.layers.rotary import apply_rotary
    head_dim = key_cache.shape[3]
    rotated = (num_q_heads + num_kv_heads) * head_dim
    qk = qkv[:, :rotated].view(-1, num_q_heads + num_kv_heads, head_dim)
    qk.copy_(apply_rotary(qk, cos, sin))
    kv = qkv[:, num_q_heads * head_dim:rotated + num_kv_heads * head_dim].view(-1, 2, num_kv_heads, head_dim)
    write_kv_ref(kv[:, 0], kv[:, 1], key_cache, value_cache, slot_mapping)


def _attention_ref(q, key_cache, value_cache, query_start_loc, seq_lens, block_tables, scale, *,
                   causal: bool = True, causal_shift: int = 0, interleaved_heads: bool = False) -> torch.Tensor:
    """paged_attention_ref with switches that the tests use to build wrong twins ("mutants"): no causal
    mask, every query one position earlier (causal_shift=-1), query head h on KV head h % Hkv."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    heads = torch.arange(num_heads, device=q.device)
    kv_of_head = heads % num_kv_heads if interleaved_heads else heads // group
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    for i, seq_len in enumerate(lens):
        n = starts[i + 1] - starts[i]
        if n == 0:
            continue
        blocks = block_tables[i, :_cdiv(seq_len, block_size)].long()
        keys = key_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len].float()[:, kv_of_head]
        values = value_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len].float()[:, kv_of_head]
        queries = q[starts[i]:starts[i + 1]].float()
        scores = torch.einsum("nhd,lhd->hnl", queries, keys) * scale
        if causal:
            last_key = torch.arange(seq_len - n, seq_len, device=q.device) + causal_shift  # per query
            hidden = torch.arange(seq_len, device=q.device)[None, :] > last_key[:, None]
            scores = scores.masked_fill(hidden, float("-inf"))
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a row that sees no key (mutants only): 0
        out[starts[i]:starts[i + 1]] = torch.einsum("hnl,lhd->nhd", probs, values)
    return out.to(q.dtype)


def paged_attention_ref(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                        query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                        scale: float) -> torch.Tensor:
    """The oracle: per sequence, gather its keys/values through its block table, causal softmax in fp32."""
    return _attention_ref(q, key_cache, value_cache, query_start_loc, seq_lens, block_tables, scale)


# ---------------------------------------------------------------- launch planning (host ints only)

@dataclass(frozen=True)
class _Plan:
    block_m: int  # tile rows: BLOCK_Q queries x GROUP heads, padded to a power of two >= 16
    block_q: int
    tile_n: int
    head_dim_pad: int
    num_splits: int
    num_warps: int

    def grid(self, num_tokens: int, num_seqs: int, num_kv_heads: int) -> tuple[int, int, int]:
        return (num_tokens // self.block_q + num_seqs, num_kv_heads, self.num_splits)

    def constexprs(self, head_dim: int, group: int, block_size: int, dtype: torch.dtype, interpreted: bool) -> dict:
        return dict(HEAD_DIM=head_dim, HEAD_DIM_PAD=self.head_dim_pad, GROUP=group, BLOCK_SIZE=block_size,
                    BLOCK_M=self.block_m, BLOCK_Q=self.block_q, TILE_N=self.tile_n,
                    SPLIT_KV=self.num_splits > 1,
                    PRECISION="ieee" if dtype == torch.float32 else None,  # None: the target's default
                    UPCAST_DOT=interpreted and dtype == torch.bfloat16)


@lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return NOMINAL_SMS  # interpreter: plan as for the GPU we tune for
    return torch.cuda.get_device_properties(device).multi_processor_count


def _plan(num_tokens: int, num_seqs: int, num_kv_heads: int, group: int, head_dim: int, max_query_len: int,
          max_seq_len: int, num_sms: int, num_kv_splits: int | None = None) -> _Plan:
    head_dim_pad = max(16, _next_pow2(head_dim))
    # decode-only steps use the smallest tile that holds a group; prefill chunks grow it up to 64 rows
    # (32 at head dim 256, to bound the fp32 accumulator's registers)
    cap = MAX_BLOCK_M if head_dim_pad <= 128 else MAX_BLOCK_M // 2
    block_m = max(16, _next_pow2(group), min(cap, _next_pow2(max(1, max_query_len) * group)))
    block_q = block_m // group
    if num_kv_splits is None:
        num_kv_splits = _auto_splits(num_tokens, num_seqs, num_kv_heads, group, block_q, head_dim_pad,
                                     max_seq_len, num_sms)
    elif num_kv_splits < 1:
        raise ValueError(f"num_kv_splits must be >= 1 or None, got {num_kv_splits}")
    num_warps = 8 if block_m * head_dim_pad >= 64 * 128 else 4
    return _Plan(block_m, block_q, TILE_N, head_dim_pad, num_kv_splits, num_warps)


def _auto_splits(num_tokens: int, num_seqs: int, num_kv_heads: int, group: int, block_q: int, head_dim_pad: int,
                 max_seq_len: int, num_sms: int) -> int:
    """Split the KV range when the busy programs (query tiles x KV heads) fill less than one wave of SMs:
    enough splits for about one wave, each of at least MIN_TILES_PER_SPLIT tiles of the longest sequence,
    a power of two (fewer distinct launches), and a bounded fp32 scratch."""
    busy = max(num_seqs, _cdiv(num_tokens, block_q)) * num_kv_heads
    if busy >= num_sms:
        return 1
    wanted = min(_cdiv(num_sms, busy), _cdiv(max_seq_len, TILE_N) // MIN_TILES_PER_SPLIT, MAX_KV_SPLITS,
                 MAX_SCRATCH_FLOATS // max(1, num_tokens * num_kv_heads * group * head_dim_pad))
    return 1 << (max(1, wanted).bit_length() - 1)


# ---------------------------------------------------------------- public kernels

def _check_caches(key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    if key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise ValueError("key_cache and value_cache must both be [num_blocks, block_size, num_kv_heads, head_dim], "
                         f"got {tuple(key_cache.shape)} and {tuple(value_cache.shape)}")
    if key_cache.dtype not in DTYPES or value_cache.dtype != key_cache.dtype:
        raise TypeError(f"caches must share one dtype of {DTYPES}, got {key_cache.dtype} and {value_cache.dtype}")


def _check_index(name: str, t: torch.Tensor, dim: int, dtypes: tuple = INDEX_DTYPES) -> None:
    if t.dim() != dim:
        raise ValueError(f"{name} must have {dim} dimension(s), got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name} must be one of {dtypes}, got {t.dtype}")


def write_kv(k: torch.Tensor, v: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Writes k/v [T, Hkv, D] into key/value_cache [num_blocks, block_size, Hkv, D] at slot_mapping [T]
    (block_id * block_size + offset); rows with slot -1 write nothing. Slots must be distinct."""
    _check_caches(key_cache, value_cache)
    if k.dim() != 3 or k.shape != v.shape or tuple(k.shape[1:]) != tuple(key_cache.shape[2:]):
        raise ValueError(f"k and v must be [T, {key_cache.shape[2]}, {key_cache.shape[3]}] like the cache's heads, "
                         f"got {tuple(k.shape)} and {tuple(v.shape)}")
    if k.dtype != key_cache.dtype or v.dtype != key_cache.dtype:
        raise TypeError(f"k/v ({k.dtype}, {v.dtype}) must have the cache's dtype {key_cache.dtype}")
    _check_index("slot_mapping", slot_mapping, 1)
    if slot_mapping.shape[0] != k.shape[0]:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} rows, k has {k.shape[0]}")
    if any(t.device != k.device for t in (v, key_cache, value_cache, slot_mapping)):
        raise ValueError("k, v, the caches and slot_mapping must be on one device")
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    head_dim_pad = _next_pow2(head_dim)
    head_block = min(_next_pow2(num_kv_heads), max(1, 4096 // head_dim_pad))  # <= 4096 elements a program
    _kernels().write_kv_kernel[(num_tokens, _cdiv(num_kv_heads, head_block))](
        k, v, key_cache, value_cache, slot_mapping, num_kv_heads, *k.stride(), *v.stride(),
        *key_cache.stride(), *value_cache.stride(),
        BLOCK_SIZE=key_cache.shape[1], HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, HEAD_BLOCK=head_block)


def rotary_write_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_q_heads: int, num_kv_heads: int,
                    key_cache: torch.Tensor, value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """What `triton_fused.rotary_(qkv, cos, sin, num_q_heads + num_kv_heads, D)` and then `write_kv` of the
    k and v heads do, bit for bit, in one launch. qkv [T, >= (Hq + 2 Hkv) * D] holds each row's heads in the
    order q, k, v (a strided view of wider rows is fine); cos/sin [T, D] in qkv's dtype; the caches as
    write_kv's, in qkv's dtype. Rows with slot -1 are rotated and write nothing. Raises before any launch on
    bad input, so a caller that catches the error finds qkv and the caches untouched."""
    from tokenmill.ops.triton_fused import _check_rows, rotary_launch
    _check_caches(key_cache, value_cache)
    head_dim, num_heads = key_cache.shape[3], num_q_heads + 2 * num_kv_heads
    _check_rows("qkv", qkv, qkv.device)
    num_tokens, width = qkv.shape
    if head_dim % 2 or key_cache.shape[2] != num_kv_heads or num_q_heads < 1 or num_heads * head_dim > width:
        raise ValueError(f"{num_q_heads} q + 2 x {num_kv_heads} kv heads of the cache's even head_dim {head_dim} "
                         f"must fit in qkv rows of {width}, and the cache must hold {num_kv_heads} heads "
                         f"(cache {tuple(key_cache.shape)})")
    for name, table in (("cos", cos), ("sin", sin)):
        _check_rows(name, table, qkv.device)
        if tuple(table.shape) != (num_tokens, head_dim) or table.dtype != qkv.dtype:
            raise ValueError(f"{name} must be [{num_tokens}, {head_dim}] in {qkv.dtype}, "
                             f"got {tuple(table.shape)}, {table.dtype}")
    if key_cache.dtype != qkv.dtype:
        raise TypeError(f"qkv ({qkv.dtype}) and the caches ({key_cache.dtype}) must share a dtype")
    if key_cache.stride(3) != 1 or value_cache.stride(3) != 1:
        raise ValueError("the caches need a contiguous head dimension")
    _check_index("slot_mapping", slot_mapping, 1)
    if slot_mapping.shape[0] != num_tokens:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} rows, qkv has {num_tokens}")
    if any(t.device != qkv.device for t in (key_cache, value_cache, slot_mapping)):
        raise ValueError("qkv, the caches and slot_mapping must be on one device")
    if num_tokens == 0:
        return
    head_blocks, params = rotary_launch(num_heads, head_dim)
    kc, vc = key_cache.stride(), value_cache.stride()
    _kernels().rotary_write_kv_kernel[(num_tokens, head_blocks)](
        qkv, cos, sin, key_cache, value_cache, slot_mapping, num_q_heads, num_kv_heads, qkv.stride(0),
        cos.stride(0), sin.stride(0), kc[0], kc[1], kc[2], vc[0], vc[1], vc[2],
        BLOCK_SIZE=key_cache.shape[1], HEAD_DIM=head_dim, **params)


def _check_attention(q, key_cache, value_cache, query_start_loc, seq_lens, block_tables, out) -> None:
    if q.dim() != 3:
        raise ValueError(f"q must be [T, num_heads, head_dim], got shape {tuple(q.shape)}")
    _check_caches(key_cache, value_cache)
    if q.dtype != key_cache.dtype:
        raise TypeError(f"q ({q.dtype}) and the caches ({key_cache.dtype}) must share a dtype")
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = key_cache.shape[2]
    if key_cache.shape[3] != head_dim:
        raise ValueError(f"q's head dim {head_dim} differs from the cache's {key_cache.shape[3]}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if not 1 <= head_dim <= 256:
        raise ValueError(f"head_dim must be in 1..256, got {head_dim}")
    _check_index("query_start_loc", query_start_loc, 1)
    _check_index("seq_lens", seq_lens, 1)
    _check_index("block_tables", block_tables, 2)
    num_seqs = seq_lens.shape[0]
    if query_start_loc.shape[0] != num_seqs + 1 or block_tables.shape[0] != num_seqs:
        raise ValueError(f"query_start_loc must have num_seqs + 1 = {num_seqs + 1} entries and block_tables "
                         f"num_seqs rows, got {query_start_loc.shape[0]} and {block_tables.shape[0]}")
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype):
        raise ValueError(f"out must be {tuple(q.shape)} {q.dtype}, got {tuple(out.shape)} {out.dtype}")
    tensors = (key_cache, value_cache, query_start_loc, seq_lens, block_tables) + (() if out is None else (out,))
    if any(t.device != q.device for t in tensors):
        raise ValueError(f"every tensor must be on q's device ({q.device})")


def paged_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                    scale: float, max_query_len: int, max_seq_len: int, out: torch.Tensor | None = None,
                    num_kv_splits: int | None = None) -> torch.Tensor:
    """Causal paged attention for a mixed step -> [T, Hq, D] in q's dtype (into `out` when given).
    max_query_len / max_seq_len are host-side bounds that choose tile sizes and the KV split count
    (num_kv_splits forces one). Rows past query_start_loc[-1] (padding) hold unspecified values."""
    _check_attention(q, key_cache, value_cache, query_start_loc, seq_lens, block_tables, out)
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group, num_seqs = num_heads // num_kv_heads, seq_lens.shape[0]
    if out is None:
        out = torch.empty_like(q)
    if num_tokens == 0 or num_seqs == 0:
        return out
    plan = _plan(num_tokens, num_seqs, num_kv_heads, group, head_dim, max_query_len, max_seq_len,
                 _sm_count(q.device), num_kv_splits)
    kernels = _kernels()
    if plan.num_splits > 1:
        part_out = torch.empty(num_tokens, num_heads, plan.num_splits, plan.head_dim_pad, device=q.device,
                               dtype=torch.float32)
        part_lse = torch.empty(num_tokens, num_heads, plan.num_splits, device=q.device, dtype=torch.float32)
    else:
        part_out = part_lse = out  # unused
    kernels.unified_attention_kernel[plan.grid(num_tokens, num_seqs, num_kv_heads)](
        q, key_cache, value_cache, out, part_out, part_lse, query_start_loc, seq_lens, block_tables,
        num_seqs, float(scale) * math.log2(math.e), *q.stride(), *key_cache.stride(), *value_cache.stride(),
        *out.stride(), block_tables.stride(0), num_warps=plan.num_warps,
        **plan.constexprs(head_dim, group, block_size, q.dtype, kernels.INTERPRETED))
    if plan.num_splits > 1:
        kernels.reduce_splits_kernel[(num_tokens, num_heads)](
            part_out, part_lse, out, plan.num_splits, *out.stride(), HEAD_DIM=head_dim,
            HEAD_DIM_PAD=plan.head_dim_pad, SPLITS_PAD=max(2, _next_pow2(plan.num_splits)))
    return out
