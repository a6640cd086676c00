from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenmill.ops import cpu_fused, triton_fused


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU on a merged [gate | up] projection."""
    if x.dim() == 2 and x.shape[-1] % 2 == 0 and triton_fused.usable(x):
        try:
            return triton_fused.silu_mul(x)
        except Exception as e:
            triton_fused.give_up(e)
    if x.dim() == 2 and cpu_fused.usable(x, multiple=32):  # each half a multiple of 16
        return cpu_fused.silu_mul(x)
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]
