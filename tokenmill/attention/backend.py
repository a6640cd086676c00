"""The attention interface: one common description of a step's batch, and the backends that read it.

Batch layout for one step (decodes first, then prefill chunks), flat over tokens:

    seqs            A(decode)  B(decode)  C(prefill chunk, 3 new tokens after 5 cached)
    query_start_loc [0,        1,         2,                                    5]
    seq_lens        [ 9,        4,         8]          (cached + new tokens per sequence)
    slot_mapping    [a8,       b3,        c5, c6, c7]  (block_id * block_size + offset; -1 = pad)
    block_tables    int32 [num_seqs, max_blocks]  (rows padded with 0; seq_lens says what is valid)

Query j of a row with n new tokens sits at position seq_len - n + j and sees keys 0 .. seq_len - n + j.

The model runner builds one `AttentionBatch` per step; each backend turns it into its own step metadata
(`build_metadata`: masks, split plans, graph buffers, ...) which only that backend reads. The model code
passes that metadata through to `forward` without looking inside, so a backend never writes into shared
state and a new backend (FlashAttention, FlashInfer wheels) plugs in without touching the runner.

A layer hands its backend the qkv projection whole (`forward_qkv`): the backend rotates the q and k heads,
writes k and v into the cache and attends. The default does the first two as layers/rotary.py and then
`forward`; a backend may fuse them into its cache write (the Triton backend does).

KV cache per layer: key and value each `kv_cache_shape(...)`; today every backend uses
[num_blocks, block_size, num_kv_heads, head_dim], which lets the Triton backend fall back to torch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.layers.rotary import rotate_heads


@dataclass
class AttentionBatch:
    slot_mapping: torch.Tensor  # int64 [num_tokens]
    query_start_loc: torch.Tensor  # int32 [num_seqs + 1]
    seq_lens: torch.Tensor  # int32 [num_seqs]
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks]
    num_decodes: int  # the first num_decodes sequences have exactly one query token
    max_seq_len: int
    max_query_len: int
    # Host copies, so host code (launch sizes, CPU loops) never reads device tensors.
    query_start_loc_host: list[int]
    seq_lens_host: list[int]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)


class AttentionBackend:
    """Writes this step's keys/values into the paged cache and attends over cached + new tokens.
    Backends are chosen by name through attention/registry.py."""

    # True when forward reads only device tensors and the batch's max_* ints (no host loops over rows):
    # then a decode step can be captured in a CUDA graph (worker/cuda_graphs.py)
    cuda_graph_safe = False

    @classmethod
    def supports(cls, device: str) -> bool:
        """Whether this backend can run on `device` here ("auto" picks the first that can)."""
        return True

    @staticmethod
    def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        """The layout this backend reads, for the key cache and for the value cache of one layer."""
        return (num_blocks, block_size, num_kv_heads, head_dim)

    def build_metadata(self, batch: AttentionBatch):
        """This backend's step metadata, built once per step and shared by every layer."""
        return batch

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                key_cache: torch.Tensor, value_cache: torch.Tensor, meta, scale: float) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D]; `meta` is what build_metadata returned."""
        raise NotImplementedError

    def forward_qkv(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int,
                    num_kv_heads: int, head_dim: int, key_cache: torch.Tensor, value_cache: torch.Tensor, meta,
                    scale: float) -> torch.Tensor:
        """qkv [T, (Hq + 2 Hkv) * D] as the projection made it, cos/sin [T, D] -> [T, Hq, D]: rotary on
        the q and k heads, k/v into the cache, attention."""
        qk = rotate_heads(qkv, cos, sin, num_heads + num_kv_heads, head_dim)
        v = split_heads(qkv, num_heads + num_kv_heads, num_kv_heads, head_dim)
        return self.forward(qk[:, :num_heads], qk[:, num_heads:], v, key_cache, value_cache, meta, scale)


def split_heads(qkv: torch.Tensor, first: int, count: int, head_dim: int) -> torch.Tensor:
    """Heads first .. first + count - 1 of each qkv row, as a [T, count, head_dim] view."""
    return qkv[:, first * head_dim:(first + count) * head_dim].view(-1, count, head_dim)
