"""Paged decode attention as one C kernel call per layer (see cpu_attention.c): it reads the KV cache in
place through the block tables, where the torch path gathers every sequence's blocks into a padded copy,
converts it to float32 and masks the padding. The torch path (`attention/torch_backend.decode_attention`)
is its twin and test oracle, and serves wherever the kernel is unavailable."""
from __future__ import annotations

import ctypes
from functools import lru_cache

import torch

from tokenmill.ops import native

MAX_D, MAX_GROUP_FLOATS, CHUNK = 256, 4096, 512  # as in cpu_attention.c


@lru_cache(maxsize=1)
def _kernel():
    lib = native.load("cpu_attention.c", "TOKENMILL_DISABLE_CPU_ATTENTION")
    if lib is None:
        return None
    fn = lib.tm_paged_decode_attention
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64] + [ctypes.c_void_p] * 3 + [ctypes.c_int64, ctypes.c_void_p,
                                                                              ctypes.c_void_p] + \
        [ctypes.c_int64] * 5 + [ctypes.c_float, ctypes.c_int, ctypes.c_int]
    fn.restype = None
    return fn


def available() -> bool:
    return _kernel() is not None


def supports(q: torch.Tensor, key_cache: torch.Tensor) -> bool:
    """q [B, Hq, D], key_cache [num_blocks, block_size, Hkv, D]."""
    hq, d = q.shape[1], q.shape[2]
    hkv = key_cache.shape[2]
    return (available() and q.device.type == "cpu" and q.dtype == key_cache.dtype
            and q.dtype in (torch.bfloat16, torch.float32) and d % 16 == 0 and d <= MAX_D
            and hq % hkv == 0 and (hq // hkv) * d <= MAX_GROUP_FLOATS)


def paged_decode_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, Hq, D]; caches [num_blocks, block_size, Hkv, D]; block_tables int32 [B, max_blocks];
    seq_lens int32 [B] -> [B, Hq, D]."""
    B, hq, d = q.shape
    nb, bs, hkv, _ = key_cache.shape
    if q.stride(2) != 1 or q.stride(1) != d:  # rows may be strided (q sliced out of a fused qkv), heads not
        q = q.contiguous()
    tables = block_tables.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    assert key_cache.is_contiguous() and value_cache.is_contiguous() and tables.shape[0] >= B
    out = torch.empty(B, hq, d, dtype=q.dtype)
    _kernel()(q.data_ptr(), q.stride(0), key_cache.data_ptr(), value_cache.data_ptr(), tables.data_ptr(), tables.stride(0),
              lens.data_ptr(), out.data_ptr(), B, hq, hkv, d, bs, float(scale), int(q.dtype == torch.bfloat16),
              torch.get_num_threads())
    return out
