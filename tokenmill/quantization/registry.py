"""Builds the QuantizationConfig for a resolved method name (quantization/config.py resolves it)."""
from __future__ import annotations

from tokenmill.quantization.awq import AWQConfig, Int4LinearMethod
from tokenmill.quantization.config import QuantizationConfig, checkpoint_quantization
from tokenmill.quantization.int8 import Int8Config, Int8LinearMethod


# groups of 64, else 32 where 64 does not divide the hidden size. On the shipped model g64 cost +0.54 %
# perplexity, g32 +0.62 %, g128 +0.75 %; a 151936 x 896 head read 1.9, 2.1 and 1.7 ms a token at ~35 GB/s
LM_HEAD_INT4_GROUPS = (64, 32)


def build_quant_config(method: str | None, hf_config, quantize_lm_head: str | None = None) -> QuantizationConfig | None:
    if method is None:
        inner = None
    elif method == "awq":
        inner = AWQConfig.from_checkpoint(checkpoint_quantization(hf_config))
    else:
        inner = Int8Config(activations=method == "w8a8")
    return QuantizedLMHead(inner, quantize_lm_head) if quantize_lm_head else inner


class QuantizedLMHead(QuantizationConfig):
    """The LM head quantized at load time, whatever the rest of the model runs. On a tied-embedding model it
    is the largest single weight read per decode step (Qwen2.5-0.5B: 136M of 494M parameters); every method
    above leaves it in float otherwise, as AutoAWQ and vLLM do.
      int8: per output channel; under w8a8 the head is W8A8 too (batched steps: its int8 GEMM), else
            weight-only. llama.cpp's q4_0 / q8_0 files of such a model carry a q8_0 head.
      int4: round-to-nearest with zero points in groups of LM_HEAD_INT4_GROUPS, on AWQ's kernels."""

    def __init__(self, inner: QuantizationConfig | None, kind: str):
        self.inner, self.kind, self.name = inner, kind, getattr(inner, "name", "")

    def linear_method(self, prefix):
        if prefix == "lm_head":
            if self.kind == "int4":
                return Int4LinearMethod(LM_HEAD_INT4_GROUPS)
            return Int8LinearMethod(from_checkpoint=False, activations=getattr(self.inner, "activations", False))
        return self.inner.linear_method(prefix) if self.inner is not None else None
