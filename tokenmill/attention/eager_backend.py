"""Unfused eager attention: the baseline rung of the optimization ladder, the way a plain
implementation (Hugging Face's "eager") does it: KV heads repeated for GQA, the full score
matrix materialized, one sequence at a time. Same results as the fused path, more memory traffic."""
from __future__ import annotations

import torch

from tokenmill.attention.backend import AttentionBackend, AttentionBatch
from tokenmill.attention.torch_backend import gather_kv, write_kv


class EagerAttentionBackend(AttentionBackend):
    def forward(self, q, k, v, key_cache, value_cache, meta: AttentionBatch, scale: float):
        write_kv(k, v, key_cache, value_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        qsl, lens = meta.query_start_loc_host, meta.seq_lens_host
        group = q.shape[1] // k.shape[1]
        for i in range(len(lens)):
            s, e, L = qsl[i], qsl[i + 1], lens[i]
            n = e - s
            ki = gather_kv(key_cache, meta.block_tables[i], L).repeat_interleave(group, dim=0)
            vi = gather_kv(value_cache, meta.block_tables[i], L).repeat_interleave(group, dim=0)
            scores = torch.matmul(q[s:e].transpose(0, 1), ki.transpose(1, 2)) * scale  # [Hq, n, L]
            causal = torch.ones(n, L, dtype=torch.bool, device=q.device).tril_(diagonal=L - n)
            scores = scores.masked_fill(~causal, float("-inf"))
            probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
            out[s:e] = torch.matmul(probs, vi).transpose(0, 1)
        return out
