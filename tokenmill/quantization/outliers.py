"""A function-preserving "outlier" copy of a float Llama-style model: the test bench for AWQ.

Real LLMs carry a few input channels with activations 10-100x the rest, which is what AWQ protects
and plain round-to-nearest destroys. A small model trained briefly has none, so we make them without
changing the function: in every decoder layer, for a few channels c,

    input_layernorm.weight[c]          *= factor      q/k/v_proj.weight[:, c]  /= factor
    post_attention_layernorm.weight[c] *= factor      gate/up_proj.weight[:, c] /= factor

(RMSNorm output channel c feeds only those columns, so y = W x is unchanged.) With a power-of-two
factor both multiplications are exact in floating point and the logits are bit for bit the same.
Quantization is not: column c of W is now `factor` times smaller than its neighbours, so RTN rounds it
to the group's zero point while its input is `factor` times larger.
"""
from __future__ import annotations

import math
from pathlib import Path

from tokenmill.quantization.checkpoint import load_state_dict, read_config, write_model_dir

# norm -> the linears that read its output
FOLDS = {"input_layernorm": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
         "post_attention_layernorm": ("mlp.gate_proj", "mlp.up_proj")}


def default_channels(hidden_size: int, n: int = 4) -> list[int]:
    """n channels spread over the hidden size (not the first or last)."""
    return [hidden_size * (2 * i + 1) // (2 * n) for i in range(n)]


def make_outlier_model(src_dir: str | Path, out_dir: str | Path, channels: list[int] | None = None,
                       factor: float = 64.0) -> list[int]:
    """Write the outlier copy of `src_dir` to `out_dir`; returns the channels used."""
    config = read_config(src_dir)
    hidden = config["hidden_size"]
    channels = list(channels) if channels is not None else default_channels(hidden)
    if not channels or any(not 0 <= c < hidden for c in channels):
        raise ValueError(f"channels must be non-empty and in [0, {hidden}), got {channels}")
    if factor <= 0 or not math.isfinite(factor):
        raise ValueError(f"factor must be a positive number, got {factor}")
    sd = load_state_dict(src_dir)
    for i in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{i}"
        for norm, linears in FOLDS.items():
            sd[f"{prefix}.{norm}.weight"][channels] *= factor
            for name in linears:
                sd[f"{prefix}.{name}.weight"][:, channels] /= factor
    write_model_dir(out_dir, src_dir, config, sd)
    return channels
