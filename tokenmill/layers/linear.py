"""Linear layers whose parameters carry their own weight loaders (nano-vllm's idea): a checkpoint
tensor for q_proj lands in its slice of the merged qkv_proj without the model knowing the layout."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.ops import cpu_gemv


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"shape mismatch: parameter {tuple(param.shape)} vs checkpoint {tuple(loaded.shape)}")
    param.data.copy_(loaded)


def padded_rows(m: int) -> int:
    """The row count oneDNN sees for `m` input rows. It builds, and keeps in two LRU caches of 1024 entries
    (oneDNN's and ideep's), a JIT-compiled primitive per input shape, about 0.5 MB each: with every prefill
    size its own shape, the engine core's memory crept up for thousands of requests. Up to 32 rows (decode
    batches) stay exact; larger counts round up to 8 sizes per power of two (at most 12.5 % padding), so a
    2048-token budget needs at most 80 shapes per weight."""
    if m <= 32:
        return m
    step = 1 << (m.bit_length() - 4)
    return -(-m // step) * step


def onednn_linear_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class Linear(nn.Module):
    """y = x W^T + b. On CPU the weight can be repacked once into oneDNN's blocked layout, whose
    GEMM streams weights much faster than `F.linear` for the few-row matrices of decoding."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.packed: torch.Tensor | None = None
        self.gemv_packed: torch.Tensor | None = None  # batch-1 decode kernel's layout (ops/cpu_gemv.py)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gemv_packed is not None and x.shape[0] == 1:
            return cpu_gemv.gemv(x, self.gemv_packed, self.bias)
        if self.packed is not None:
            m = x.shape[0]
            rows = padded_rows(m) if x.dim() == 2 else m
            if rows != m:
                x = F.pad(x, (0, 0, 0, rows - m))
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")[:m]
        return F.linear(x, self.weight, self.bias)

    def pack_for_cpu(self, with_gemv: bool = False) -> None:
        """Replace the plain weight with a oneDNN-packed copy (done once, after loading), plus, with
        `with_gemv`, a second copy in the batch-1 GEMV kernel's layout. A weight shared with another
        module (tied embeddings) stays alive through that module."""
        if with_gemv and cpu_gemv.supports(self.weight):
            self.gemv_packed = cpu_gemv.pack(self.weight)
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), 1)
        self.weight = None


class MergedLinear(Linear):
    """Several projections of the same input stacked along the output dim, e.g. [q | k | v]."""

    def __init__(self, in_features: int, shards: dict[str, int], bias: bool = False):
        super().__init__(in_features, sum(shards.values()), bias)
        self.offsets, off = {}, 0
        for name, size in shards.items():
            self.offsets[name] = (off, size)
            off += size
        self.weight.weight_loader = self._load_shard
        if self.bias is not None:
            self.bias.weight_loader = self._load_shard

    def _load_shard(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: str) -> None:
        off, size = self.offsets[shard_id]
        default_weight_loader(param.data.narrow(0, off, size), loaded)
