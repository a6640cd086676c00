"""Pure-torch paged attention: the CPU path and the oracle for GPU kernels."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tokenmill.attention.backend import AttentionBackend, AttentionBatch
from tokenmill.ops import cpu_attention


@dataclass
class TorchAttentionMetadata:
    batch: AttentionBatch
    fresh_prefill: list[bool]  # per row: a prefill whose whole context is new (plain causal attention)
    decode_mask: torch.Tensor | None = None  # float bias [num_decodes, 1, 1, max_len]: 0 or -inf, built once per step


def write_kv(k: torch.Tensor, v: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    nb, bs, h, d = key_cache.shape
    key_cache.view(nb * bs, h, d).index_copy_(0, slot_mapping, k)
    value_cache.view(nb * bs, h, d).index_copy_(0, slot_mapping, v)


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """[max_blocks] block ids -> the first `length` tokens as [Hkv, length, D]."""
    nblocks = -(-length // cache.shape[1])
    g = cache.index_select(0, block_table[:nblocks]).flatten(0, 1)[:length]
    return g.transpose(0, 1)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     mask_bias: torch.Tensor | None = None) -> torch.Tensor:
    """One query per sequence. q [B, Hq, D], k/v [B, Hkv, L, D] -> [B, Hq, D]. Query heads are grouped
    under their KV head and handled by two batched matmuls in float32: on CPU this is several times
    faster than SDPA for single-token queries (its kernels are tuned for long queries), and float32
    avoids the fixed cost of small bfloat16 matmuls while accumulating as a fused kernel would."""
    B, Hq, D = q.shape
    Hkv = k.shape[1]
    qg = q.view(B, Hkv, Hq // Hkv, D).float()
    k, v = k.float(), v.float()
    scores = torch.matmul(qg, k.transpose(-1, -2))  # [B, Hkv, g, L]
    scores *= scale
    if mask_bias is not None:
        scores += mask_bias
    probs = scores.softmax(dim=-1)
    return torch.matmul(probs, v).view(B, Hq, D).to(q.dtype)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                      mask: torch.Tensor | None = None) -> torch.Tensor:
    """q [Hq, n, D], k/v [Hkv, L, D] -> [Hq, n, D]; causal when no mask is given. KV heads are expanded
    to the query heads and the batch dim added because CPU SDPA takes its flash kernel only for 4-D
    inputs without `enable_gqa`; otherwise it falls back to the math path, 3-6x slower for long prompts."""
    k, v = _batched_query_heads(q, k, v)
    return F.scaled_dot_product_attention(q.unsqueeze(0), k, v, attn_mask=mask, is_causal=mask is None,
                                          scale=scale)[0]


def _batched_query_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """k/v [Hkv, L, D] expanded to q's Hq heads with a batch dim, [1, Hq, L, D]: the form CPU flash attention takes."""
    group = q.shape[0] // k.shape[0]
    return k.repeat_interleave(group, 0).unsqueeze(0), v.repeat_interleave(group, 0).unsqueeze(0)


def chunk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """A prefill chunk after a cached prefix: q [Hq, n, D] at positions L - n .. L - 1, k/v [Hkv, L, D].
    On CPU, as two flash calls, the whole prefix unmasked and the chunk's own keys causal, merged by their
    log-sum-exps: CPU flash attention with an explicit mask reads the mask and skips no masked block,
    1.3-1.6x slower than the two calls at 2K-6K tokens (BENCHMARKS.md, "Long contexts on CPU").
    Elsewhere (the oracle on GPUs), one call with the offset causal mask."""
    n, L = q.shape[1], k.shape[1]
    if q.device.type != "cpu":
        mask = torch.ones(n, L, dtype=torch.bool, device=q.device).tril_(diagonal=L - n)
        return prefill_attention(q, k, v, scale, mask)
    q4, (k4, v4) = q.unsqueeze(0), _batched_query_heads(q, k, v)
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    o1, lse1 = flash(q4, k4[:, :, :L - n], v4[:, :, :L - n], scale=scale)[:2]  # [1, Hq, n, D], [1, Hq, n]
    o2, lse2 = flash(q4, k4[:, :, L - n:], v4[:, :, L - n:], is_causal=True, scale=scale)[:2]
    top = torch.maximum(lse1, lse2)
    w1, w2 = (lse1 - top).exp_().unsqueeze(-1), (lse2 - top).exp_().unsqueeze(-1)
    return ((o1.float() * w1 + o2.float() * w2) / (w1 + w2))[0].to(q.dtype)


class TorchAttentionBackend(AttentionBackend):
    """Decodes go through the C paged-attention kernel where it runs (`use_kernel`), else through the
    gather + matmul path below, which is also the kernel's test oracle."""

    def __init__(self, use_kernel: bool | None = None):
        self.use_kernel = use_kernel  # None: decided by the first decode (dtype and head shapes never change)

    def build_metadata(self, batch: AttentionBatch) -> TorchAttentionMetadata:
        nd = batch.num_decodes
        qsl, lens = batch.query_start_loc_host, batch.seq_lens_host
        fresh = [False] * nd + [lens[i] == qsl[i + 1] - qsl[i] for i in range(nd, len(lens))]
        return TorchAttentionMetadata(batch, fresh)

    def forward(self, q, k, v, key_cache, value_cache, meta: TorchAttentionMetadata, scale: float):
        batch = meta.batch
        write_kv(k, v, key_cache, value_cache, batch.slot_mapping)
        nd = batch.num_decodes
        if nd == batch.num_seqs:  # decodes only: no output buffer to assemble
            return self._decode(q, key_cache, value_cache, meta, scale)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if nd:
            out[:nd] = self._decode(q[:nd], key_cache, value_cache, meta, scale)
        qsl, lens = batch.query_start_loc_host, batch.seq_lens_host
        for i in range(nd, len(lens)):
            s, e = qsl[i], qsl[i + 1]
            qi = q[s:e].transpose(0, 1)  # [Hq, n, D]
            if meta.fresh_prefill[i]:
                ki, vi = k[s:e].transpose(0, 1), v[s:e].transpose(0, 1)
                o = prefill_attention(qi, ki, vi, scale)
            else:
                ki = gather_kv(key_cache, batch.block_tables[i], lens[i])
                vi = gather_kv(value_cache, batch.block_tables[i], lens[i])
                o = chunk_attention(qi, ki, vi, scale)  # query j at position L - n + j sees keys <= it
            out[s:e] = o.transpose(0, 1)
        return out

    def _decode(self, q, key_cache, value_cache, meta: TorchAttentionMetadata, scale: float):
        batch = meta.batch
        nd = q.shape[0]
        if self.use_kernel is None:
            self.use_kernel = q.device.type == "cpu" and cpu_attention.supports(q, key_cache)  # no C build on GPUs
        if self.use_kernel:
            # reads the cache in place; 4-17x faster than gathering a padded float32 copy (BENCHMARKS.md)
            return cpu_attention.paged_decode_attention(q, key_cache, value_cache, batch.block_tables[:nd],
                                                        batch.seq_lens[:nd], scale)
        if nd == 1:
            L = batch.seq_lens_host[0]
            kk = gather_kv(key_cache, batch.block_tables[0], L).unsqueeze(0)
            vv = gather_kv(value_cache, batch.block_tables[0], L).unsqueeze(0)
            return decode_attention(q, kk, vv, scale)
        if meta.decode_mask is None:  # built by the first layer, shared by the rest
            lens = batch.seq_lens[:nd]
            max_len = int(max(batch.seq_lens_host[:nd]))
            valid = torch.arange(max_len, device=lens.device) < lens[:, None].to(torch.int64)
            bias = torch.zeros(nd, 1, 1, max_len, dtype=torch.float32, device=lens.device)
            meta.decode_mask = bias.masked_fill_(~valid.view(nd, 1, 1, max_len), float("-inf"))
        bias = meta.decode_mask
        max_len = bias.shape[-1]
        bs = key_cache.shape[1]
        tables = batch.block_tables[:nd, : -(-max_len // bs)]
        # [nd, blocks, bs, Hkv, D] -> [nd, Hkv, L, D]; the padded tail is masked out by the bias
        kk = key_cache[tables].flatten(1, 2)[:, :max_len].transpose(1, 2)
        vv = value_cache[tables].flatten(1, 2)[:, :max_len].transpose(1, 2)
        return decode_attention(q, kk, vv, scale, bias)
