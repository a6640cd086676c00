"""Llama-family decoder (Llama 2/3, Mistral, Qwen2) over the paged KV cache."""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from tokenmill.attention.backend import AttentionBackend, AttentionMetadata
from tokenmill.config import ModelConfig
from tokenmill.layers.activation import silu_and_mul
from tokenmill.layers.linear import Linear, MergedLinear, default_weight_loader
from tokenmill.quantization.config import QuantizationConfig
from tokenmill.layers.norm import RMSNorm
from tokenmill.layers.rotary import RotaryEmbedding, rotate_heads


def linear_method(quant: QuantizationConfig | None, prefix: str):
    return quant.linear_method(prefix) if quant is not None else None


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, quant: QuantizationConfig | None = None, prefix: str = ""):
        super().__init__()
        self.nh, self.nkv, self.hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = self.nh * self.hd, self.nkv * self.hd
        qkv, o = f"{prefix}.qkv_proj", f"{prefix}.o_proj"
        self.qkv_proj = MergedLinear(cfg.hidden_size, {"q": self.q_size, "k": self.kv_size, "v": self.kv_size},
                                     bias=cfg.attention_bias, method=linear_method(quant, qkv), prefix=qkv)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, method=linear_method(quant, o), prefix=o)
        self.scale = self.hd ** -0.5

    def forward(self, x, cos, sin, kv_cache, meta: AttentionMetadata, backend: AttentionBackend):
        qkv = self.qkv_proj(x)
        # rotate the query and key heads in one pass: [T, nh + nkv, hd]
        qk = rotate_heads(qkv, cos, sin, self.nh + self.nkv, self.hd)
        q, k = qk[:, :self.nh], qk[:, self.nh:]
        v = qkv[:, self.q_size + self.kv_size:].view(-1, self.nkv, self.hd)
        o = backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)
        return self.o_proj(o.reshape(-1, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, quant: QuantizationConfig | None = None, prefix: str = ""):
        super().__init__()
        gu, down = f"{prefix}.gate_up_proj", f"{prefix}.down_proj"
        self.gate_up_proj = MergedLinear(cfg.hidden_size, {"gate": cfg.intermediate_size, "up": cfg.intermediate_size},
                                         method=linear_method(quant, gu), prefix=gu)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, method=linear_method(quant, down),
                                prefix=down)

    def forward(self, x):
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, quant: QuantizationConfig | None = None, prefix: str = ""):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, quant, f"{prefix}.self_attn")
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, quant, f"{prefix}.mlp")

    def forward(self, x, residual, cos, sin, kv_cache, meta, backend):
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, cos, sin, kv_cache, meta, backend)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, max_positions: int,
                 quant: QuantizationConfig | None = None):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, quant, f"model.layers.{i}") for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling, dtype)

    def forward(self, input_ids, positions, kv_caches, meta, backend):
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary.cos_sin(positions)
        residual = None
        for layer, kv in zip(self.layers, kv_caches):
            x, residual = layer(x, residual, cos, sin, kv, meta, backend)
        x, _ = self.norm(x, residual)
        return x


class LlamaForCausalLM(nn.Module):
    # checkpoint name piece -> (our merged parameter piece, shard id)
    stacked = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
               "gate_proj": ("gate_up_proj", "gate"), "up_proj": ("gate_up_proj", "up")}

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, max_positions: int,
                 quant: QuantizationConfig | None = None):
        super().__init__()
        self.cfg = cfg
        self.model = LlamaModel(cfg, dtype, max_positions, quant)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, method=linear_method(quant, "lm_head"), prefix="lm_head")
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids, positions, kv_caches, meta, backend):
        return self.model(input_ids, positions, kv_caches, meta, backend)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.cfg.tie_word_embeddings:
                continue  # tied: the embedding is the head
            shard = None
            for piece, (merged, sid) in self.stacked.items():
                if f".{piece}." in name:
                    name, shard = name.replace(f".{piece}.", f".{merged}."), sid
                    break
            if name not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no matching parameter in {type(self).__name__}")
            p = params[name]
            loader = getattr(p, "weight_loader", None)
            if loader is not None:  # the Linear's method places (shards of) its own parameters
                loader(p, tensor, shard)
            elif shard is None:
                default_weight_loader(p, tensor.to(p.dtype))
            else:
                raise ValueError(f"checkpoint tensor {name!r} is a shard, but its parameter takes whole tensors")
            loaded.add(name)
        return loaded
