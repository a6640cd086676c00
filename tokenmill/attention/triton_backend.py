"""Triton paged attention: one launch of ops/triton_attention.py's unified kernel serves a whole mixed
step (decodes, verification rows and prefill chunks against their cached prefixes), after one launch that
rotates the q and k heads and writes k and v into the cache (`rotary_write_kv`; two launches, rotary and
`write_kv`, with TOKENMILL_DISABLE_TRITON_ROTARY_KV=1 or TOKENMILL_DISABLE_TRITON_FUSED=1). Its step
metadata is the common batch plus the launch plan, made from host ints only, so a step makes no
host-device sync here.

Where the kernels cannot run (a Triton compile failure, or a CPU without TRITON_INTERPRET=1), the backend
logs one warning and serves from then on through the torch backend, which reads the same cache layout:
a step never fails because of a kernel."""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from tokenmill.attention.backend import AttentionBackend, AttentionBatch, split_heads
from tokenmill.attention.torch_backend import TorchAttentionBackend, TorchAttentionMetadata
from tokenmill.ops import triton_attention as ta
from tokenmill.ops import triton_fused

ROTARY_KV_DISABLE_ENV = "TOKENMILL_DISABLE_TRITON_ROTARY_KV"

logger = logging.getLogger(__name__)


@dataclass
class TritonAttentionMetadata:
    batch: AttentionBatch
    fallback: TorchAttentionMetadata | None = None  # built on first use after a fallback


class TritonAttentionBackend(AttentionBackend):
    @classmethod
    def supports(cls, device: str) -> bool:
        # On CPU the kernels run only under Triton's interpreter (tests); auto never picks them there.
        return ta.available() and (device == "cuda" or os.environ.get("TRITON_INTERPRET") == "1")

    def __init__(self):
        self.fallback: TorchAttentionBackend | None = None
        self.failure: str | None = None  # why the kernels were given up, for logs and tests
        # rotary and the KV write in one launch (read once: the switch is for A/B runs and bisecting)
        self.fuse_rotary_kv = triton_fused.available() and not os.environ.get(ROTARY_KV_DISABLE_ENV)

    @property
    def cuda_graph_safe(self) -> bool:
        return self.fallback is None  # the torch fallback loops over rows on the host

    def build_metadata(self, batch: AttentionBatch) -> TritonAttentionMetadata:
        return TritonAttentionMetadata(batch)

    def forward(self, q, k, v, key_cache, value_cache, meta: TritonAttentionMetadata, scale: float):
        return self._attend(q, k, v, key_cache, value_cache, meta, scale, write_kv=True)

    def forward_qkv(self, qkv, cos, sin, num_heads, num_kv_heads, head_dim, key_cache, value_cache,
                    meta: TritonAttentionMetadata, scale: float):
        if self.fuse_rotary_kv and self.fallback is None:
            try:
                ta.rotary_write_kv(qkv, cos, sin, num_heads, num_kv_heads, key_cache, value_cache,
                                   meta.batch.slot_mapping)
            except Exception as e:  # raised before the kernel ran (checks, compile): qkv is not rotated yet
                self.fuse_rotary_kv = False
                logger.warning("fused rotary + KV write failed (%s: %s); rotary and write_kv run apart from now "
                               "on", type(e).__name__, str(e)[:500])
        if not self.fuse_rotary_kv or self.fallback is not None:
            return super().forward_qkv(qkv, cos, sin, num_heads, num_kv_heads, head_dim, key_cache, value_cache,
                                       meta, scale)
        q, k, v = (split_heads(qkv, first, n, head_dim) for first, n in
                   ((0, num_heads), (num_heads, num_kv_heads), (num_heads + num_kv_heads, num_kv_heads)))
        return self._attend(q, k, v, key_cache, value_cache, meta, scale, write_kv=False)

    def _attend(self, q, k, v, key_cache, value_cache, meta: TritonAttentionMetadata, scale: float,
                write_kv: bool) -> torch.Tensor:
        if self.fallback is None:
            try:
                return self._triton(q, k, v, key_cache, value_cache, meta.batch, scale, write_kv)
            except Exception as e:  # compile errors surface at the first launch of each specialization
                self._give_up(e)
        if meta.fallback is None:
            meta.fallback = self.fallback.build_metadata(meta.batch)
        return self.fallback.forward(q, k, v, key_cache, value_cache, meta.fallback, scale)

    @staticmethod
    def _triton(q, k, v, key_cache, value_cache, batch: AttentionBatch, scale: float, write_kv: bool) -> torch.Tensor:
        if write_kv:
            ta.write_kv(k, v, key_cache, value_cache, batch.slot_mapping)
        return ta.paged_attention(q, key_cache, value_cache, batch.query_start_loc, batch.seq_lens,
                                  batch.block_tables, scale, batch.max_query_len, batch.max_seq_len)

    def _give_up(self, error: Exception) -> None:
        """The fallback redoes the whole layer: writing the same keys into the cache again is harmless."""
        self.failure = f"{type(error).__name__}: {error}"
        logger.warning("Triton attention failed (%s); serving with the torch attention backend from now on",
                       self.failure[:500])
        self.fallback = TorchAttentionBackend()
