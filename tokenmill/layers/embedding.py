"""Token embedding, split over tensor-parallel ranks by vocabulary rows.

    vocab V, tp 2:   rank 0 holds rows [0, V/2)   rank 1 holds rows [V/2, V)
    each rank looks up the ids in its range (zeros elsewhere); one all-reduce sums them into the full rows.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.distributed.comm import SINGLE, TensorParallel
from tokenmill.layers.linear import default_weight_loader


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel = SINGLE):
        super().__init__()
        if vocab_size % tp.size:
            raise ValueError(f"a vocabulary of {vocab_size} tokens does not split over {tp.size} ranks")
        self.tp = tp
        self.num_local = vocab_size // tp.size
        self.start = tp.rank * self.num_local
        self.weight = nn.Parameter(torch.empty(self.num_local, hidden_size), requires_grad=False)
        self.weight.output_dim, self.weight.pack_factor = 0, 1  # rows run over the vocabulary (tied LM head)
        self.weight.weight_loader = self._load

    def _load(self, param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
        whole = (self.num_local * self.tp.size, param.shape[1])
        if tuple(loaded.shape) != whole:  # (before the narrow: more rows than the vocabulary would be cut silently)
            raise ValueError(f"shape mismatch: embedding {whole} (vocab_size, hidden_size) vs checkpoint "
                             f"{tuple(loaded.shape)}")
        default_weight_loader(param, loaded.narrow(0, self.start, self.num_local))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.num_local)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        x.masked_fill_(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(x)
