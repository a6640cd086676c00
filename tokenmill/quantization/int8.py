"""INT8 weights, symmetric per output channel: W[n, k] = q[n, k] * s[n].

Two ways to multiply:
- W8A16 (`quantization="int8"`, and 8-bit AWQ checkpoints): activations stay in the model dtype and the
  int8 weight is widened inside the kernel. Decoding one row is bound by reading the weights, so half
  the bytes of bf16 is up to 2x faster.
- W8A8 (`quantization="w8a8"`): each activation row is quantized to int8 with its own scale
  (x[m, k] ~ xq[m, k] * t[m]) and the product runs on int8 dot products (VNNI), accumulating exactly
  in int32: y[m, n] = t[m] * s[n] * sum_k xq[m, k] q[n, k]. Batched steps are bound by multiply rate,
  and int8 doubles it over bf16. It is lossier (activations lose precision too).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenmill.layers.linear import (LinearMethod, LoadContext, DecodeRowsKernel, UnquantizedLinearMethod, add_param,
                                     kernel_rows, linear_in, matmul_dtype, padded_rows)
from tokenmill.ops import cpu_qgemm_amx, cpu_qgemv, cpu_w8a8, native, triton_quant
from tokenmill.quantization.awq_format import quantize_w8
from tokenmill.quantization.config import QuantizationConfig

# Up to this many rows the GEMV kernels read each weight line once for all rows; above it the weight is
# dequantized once per call and a dense GEMM runs, which larger batches amortize (benchmarks/bench_qkernels.py).


def qlinear_available() -> bool:
    return hasattr(torch.ops, "onednn") and hasattr(torch.ops.onednn, "qlinear_prepack") and \
        torch.backends.mkldnn.is_available()


def activation_qmax() -> int:
    """Largest activation code. With VNNI (or AMX) oneDNN's int8 GEMM accumulates u8 x s8 products in int32:
    full 8-bit activations. Without it (AVX2) it sums pairs of them in int16 (vpmaddubsw), which saturates
    past 32767; 7-bit activations (|x| <= 63, as PyTorch's fbgemm `reduce_range` does there) keep every pair
    sum below it, so the product stays exact and equal to the twin."""
    return 127 if {"avx512_vnni", "avx_vnni", "amx_int8"} & native.cpu_flags() else 63


def signed_activations() -> bool:
    """AMX multiplies s8 x s8 in hardware, and oneDNN's AMX int8 GEMM takes signed activations as they are
    (~15 % faster at 32 rows than unsigned ones with a zero point, which need a compensation term). VNNI
    alone multiplies only u8 x s8: there oneDNN runs signed activations through a reference kernel that
    is over 100x slower, so they go in unsigned, shifted by a zero point."""
    return "amx_int8" in native.cpu_flags()


def quantize_rows(x: torch.Tensor, qmax: int = 127) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row symmetric int8 with codes in [-qmax, qmax]: x [M, K] -> (xq int8 [M, K], t float32 [M])."""
    xf = x.float()
    t = xf.abs().amax(-1).clamp(min=1e-8) / qmax
    return (xf / t[:, None]).round_().clamp_(-qmax, qmax).to(torch.int8), t


def w8a8_linear_ref(x, qweight, scales, bias=None, qmax: int = 127):
    """The pure-torch twin of the W8A8 product (exact int32 accumulation)."""
    xq, t = quantize_rows(x, qmax)
    acc = (xq.to(torch.int32) @ qweight.to(torch.int32).t()).float()
    y = acc * t[:, None] * scales.float()[None, :]
    return (y if bias is None else y + bias.float()).to(x.dtype)


def amx_rows_kernel(dtype: torch.dtype, n: int, k: int, group_size: int | None = None) -> bool:
    """Whether a weight-only layer's bfloat16 steps above the GEMVs' rows take the AMX-BF16 GEMM
    (ops/cpu_qgemm_amx.c) instead of dequantizing the weight per call. It beats the few-row GEMVs from about
    4 rows on (16 rows of a 4864 x 896 layer: 180 us against 800 for int4), so those then stop at
    cpu_qgemm_amx.GEMV_ROWS."""
    return dtype == torch.bfloat16 and cpu_qgemm_amx.available() and cpu_qgemm_amx.supports(n, k, group_size)


def choose_weight_only_kernels(layer, dtype: torch.dtype, n: int, k: int, group_size: int | None = None,
                               panels: bool = True) -> None:
    """A weight-only layer's CPU kernels by rows: `layer.amx_gemm` (the AMX GEMM above the GEMVs) and
    `layer.kernel_rows` (up to how many rows the GEMVs take). `panels`: whether the layer holds GEMV panels."""
    layer.amx_gemm = panels and amx_rows_kernel(dtype, n, k, group_size)
    int4 = group_size is not None
    layer.kernel_rows = (cpu_qgemm_amx.GEMV_ROWS if layer.amx_gemm
                         else kernel_rows(dtype, weight_only_quantized=True, int4=int4))


def w8a16_linear_ref(x, qweight, scales, bias=None):
    """The pure-torch twin of the W8A16 product: the dequantized float weight, in float32."""
    w = qweight.float() * scales.float()[:, None]
    return F.linear(x.float(), w, None if bias is None else bias.float()).to(x.dtype)


class Int8LinearMethod(LinearMethod):
    def __init__(self, from_checkpoint: bool, activations: bool):
        self.from_checkpoint, self.activations = from_checkpoint, activations

    def create_weights(self, layer, in_features, out_features, dtype):
        if self.from_checkpoint:  # tokenmill-w8: qweight int8 [N, K], scales fp16 [N]
            add_param(layer, "qweight", torch.empty(out_features, in_features, dtype=torch.int8), output_dim=0,
                      input_dim=1)
            add_param(layer, "scales", torch.empty(out_features, dtype=torch.float16), output_dim=0)
        else:
            add_param(layer, "weight", torch.empty(out_features, in_features, dtype=dtype), output_dim=0, input_dim=1)

    def process_after_loading(self, layer, ctx: LoadContext):
        if self.from_checkpoint:
            q, s = layer.qweight.data, layer.scales.data
            del layer.qweight, layer.scales
        else:
            w, tp = layer.weight.data, getattr(layer, "reduce_over", None)
            # a row-parallel shard holds part of each row: the scale is the whole row's, as one process has it
            amax = None if tp is None else tp.all_max(w.float().abs().amax(-1))
            q, s = quantize_w8(w, amax=amax)
            del layer.weight
        n, k = q.shape
        fast = ctx.device == "cpu" and ctx.cpu_kernel != "torch"
        layer.register_buffer("wscale", s.float(), persistent=False)
        layer.bias_f32 = None if layer.bias is None else layer.bias.data.float()
        # One copy of the codes: the GEMV panels (W8A16) or the AMX tiles (W8A8) where those kernels run, else [N, K]
        layer.gemv_panels = fast and not self.activations and cpu_qgemv.available() and cpu_qgemv.supports(n, k)
        amx = fast and self.activations and ctx.dtype in cpu_w8a8.DTYPES and cpu_w8a8.amx_available() and \
            cpu_w8a8.amx_supports(n, k)
        layer.amx_panels = None
        if amx:  # our AMX GEMM (ops/cpu_w8a8.c): prefetched weight stream, both scales in its epilogue
            layer.amx_panels, codes = cpu_w8a8.pack_amx(q), torch.empty(0, dtype=torch.int8)
        elif layer.gemv_panels:
            codes = cpu_qgemv.pack_int8(q)
        else:
            codes = q.contiguous()
        layer.register_buffer("qweight", codes, persistent=False)
        choose_weight_only_kernels(layer, ctx.dtype, n, k, panels=layer.gemv_panels)
        layer.qlinear = None
        if fast and self.activations and not amx and qlinear_available():
            # oneDNN's VNNI int8 GEMM on a weight reordered once; the row scales are applied after it
            layer.qlinear = torch.ops.onednn.qlinear_prepack(q, [32, k])
            layer.register_buffer("zero_points", torch.zeros(n, dtype=torch.int64), persistent=False)
        # torch._int_mm: oneDNN's on a CPU, cuBLAS's int8 GEMM (twice the bf16 rate) on a GPU, which has no
        # int32 matmul to fall back on
        layer.use_int_mm = self.activations and (fast or (ctx.device == "cuda" and k % 8 == 0 and n % 8 == 0))
        layer.triton = ctx.device == "cuda" and not self.activations and triton_quant.available()
        layer.act_qmax = activation_qmax()  # the same on every kernel path, so the twin stays exact
        layer.act_zero_point = 0 if signed_activations() else layer.act_qmax + 1

    def codes(self, layer) -> torch.Tensor:
        """int8 [N, K], whichever layout is stored."""
        if layer.amx_panels is not None:
            return cpu_w8a8.unpack_amx(layer.amx_panels)
        return cpu_qgemv.unpack_int8(layer.qweight) if layer.gemv_panels else layer.qweight

    def apply(self, layer, x):
        if self.activations:
            return self._w8a8(layer, x)
        if layer.triton:
            return triton_quant.int8_gemm(x, layer.qweight, layer.wscale, layer.bias)
        if layer.gemv_panels and x.shape[0] <= layer.kernel_rows:
            return cpu_qgemv.gemv_int8(x, layer.qweight, layer.wscale, layer.bias_f32)
        if layer.amx_gemm and x.dtype == torch.bfloat16:
            return cpu_qgemm_amx.gemm_int8(x, layer.qweight, layer.wscale, layer.bias_f32)
        if layer.gemv_panels:
            return linear_in(x, cpu_qgemv.dequant_int8(layer.qweight, layer.wscale, matmul_dtype(x)), layer.bias)
        return w8a16_linear_ref(x, self.codes(layer), layer.wscale, layer.bias)

    def decode_rows_kernel(self, layer):
        if self.activations or layer.triton or not layer.gemv_panels:
            return None
        return DecodeRowsKernel("s8", layer.qweight, layer.out_features, layer.in_features, layer.bias_f32,
                                scales=layer.wscale, max_rows=layer.kernel_rows)

    def _w8a8(self, layer, x):
        qmax = layer.act_qmax
        if layer.amx_panels is not None and cpu_w8a8.usable(x):
            xq, t = cpu_w8a8.quantize_rows_u8(x, cpu_w8a8.amx_rows(x.shape[0]), qmax, 0)
            return cpu_w8a8.w8a8_amx(xq.view(torch.int8), t, layer.amx_panels, layer.wscale, layer.bias_f32, x.dtype)
        if layer.qlinear is not None:
            m = x.shape[0]
            rows = padded_rows(m)  # a bounded set of shapes for oneDNN's primitive cache
            zp = layer.act_zero_point  # unsigned codes xq + zp where the GEMM wants them (signed_activations)
            fused = cpu_w8a8.usable(x)
            if fused:
                xa, t = cpu_w8a8.quantize_rows_u8(x, rows, qmax, zp)
            else:
                xq, t = quantize_rows(x, qmax)
                xa = F.pad(xq, (0, 0, 0, rows - m)).view(torch.uint8).add_(zp)  # wrapping uint8 adds
            if zp == 0:
                xa = xa.view(torch.int8)
            y = torch.ops.onednn.qlinear_pointwise(xa, 1.0, zp, layer.qlinear, layer.wscale, layer.zero_points, None,
                                                   1.0, 0, torch.float32, "none", [None], "")
            if fused:
                return cpu_w8a8.rescale_rows(y, t, layer.bias_f32, x.dtype)
            y = y[:m].mul_(t[:, None])
        else:
            xq, t = quantize_rows(x, qmax)
            y = int_matmul(xq, self.codes(layer), layer.use_int_mm).float().mul_(t[:, None]).mul_(layer.wscale[None, :])
        if layer.bias is not None:
            y += layer.bias.float()
        return y.to(x.dtype)

    def dense_weight(self, layer):
        return self.codes(layer).float() * layer.wscale[:, None]


NO_INT32_MATMUL = {"cuda"}  # devices without an int32 matmul (the tests add "cpu" to reach the float64 path)


def int_matmul(xq: torch.Tensor, q: torch.Tensor, use_int_mm: bool) -> torch.Tensor:
    """int8 [M, K] @ int8 [N, K].T, exact, as int32 [M, N] (float32 on a GPU without torch._int_mm)."""
    if use_int_mm and xq.is_cuda and xq.shape[0] <= 16:  # cuBLAS's int8 GEMM takes more than 16 rows
        return torch._int_mm(F.pad(xq, (0, 0, 0, 17 + (-17 % 8) - xq.shape[0])), q.t())[:xq.shape[0]]
    if use_int_mm:
        return torch._int_mm(xq, q.t())
    if xq.device.type in NO_INT32_MATMUL:  # shapes cuBLAS's int8 GEMM refuses (K or N not a multiple of 8):
        # float64 holds every sum of K int8 products exactly (K x 127 x 128 < 2^53)
        return (xq.double() @ q.double().t()).float()
    return xq.to(torch.int32) @ q.to(torch.int32).t()


class Int8Config(QuantizationConfig):
    """Load-time int8 of a float checkpoint (`from_checkpoint=False`), or tokenmill's 8-bit AWQ format."""

    def __init__(self, activations: bool = False, from_checkpoint: bool = False,
                 skip: tuple[str, ...] = ("lm_head",)):
        self.name = "w8a8" if activations else "int8"
        self.activations, self.from_checkpoint, self.skip = activations, from_checkpoint, skip

    def linear_method(self, prefix):
        if any(s and s in prefix for s in self.skip):
            return UnquantizedLinearMethod()
        return Int8LinearMethod(self.from_checkpoint, self.activations)
