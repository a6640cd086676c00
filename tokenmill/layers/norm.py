from __future__ import annotations

import torch
from torch import nn

from tokenmill.ops import cpu_fused, triton_fused


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 (as Hugging Face does), with an optional fused residual add:
    norm(x + residual) returns (normed, x + residual) so the caller keeps the new residual."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if x.dim() == 2 and triton_fused.usable(x, self.weight, *(() if residual is None else (residual,))):
            try:
                out = triton_fused.add_rmsnorm(x, residual, self.weight, self.eps)  # residual updated in place
                return out if residual is None else (out, residual)
            except Exception as e:  # raised before the kernel ran: residual untouched
                triton_fused.give_up(e)
        if x.dim() == 2 and cpu_fused.usable(x, self.weight, *(() if residual is None else (residual,))):
            out = cpu_fused.add_rmsnorm(x, residual, self.weight, self.eps)  # residual updated in place
            return out if residual is None else (out, residual)
        if residual is not None:
            x = x + residual
            residual = x
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * h.to(dtype)
        return out if residual is None else (out, residual)
