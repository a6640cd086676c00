"""Llama-family decoder (Llama 2/3, Mistral, Qwen2) over the paged KV cache."""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from tokenmill.attention.backend import AttentionBackend
from tokenmill.config import ModelConfig
from tokenmill.distributed.comm import SINGLE, WHOLE_MODEL, ModelShard, TensorParallel
from tokenmill.distributed.layout import kv_head_split
from tokenmill.layers.activation import silu_and_mul
from tokenmill.layers.embedding import VocabParallelEmbedding
from tokenmill.layers.linear import ColumnParallelLinear, MergedLinear, RowParallelLinear, UnquantizedLinearMethod
from tokenmill.ops import triton_gemv
from tokenmill.quantization.config import QuantizationConfig
from tokenmill.layers.norm import RMSNorm
from tokenmill.layers.rotary import RotaryEmbedding
from tokenmill.models.weight_checks import check_merged_pieces, place


def linear_method(quant: QuantizationConfig | None, prefix: str):
    return quant.linear_method(prefix) if quant is not None else None


class Attention(nn.Module):
    """Heads are this TP rank's: num_heads / tp query heads and their KV heads (kv_head_split)."""

    def __init__(self, cfg: ModelConfig, quant: QuantizationConfig | None = None, prefix: str = "",
                 tp: TensorParallel = SINGLE):
        super().__init__()
        self.hd = cfg.head_dim
        self.nh = cfg.num_heads // tp.size
        self.nkv, kv_start = kv_head_split(cfg.num_kv_heads, tp.size, tp.rank)
        self.q_size, self.kv_size = self.nh * self.hd, self.nkv * self.hd
        qkv, o = f"{prefix}.qkv_proj", f"{prefix}.o_proj"
        kv = (self.kv_size, kv_start * self.hd)
        split = {"q": (self.q_size, tp.rank * self.q_size), "k": kv, "v": kv}
        self.qkv_proj = MergedLinear(cfg.hidden_size, {}, bias=cfg.attention_bias, method=linear_method(quant, qkv),
                                     prefix=qkv, tp=tp, split=split)
        self.o_proj = RowParallelLinear(cfg.num_heads * self.hd, cfg.hidden_size, bias=cfg.o_proj_bias,
                                        method=linear_method(quant, o), prefix=o, tp=tp)
        self.scale = self.hd ** -0.5

    def forward(self, x, cos, sin, kv_cache, meta, backend: AttentionBackend):
        """`meta` is the backend's own step metadata (attention/backend.py); only the backend reads it."""
        return self.attend(self.qkv_proj(x), cos, sin, kv_cache, meta, backend)

    def attend(self, qkv, cos, sin, kv_cache, meta, backend: AttentionBackend):
        """From the qkv projection on: rotary, the KV write and attention (the backend's), the output projection."""
        o = backend.forward_qkv(qkv, cos, sin, self.nh, self.nkv, self.hd, kv_cache[0], kv_cache[1], meta, self.scale)
        return self.o_proj(o.reshape(-1, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, quant: QuantizationConfig | None = None, prefix: str = "",
                 tp: TensorParallel = SINGLE):
        super().__init__()
        gu, down = f"{prefix}.gate_up_proj", f"{prefix}.down_proj"
        self.gate_up_proj = MergedLinear(cfg.hidden_size, {"gate": cfg.intermediate_size, "up": cfg.intermediate_size},
                                         bias=cfg.mlp_bias, method=linear_method(quant, gu), prefix=gu, tp=tp)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias,
                                           method=linear_method(quant, down), prefix=down, tp=tp)

    def forward(self, x):
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, quant: QuantizationConfig | None = None, prefix: str = "",
                 tp: TensorParallel = SINGLE):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, quant, f"{prefix}.self_attn", tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, quant, f"{prefix}.mlp", tp)

        self.folds_gemvs: bool | None = None  # decided at the first forward (_can_fold_gemvs)

    def forward(self, x, residual, cos, sin, kv_cache, meta, backend):
        if self.folds_gemvs is not False and 0 < x.shape[0] <= triton_gemv.MAX_ROWS and self._can_fold_gemvs(x):
            try:
                return self._forward_folded(x, residual, cos, sin, kv_cache, meta, backend)
            except Exception as e:  # checks or a compile failure: the inputs are untouched (a KV write
                # already made is the same one the plain path makes again)
                self.folds_gemvs = False
                triton_gemv.give_up(e)
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, cos, sin, kv_cache, meta, backend)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual

    def _can_fold_gemvs(self, x: torch.Tensor) -> bool:
        """Once per layer: ops/triton_gemv.py is switched on and runs here (CUDA, or the interpreter), and the
        four projections are plain float weights of the activations' dtype."""
        if self.folds_gemvs is None:
            attn, mlp = self.self_attn, self.mlp
            linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            self.folds_gemvs = (triton_gemv.enabled() and triton_gemv.runs_on(x) and all(
                type(lin.method) is UnquantizedLinearMethod and getattr(lin, "weight", None) is not None
                and lin.weight.dtype == x.dtype for lin in linears) and
                self.input_layernorm.weight.dtype == self.post_attention_layernorm.weight.dtype == x.dtype)
        return self.folds_gemvs

    def _forward_folded(self, x, residual, cos, sin, kv_cache, meta, backend):
        """The plain forward with each RMSNorm folded into the GEMV after it and SiLU-and-mul into down's
        (three launches fewer); the same rounding as the plain ops, and the residual a new tensor."""
        attn, mlp = self.self_attn, self.mlp
        ln1, ln2, down = self.input_layernorm, self.post_attention_layernorm, mlp.down_proj
        qkv, new_residual = triton_gemv.add_rmsnorm_gemv(x, residual, ln1.weight, ln1.eps, attn.qkv_proj.weight,
                                                         attn.qkv_proj.bias)
        residual = x if residual is None else new_residual
        o = attn.attend(qkv, cos, sin, kv_cache, meta, backend)
        gate_up, residual = triton_gemv.add_rmsnorm_gemv(o, residual, ln2.weight, ln2.eps, mlp.gate_up_proj.weight,
                                                         mlp.gate_up_proj.bias)
        y = triton_gemv.silu_mul_gemv(gate_up, down.weight, down.bias)
        return (y if down.reduce_over is None else down.reduce_over.all_reduce(y)), residual


class MissingLayer(nn.Module):
    """A layer another pipeline stage holds: it keeps the layer indices (and checkpoint names) in place."""


class LlamaModel(nn.Module):
    """The decoder stack, or one pipeline stage of it: the first stage embeds, the last applies the final
    norm; the others take and return (hidden, residual)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, max_positions: int,
                 quant: QuantizationConfig | None = None, shard: ModelShard = WHOLE_MODEL):
        super().__init__()
        self.shard = shard
        self.owned = shard.layers(cfg.num_layers)
        if shard.is_first_stage:
            self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, shard.tp)
        self.layers = nn.ModuleList(DecoderLayer(cfg, quant, f"model.layers.{i}", shard.tp) if i in self.owned
                                    else MissingLayer() for i in range(cfg.num_layers))
        if shard.is_last_stage:
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling, dtype)

    def forward(self, input_ids, positions, kv_caches, meta, backend, intermediate=None, inputs_embeds=None):
        """`kv_caches` are this stage's layers' caches, in order. `intermediate` is the previous stage's
        (hidden, residual). `inputs_embeds` replaces the token embeddings (multimodal prompts). Returns the
        final hidden states on the last stage, else (hidden, residual)."""
        if self.shard.is_first_stage:
            x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
            residual = None
        else:
            x, residual = intermediate
        cos, sin = self.rotary.cos_sin(positions)
        for i, kv in zip(self.owned, kv_caches):
            x, residual = self.layers[i](x, residual, cos, sin, kv, meta, backend)
        if not self.shard.is_last_stage:
            return x, residual
        x, _ = self.norm(x, residual)
        return x


class LlamaForCausalLM(nn.Module):
    # checkpoint name piece -> (our merged parameter piece, shard id)
    stacked = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
               "gate_proj": ("gate_up_proj", "gate"), "up_proj": ("gate_up_proj", "up")}

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, max_positions: int,
                 quant: QuantizationConfig | None = None, shard: ModelShard = WHOLE_MODEL):
        super().__init__()
        self.cfg, self.shard = cfg, shard
        self.model = LlamaModel(cfg, dtype, max_positions, quant, shard)
        self.lm_head = None
        if shard.is_last_stage:  # the LM head scores this rank's slice of the vocabulary
            self.lm_head = ColumnParallelLinear(cfg.hidden_size, cfg.vocab_size, method=linear_method(quant, "lm_head"),
                                                prefix="lm_head", tp=shard.tp)
            if cfg.tie_word_embeddings and shard.is_first_stage:
                self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids, positions, kv_caches, meta, backend, intermediate=None, inputs_embeds=None):
        return self.model(input_ids, positions, kv_caches, meta, backend, intermediate, inputs_embeds)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.shard.tp.all_gather(self.lm_head(hidden).float())

    def _checkpoint_name(self, name: str) -> str | None:
        """Our parameter name for a checkpoint tensor, or None when this rank does not hold it."""
        if "rotary_emb.inv_freq" in name:
            return None
        tied, first, last = self.cfg.tie_word_embeddings, self.shard.is_first_stage, self.shard.is_last_stage
        if name == "lm_head.weight":
            return name if last and not tied else None  # tied: the embedding is the head
        if name == "model.embed_tokens.weight":
            if first:
                return name
            return "lm_head.weight" if last and tied else None  # a later stage's head loads the tied rows
        if name.startswith("model.layers."):
            layer = int(name.split(".")[2])
            if layer >= self.cfg.num_layers:  # (not another stage's: no stage has it; the config disagrees)
                raise ValueError(f"checkpoint tensor {name!r} is past the config's {self.cfg.num_layers} layers "
                                 f"(num_hidden_layers)")
            return name if layer in self.model.owned else None
        if name.startswith("model.norm."):
            return name if last else None
        return name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        loaded, pieces = set(), {}
        for original, tensor in weights:
            name = self._checkpoint_name(original)
            if name is None:
                continue
            shard = None
            for piece, (merged, sid) in self.stacked.items():
                if f".{piece}." in name:
                    name, shard = name.replace(f".{piece}.", f".{merged}."), sid
                    break
            if name not in params:  # (named as the checkpoint names it: the merged name is ours)
                raise ValueError(f"checkpoint tensor {original!r} has no matching parameter in {type(self).__name__}")
            place(params[name], tensor, shard, original)
            if shard is not None:
                pieces.setdefault(name, set()).add(shard)
            loaded.add(name)
        check_merged_pieces(pieces, self.stacked)
        return loaded
