"""The attention interface: what every backend reads, and the layout of the paged KV cache.

Batch layout for one step (decodes first, then prefill chunks), flat over tokens:

    seqs            A(decode)  B(decode)  C(prefill chunk, 3 new tokens after 5 cached)
    query_start_loc [0,        1,         2,                                    5]
    seq_lens        [ 9,        4,         8]          (cached + new tokens per sequence)
    slot_mapping    [a8,       b3,        c5, c6, c7]  (block_id * block_size + offset; -1 = pad)
    block_tables    int32 [num_seqs, max_blocks]  (rows padded with 0; seq_lens says what is valid)

KV cache per layer: key and value each [num_blocks, block_size, num_kv_heads, head_dim].
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # int64 [num_tokens]
    query_start_loc: torch.Tensor  # int32 [num_seqs + 1]
    seq_lens: torch.Tensor  # int32 [num_seqs]
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks]
    num_decodes: int  # the first num_decodes sequences have exactly one query token
    max_seq_len: int
    # Host copies, so CPU loops never read device tensors.
    query_start_loc_host: list[int]
    seq_lens_host: list[int]
    # Prefill-only rows whose whole context is new (no cached prefix): plain causal attention.
    fresh_prefill: list[bool]
    # per prefill row with a cached prefix: bool [new, seq_len] causal mask offset by the prefix
    prefill_masks: dict[int, torch.Tensor] | None = None
    decode_mask: torch.Tensor | None = None  # float bias [num_decodes, 1, 1, max_len]: 0 or -inf, built once per step


class AttentionBackend:
    """Writes this step's keys/values into the paged cache and attends over cached + new tokens.
    Backends are chosen by name through attention/registry.py."""

    @staticmethod
    def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        """The layout this backend reads, for the key cache and for the value cache of one layer."""
        return (num_blocks, block_size, num_kv_heads, head_dim)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                key_cache: torch.Tensor, value_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D]."""
        raise NotImplementedError

    def build_step_state(self, meta: AttentionMetadata) -> None:
        """Per-step precomputation shared by every layer (e.g. masks)."""
