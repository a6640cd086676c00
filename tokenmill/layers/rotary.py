"""Rotary position embedding (neox / rotate-half layout, as Hugging Face Llama), with Llama-3 and
linear scaling. The cos/sin table is built once; each step gathers rows by position once for all layers."""
from __future__ import annotations

import math

import torch
from torch import nn

from tokenmill.ops import cpu_fused, triton_fused


def inv_frequencies(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if not scaling:
        return inv
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return inv / scaling["factor"]
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: default, linear, llama3)")


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None, dtype):
        super().__init__()
        inv = inv_frequencies(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos().to(dtype), persistent=False)
        self.register_buffer("sin", emb.sin().to(dtype), persistent=False)

    def cos_sin(self, positions: torch.Tensor):
        """[T] positions -> cos, sin each [T, D] (once per step, for all layers)."""
        return self.cos[positions], self.sin[positions]


def rotate_heads(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int,
                 head_dim: int) -> torch.Tensor:
    """The first `num_heads` heads of each [T, heads * head_dim] row, rotated: [T, num_heads, head_dim].
    The fused CPU and GPU kernels rotate them in place in one call; the twin builds a new tensor."""
    if head_dim % 2 == 0 and triton_fused.usable(qkv, cos, sin):
        try:
            triton_fused.rotary_(qkv, cos, sin, num_heads, head_dim)
            return qkv[:, :num_heads * head_dim].view(-1, num_heads, head_dim)
        except Exception as e:  # raised before the kernel ran: qkv not rotated yet
            triton_fused.give_up(e)
    if head_dim % 32 == 0 and cpu_fused.usable(qkv, cos, sin):
        cpu_fused.rotary_(qkv, cos, sin, num_heads, head_dim)
        return qkv[:, :num_heads * head_dim].view(-1, num_heads, head_dim)
    return apply_rotary(qkv[:, :num_heads * head_dim].view(-1, num_heads, head_dim), cos, sin)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D], cos/sin [T, D]."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    d = x.shape[-1] // 2
    rotated = torch.cat((-x[..., d:], x[..., :d]), dim=-1)
    return x * cos + rotated * sin
