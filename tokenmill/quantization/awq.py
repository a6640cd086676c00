"""AutoAWQ "GEMM" checkpoints, 4-bit with zero points (layout in quantization/awq_format.py), W4A16.

On CPU the nibbles are repacked once into torch's int4 weight-only layout, whose kernel reads half a
byte per weight and dequantizes in registers. It computes W = (q - 8) * scale + zero', so AWQ's
W = (q - z) * s becomes zero' = (8 - z) * s. The pure-torch twin dequantizes the whole weight.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenmill.layers.linear import (LinearMethod, LoadContext, DecodeRowsKernel, UnquantizedLinearMethod, add_param,
                                     linear_in, matmul_dtype)
from tokenmill.quantization.awq_format import dequantize_w4, quantize_w4, unpack_int4
from tokenmill.quantization.config import QuantizationConfig, awq_settings
from tokenmill.quantization.int8 import Int8LinearMethod, choose_weight_only_kernels
from tokenmill.ops import cpu_qgemm_amx, cpu_qgemv, triton_quant

PACK = 8  # nibbles per int32


def int4pack_available() -> bool:
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu") and \
        hasattr(torch.ops.aten, "_convert_weight_to_int4pack_for_cpu")


class AWQLinearMethod(LinearMethod):
    def __init__(self, group_size: int):
        self.group_size = group_size

    def check_shape(self, layer, in_features, out_features):
        g = self.group_size
        if in_features % g:
            raise ValueError(f"{layer.prefix or 'linear layer'}: input size {in_features} is not a multiple of the "
                             f"AWQ group size {g}")
        if out_features % PACK:
            raise ValueError(f"{layer.prefix or 'linear layer'}: output size {out_features} is not a multiple of "
                             f"{PACK} (AWQ packs 8 outputs per int32)")

    def create_weights(self, layer, in_features, out_features, dtype):
        self.check_shape(layer, in_features, out_features)
        g = self.group_size
        add_param(layer, "qweight", torch.empty(in_features, out_features // PACK, dtype=torch.int32), 1, PACK,
                  input_dim=0)
        add_param(layer, "qzeros", torch.empty(in_features // g, out_features // PACK, dtype=torch.int32), 1, PACK,
                  input_dim=0, input_pack=g)
        add_param(layer, "scales", torch.empty(in_features // g, out_features, dtype=torch.float16), 1,
                  input_dim=0, input_pack=g)

    def process_after_loading(self, layer, ctx: LoadContext):
        layer.int4_packed = layer.panels = layer.dense = None
        layer.bias_f32 = None if layer.bias is None else layer.bias.data.float()
        layer.triton = ctx.device == "cuda" and triton_quant.available()
        if layer.triton:  # the GPU kernel reads AutoAWQ's layout as loaded
            return
        fast = ctx.device == "cpu" and ctx.cpu_kernel != "torch"
        n, k = layer.out_features, layer.in_features
        if fast and cpu_qgemv.available() and cpu_qgemv.supports(n, k, self.group_size):
            q = unpack_int4(layer.qweight.data).t()                          # [N, K]
            layer.panels = cpu_qgemv.pack_int4(q, layer.scales.data, unpack_int4(layer.qzeros.data), self.group_size)
            choose_weight_only_kernels(layer, ctx.dtype, n, k, self.group_size)
        elif fast and int4pack_available():
            q = unpack_int4(layer.qweight.data).t().contiguous().to(torch.int32)
            s = layer.scales.data.float()                                     # [K/G, N]
            zero = (8 - unpack_int4(layer.qzeros.data).float()) * s
            layer.int4_packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2)
            layer.int4_scale_zero = torch.stack([s, zero], -1).to(ctx.dtype).contiguous()
        else:
            layer.dense = dequantize_w4(layer.qweight.data, layer.qzeros.data, layer.scales.data, self.group_size)
            return
        del layer.qweight, layer.qzeros, layer.scales  # the repacked copy is all the kernels need

    def decode_rows_kernel(self, layer):
        if layer.triton or layer.panels is None:
            return None
        packed, s, z = layer.panels
        return DecodeRowsKernel("u4", packed, layer.out_features, layer.in_features, layer.bias_f32, scales=s, zeros=z,
                                group_size=self.group_size, max_rows=layer.kernel_rows)

    def apply(self, layer, x):
        if layer.triton:
            return triton_quant.awq_gemm(x, layer.qweight, layer.qzeros, layer.scales, self.group_size, layer.bias)
        if layer.panels is not None:
            if x.shape[0] <= layer.kernel_rows:
                return cpu_qgemv.gemv_int4(x, *layer.panels, self.group_size, layer.bias_f32)
            if layer.amx_gemm and x.dtype == torch.bfloat16 and x.shape[0] <= cpu_qgemm_amx.INT4_MAX_ROWS:
                return cpu_qgemm_amx.gemm_int4(x, *layer.panels, self.group_size, layer.bias_f32)
            w = cpu_qgemv.dequant_int4(*layer.panels, self.group_size, matmul_dtype(x))
            return linear_in(x, w, layer.bias)
        if layer.int4_packed is not None and x.dtype in (torch.float32, torch.bfloat16, torch.float16):
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, layer.int4_packed, self.group_size,
                                                          layer.int4_scale_zero)
            return y if layer.bias is None else y + layer.bias
        return F.linear(x.float(), layer.dense, None if layer.bias is None else layer.bias.float()).to(x.dtype)

    def dense_weight(self, layer):
        if layer.dense is not None:
            return layer.dense
        if layer.triton:
            return dequantize_w4(layer.qweight.data, layer.qzeros.data, layer.scales.data, self.group_size)
        if layer.panels is not None:
            return cpu_qgemv.dequant_int4(*layer.panels, self.group_size, torch.float32)
        raise RuntimeError("AWQ weights were repacked for torch's int4 kernel; use cpu_linear_kernel='torch' to "
                           "keep the dense twin")


class Int4LinearMethod(AWQLinearMethod):
    """4-bit weight-only with zero points, made at load time from a float weight by round-to-nearest on
    AWQ's grid (no activation-aware scaling: there is no calibration at load time), then run by AWQ's
    kernels. The LM head's `int4` option: on a tied-embedding model the head is the largest weight a
    decode step reads, and int4 halves what int8 reads of it."""

    def __init__(self, group_sizes: tuple[int, ...]):
        """The first of `group_sizes` that divides the layer's input size is its group."""
        self.group_sizes = group_sizes
        super().__init__(group_sizes[-1])

    def create_weights(self, layer, in_features, out_features, dtype):
        self.group_size = next((g for g in self.group_sizes if in_features % g == 0), self.group_sizes[-1])
        self.check_shape(layer, in_features, out_features)
        add_param(layer, "weight", torch.empty(out_features, in_features, dtype=dtype), output_dim=0, input_dim=1)

    def process_after_loading(self, layer, ctx: LoadContext):
        qweight, qzeros, scales = quantize_w4(layer.weight.data, self.group_size)
        del layer.weight  # a tied embedding keeps its own reference
        for name, t in (("qweight", qweight), ("qzeros", qzeros), ("scales", scales)):
            layer.register_parameter(name, torch.nn.Parameter(t, requires_grad=False))
        super().process_after_loading(layer, ctx)


# the checkpoint's projections each merged layer holds
_MERGED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


class AWQConfig(QuantizationConfig):
    name = "awq"

    def __init__(self, bits: int, group_size: int, skip: tuple[str, ...]):
        self.bits, self.group_size, self.skip = bits, group_size, skip

    @classmethod
    def from_checkpoint(cls, ckpt: dict) -> "AWQConfig":
        bits, group, _, _ = awq_settings(ckpt)
        skip = tuple(ckpt.get("modules_to_not_convert") or ())
        return cls(bits, group, ("lm_head", *skip))

    def linear_method(self, prefix):
        # a merged layer (qkv_proj, gate_up_proj) is skipped when the checkpoint skips each of its parts, which
        # is how AutoAWQ and transformers name them ("v_proj" no longer matches "qkv_proj" by its letters)
        head, _, last = prefix.rpartition(".")
        names = [f"{head}.{part}" for part in _MERGED_PARTS[last]] if last in _MERGED_PARTS else [prefix]
        skipped = [any(s and s in name for s in self.skip) for name in names]
        if any(skipped) and not all(skipped):
            kept = [n.rpartition(".")[2] for n, k in zip(names, skipped) if k]
            raise ValueError(f"modules_to_not_convert keeps {', '.join(kept)} of {prefix} unquantized but not the "
                             "rest; tokenmill runs them as one merged layer, quantized or not")
        if all(skipped):
            return UnquantizedLinearMethod()
        if self.bits == 8:
            return Int8LinearMethod(from_checkpoint=True, activations=False)
        return AWQLinearMethod(self.group_size)
