from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU on a merged [gate | up] projection."""
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]
