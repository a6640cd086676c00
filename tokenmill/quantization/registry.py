"""Builds the QuantizationConfig for a resolved method name (quantization/config.py resolves it)."""
from __future__ import annotations

from tokenmill.quantization.awq import AWQConfig
from tokenmill.quantization.config import QuantizationConfig, checkpoint_quantization
from tokenmill.quantization.int8 import Int8Config


def build_quant_config(method: str | None, hf_config) -> QuantizationConfig | None:
    if method is None:
        return None
    if method == "awq":
        return AWQConfig.from_checkpoint(checkpoint_quantization(hf_config))
    return Int8Config(activations=method == "w8a8")
