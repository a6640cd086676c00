"""CLIP vision tower (LLaVA's image encoder): patch embedding + a pre-norm transformer with full attention.

    pixels [N, 3, H, W] -> conv patches [N, P, D] -> [CLS | patches] + positions -> pre_layrnorm
        -> layers 1 .. L (only as many as the feature layer needs) -> hidden states of the feature layer(s)

No KV cache: every image is encoded whole, in one batch. The linears go through the linear-method seam, so
`mm_encoder_quantization` runs them in int8 with the same methods as the language model.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.layers.linear import Linear, MergedLinear
from tokenmill.quantization.config import QuantizationConfig

_ACTS = {
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def activation(name: str):
    if name not in _ACTS:
        raise ValueError(f"activation {name!r} is not supported; supported: {', '.join(_ACTS)}")
    return _ACTS[name]


def _method(quant: QuantizationConfig | None, prefix: str):
    return quant.linear_method(prefix) if quant is not None else None


class CLIPAttention(nn.Module):
    def __init__(self, cfg, quant, prefix: str):
        super().__init__()
        d = cfg.hidden_size
        self.nh, self.hd = cfg.num_attention_heads, d // cfg.num_attention_heads
        qkv = f"{prefix}.qkv_proj"
        self.qkv_proj = MergedLinear(d, {"q": d, "k": d, "v": d}, bias=True, method=_method(quant, qkv), prefix=qkv)
        out = f"{prefix}.out_proj"
        self.out_proj = Linear(d, d, bias=True, method=_method(quant, out), prefix=out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, d = x.shape
        q, k, v = self.qkv_proj(x.reshape(n * t, d)).view(n, t, 3, self.nh, self.hd).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(q, k, v)  # full attention: every patch sees every patch
        return self.out_proj(o.transpose(1, 2).reshape(n * t, d)).view(n, t, d)


class CLIPMLP(nn.Module):
    def __init__(self, cfg, quant, prefix: str):
        super().__init__()
        self.fc1 = Linear(cfg.hidden_size, cfg.intermediate_size, bias=True, method=_method(quant, f"{prefix}.fc1"),
                          prefix=f"{prefix}.fc1")
        self.fc2 = Linear(cfg.intermediate_size, cfg.hidden_size, bias=True, method=_method(quant, f"{prefix}.fc2"),
                          prefix=f"{prefix}.fc2")
        self.act = activation(cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        return self.fc2(self.act(self.fc1(x.reshape(-1, shape[-1])))).view(shape)


class CLIPEncoderLayer(nn.Module):
    def __init__(self, cfg, quant, prefix: str):
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.self_attn = CLIPAttention(cfg, quant, f"{prefix}.self_attn")
        self.layer_norm2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.mlp = CLIPMLP(cfg, quant, f"{prefix}.mlp")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class CLIPEmbeddings(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        d, p = cfg.hidden_size, cfg.patch_size
        self.patch_embedding = nn.Conv2d(cfg.num_channels, d, kernel_size=p, stride=p, bias=False)
        self.class_embedding = nn.Parameter(torch.empty(d), requires_grad=False)
        self.position_embedding = nn.Embedding((cfg.image_size // p) ** 2 + 1, d)
        self.image_size = cfg.image_size

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        if pixels.shape[-2:] != (self.image_size, self.image_size):
            raise ValueError(f"pixel values are {tuple(pixels.shape[-2:])}, the vision tower takes "
                             f"{self.image_size}x{self.image_size}")
        patches = self.patch_embedding(pixels.to(self.patch_embedding.weight.dtype)).flatten(2).transpose(1, 2)
        cls = self.class_embedding.expand(pixels.shape[0], 1, -1)
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight


class CLIPVisionTower(nn.Module):
    """Returns the hidden states of `feature_layers` (HF's hidden_states indices: 0 is the embeddings after
    pre_layrnorm, i the output of layer i, negative from the end), concatenated along the features. Layers
    past the deepest one needed are not built (LLaVA's default, -2, skips the last)."""

    def __init__(self, cfg, feature_layers: list[int], quant: QuantizationConfig | None = None,
                 prefix: str = "vision_tower"):
        super().__init__()
        total = cfg.num_hidden_layers
        self.feature_layers = [i if i >= 0 else total + 1 + i for i in feature_layers]
        if not all(0 <= i <= total for i in self.feature_layers):
            raise ValueError(f"vision_feature_layer {feature_layers} is outside the tower's {total} layers")
        self.embeddings = CLIPEmbeddings(cfg)
        self.pre_layrnorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.layers = nn.ModuleList(CLIPEncoderLayer(cfg, quant, f"{prefix}.encoder.layers.{i}")
                                    for i in range(max(self.feature_layers)))

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.pre_layrnorm(self.embeddings(pixels))
        states = {0: x}
        for i, layer in enumerate(self.layers, start=1):
            x = layer(x)
            states[i] = x
        return torch.cat([states[i] for i in self.feature_layers], dim=-1)
