"""Builds the QuantizationConfig for a resolved method name (quantization/config.py resolves it)."""
from __future__ import annotations

from tokenmill.quantization.awq import AWQConfig
from tokenmill.quantization.config import QuantizationConfig, checkpoint_quantization
from tokenmill.quantization.int8 import Int8Config, Int8LinearMethod


def build_quant_config(method: str | None, hf_config, quantize_lm_head: bool = False) -> QuantizationConfig | None:
    if method is None:
        inner = None
    elif method == "awq":
        inner = AWQConfig.from_checkpoint(checkpoint_quantization(hf_config))
    else:
        inner = Int8Config(activations=method == "w8a8")
    return Int8LMHead(inner) if quantize_lm_head else inner


class Int8LMHead(QuantizationConfig):
    """The LM head in int8 weight-only, made at load time, whatever the rest of the model runs. On a
    tied-embedding model it is the largest single weight read per decode step (Qwen2.5-0.5B: 136M of 494M
    parameters); every method above leaves it in float otherwise, as AutoAWQ and vLLM do. Under w8a8 the head
    is W8A8 too (batched steps: its int8 GEMM), else weight-only."""

    def __init__(self, inner: QuantizationConfig | None):
        self.inner, self.name = inner, getattr(inner, "name", "")

    def linear_method(self, prefix):
        if prefix == "lm_head":
            return Int8LinearMethod(from_checkpoint=False, activations=getattr(self.inner, "activations", False))
        return self.inner.linear_method(prefix) if self.inner is not None else None
