"""LLaVA: a CLIP vision tower, a two-layer projector and a Llama / Mistral / Qwen2 language model.

    image pixels -> CLIPVisionTower -> feature layer(s), CLS dropped ("default") -> projector -> [T, hidden]
    prompt ids   -> embed_tokens -> rows at each image's placeholders replaced by its T encoder rows
                 -> the language model's layers over the paged KV cache, as for a text model

The model runner asks for encoder outputs (`encode_images`) and splices them in (`inputs_embeds`); the
language model never sees pixels, so prefix caching, chunked prefill and preemption work unchanged.
"""
from __future__ import annotations

import re
from typing import Iterable

import torch
from torch import nn

from tokenmill.config import ModelConfig
from tokenmill.distributed.comm import WHOLE_MODEL, ModelShard
from tokenmill.layers.linear import Linear
from tokenmill.models.clip import CLIPVisionTower, activation
from tokenmill.models.llama import LlamaForCausalLM
from tokenmill.models.weight_checks import check_merged_pieces, place
from tokenmill.quantization.config import QuantizationConfig

# Checkpoint layouts on the hub -> ours. llava-hf repos: vision_tower.vision_model.*, language_model.model.*,
# language_model.lm_head.*; transformers >= 4.52 saves model.vision_tower.*, model.language_model.*, lm_head.*
_RENAMES = [
    (re.compile(r"^model\.(vision_tower|multi_modal_projector)\."), r"\1."),
    (re.compile(r"^model\.language_model\."), "language_model.model."),
    (re.compile(r"^lm_head\."), "language_model.lm_head."),
    (re.compile(r"^vision_tower\.vision_model\."), "vision_tower."),
    (re.compile(r"^vision_tower\.encoder\.layers\."), "vision_tower.layers."),
]
_VISION_STACKED = {"q_proj": "q", "k_proj": "k", "v_proj": "v"}


class LlavaProjector(nn.Module):
    def __init__(self, in_features: int, hidden: int, act: str, bias: bool):
        super().__init__()
        self.linear_1 = Linear(in_features, hidden, bias=bias, prefix="multi_modal_projector.linear_1")
        self.act = activation(act)
        self.linear_2 = Linear(hidden, hidden, bias=bias, prefix="multi_modal_projector.linear_2")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaForConditionalGeneration(nn.Module):
    is_multimodal = True

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, max_positions: int,
                 quant: QuantizationConfig | None = None, shard: ModelShard = WHOLE_MODEL,
                 encoder_quant: QuantizationConfig | None = None):
        super().__init__()
        if shard is not WHOLE_MODEL and (shard.tp.size > 1 or not (shard.is_first_stage and shard.is_last_stage)):
            raise ValueError("multimodal models do not run with tensor or pipeline parallelism yet")
        hf = cfg.hf_config
        self.cfg, self.shard = cfg, shard
        layers = hf.vision_feature_layer
        layers = [layers] if isinstance(layers, int) else list(layers)
        self.drop_cls = getattr(hf, "vision_feature_select_strategy", "default") == "default"
        vision = hf.vision_config
        self.vision_tower = CLIPVisionTower(vision, layers, encoder_quant)
        self.multi_modal_projector = LlavaProjector(vision.hidden_size * len(layers), cfg.hidden_size,
                                                    getattr(hf, "projector_hidden_act", "gelu"),
                                                    bool(getattr(hf, "multimodal_projector_bias", True)))
        self.language_model = LlamaForCausalLM(cfg, dtype, max_positions, quant, shard)

    # -- the runner's entry points -----------------------------------------------------------------
    def forward(self, input_ids, positions, kv_caches, meta, backend, intermediate=None, inputs_embeds=None):
        return self.language_model(input_ids, positions, kv_caches, meta, backend, intermediate, inputs_embeds)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.language_model.compute_logits(hidden)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.language_model.model.embed_tokens(input_ids)

    def encode_images(self, pixels: torch.Tensor) -> torch.Tensor:
        """[N, 3, H, W] preprocessed pixels -> [N, tokens per image, hidden]: what replaces the placeholders."""
        features = self.vision_tower(pixels)
        if self.drop_cls:
            features = features[:, 1:]
        n, t, d = features.shape
        return self.multi_modal_projector(features.reshape(n * t, d)).view(n, t, -1)

    @property
    def lm_head(self):
        return self.language_model.lm_head

    # -- loading ---------------------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        text: list[tuple[str, torch.Tensor]] = []
        loaded, pieces = set(), {}
        for original, tensor in weights:
            name = original
            for pattern, repl in _RENAMES:
                name = pattern.sub(repl, name)
            if name.startswith("language_model."):
                text.append((name[len("language_model."):], tensor))
                continue
            name, shard = self._vision_name(name)
            if name is None:
                continue
            if name not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no matching parameter in {type(self).__name__}")
            place(params[name], tensor, shard, original)
            if shard is not None:
                pieces.setdefault(name, set()).add(shard)
            loaded.add(name)
        check_merged_pieces(pieces, {piece: ("qkv_proj", sid) for piece, sid in _VISION_STACKED.items()})
        loaded |= {f"language_model.{n}" for n in self.language_model.load_weights(iter(text))}
        return loaded

    def _vision_name(self, name: str) -> tuple[str | None, str | None]:
        """Our parameter name (and merged-shard id) for a vision checkpoint tensor; None for tensors of the
        layers we do not build (past the feature layer) and the unused post_layernorm."""
        if name.startswith("vision_tower.post_layernorm."):
            return None, None
        m = re.match(r"^vision_tower\.layers\.(\d+)\.", name)
        if m and int(m.group(1)) >= len(self.vision_tower.layers):
            return None, None
        for piece, sid in _VISION_STACKED.items():
            if f".self_attn.{piece}." in name:
                return name.replace(f".self_attn.{piece}.", ".self_attn.qkv_proj."), sid
        return name, None
