"""Triton paged attention: one launch of ops/triton_attention.py's unified kernel serves a whole mixed
step (decodes, verification rows and prefill chunks against their cached prefixes), after one KV-write
launch. Its step metadata is the common batch plus the launch plan, made from host ints only, so a step
makes no host-device sync here.

Where the kernels cannot run (a Triton compile failure, or a CPU without TRITON_INTERPRET=1), the backend
logs one warning and serves from then on through the torch backend, which reads the same cache layout:
a step never fails because of a kernel."""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from tokenmill.attention.backend import AttentionBackend, AttentionBatch
from tokenmill.attention.torch_backend import TorchAttentionBackend, TorchAttentionMetadata
from tokenmill.ops import triton_attention as ta

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

    @property
    def cuda_graph_safe(self) -> bool:
        return self.fallback is None  # the torch fallback loops over rows on the host

    def build_metadata(self, batch: AttentionBatch) -> TritonAttentionMetadata:
        return TritonAttentionMetadata(batch)

    def forward(self, q, k, v, key_cache, value_cache, meta: TritonAttentionMetadata, scale: float):
        if self.fallback is None:
            try:
                return self._triton(q, k, v, key_cache, value_cache, meta.batch, scale)
            except Exception as e:  # compile errors surface at the first launch of each specialization
                self._give_up(e)
        if meta.fallback is None:
            meta.fallback = self.fallback.build_metadata(meta.batch)
        return self.fallback.forward(q, k, v, key_cache, value_cache, meta.fallback, scale)

    @staticmethod
    def _triton(q, k, v, key_cache, value_cache, batch: AttentionBatch, scale: float) -> torch.Tensor:
        ta.write_kv(k, v, key_cache, value_cache, batch.slot_mapping)
        return ta.paged_attention(q, key_cache, value_cache, batch.query_start_loc, batch.seq_lens,
                                  batch.block_tables, scale, batch.max_query_len, batch.max_seq_len)

    def _give_up(self, error: Exception) -> None:
        """The fallback redoes the whole layer: writing the same keys into the cache again is harmless."""
        self.failure = f"{type(error).__name__}: {error}"
        logger.warning("Triton attention failed (%s); serving with the torch attention backend from now on",
                       self.failure[:500])
        self.fallback = TorchAttentionBackend()
