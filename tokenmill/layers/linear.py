"""Linear layers and the linear-method seam (vLLM's LinearMethodBase).

A `Linear` owns a `LinearMethod` that decides how its weights are held: the method creates the
parameters, loads checkpoint shards into them, processes them once after loading (repacking,
quantizing) and applies them. The model code only sees `Linear(x)`, and the loader only sees parameters
with a `weight_loader`, so a quantized checkpoint (`qweight`, `qzeros`, `scales`) or a tensor-parallel
shard goes through the same code as a plain float `weight`.

Parameters carry four attributes for the shard logic:
    output_dim   which dim of the parameter runs over output features (None: not sharded)
    pack_factor  output features per element along that dim (8 for AutoAWQ's int32 nibble packing)
    input_dim    which dim runs over input features (None: the parameter spans all of them)
    input_pack   input features per element along it (the group size for AWQ's scales and zeros)
so the q/k/v slices of a merged [q | k | v] projection land at offset // pack_factor in every parameter,
and a tensor-parallel rank cuts its part out of each checkpoint tensor the same way, whatever the method:

    column-parallel (qkv, gate_up, lm_head): rank r holds output rows [start_r, start_r + n_local) of each
        shard; its matmul gives its slice of the output, no communication.
    row-parallel (o_proj, down_proj): rank r holds input columns [r * k_local, (r + 1) * k_local); it
        multiplies its slice of the input (a column-parallel output) and one all-reduce sums the parts.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.distributed.comm import SINGLE, TensorParallel
from tokenmill.ops import cpu_gemv, native


WIDEN_MIN_ROWS = 4  # bfloat16 F.linear is faster below this many rows on AVX2 (BENCHMARKS.md, issue 15)


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
    """Copy a checkpoint tensor in: floats cast to the parameter's dtype; integers (quantized codes, bit
    patterns) only into their own dtype, and never from floats or into them."""
    if param.shape != loaded.shape:
        raise ValueError(f"shape mismatch: parameter {tuple(param.shape)} vs checkpoint {tuple(loaded.shape)}")
    if not (param.dtype.is_floating_point and loaded.dtype.is_floating_point) and param.dtype != loaded.dtype:
        raise ValueError(f"dtype mismatch: parameter {param.dtype} vs checkpoint {loaded.dtype}")
    param.data.copy_(loaded)


def padded_rows(m: int) -> int:
    """The row count oneDNN sees for `m` input rows. It builds, and keeps in two LRU caches of 1024 entries
    (oneDNN's and ideep's), a JIT-compiled primitive per input shape, about 0.5 MB each: with every prefill
    size its own shape, the engine core's memory crept up for thousands of requests. Up to 32 rows (decode
    batches) stay exact; larger counts round up to 8 sizes per power of two (at most 12.5 % padding), so a
    2048-token budget needs at most 80 shapes per weight."""
    if m <= 32:
        return m
    step = 1 << (m.bit_length() - 4)
    return -(-m // step) * step


@functools.cache
def onednn_linear_available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether oneDNN can pack weights of `dtype` here: its bf16 path needs AVX512 (or AVX-NE-CONVERT), so an
    AVX2-only CPU takes F.linear for bfloat16 instead of failing at load. Decided once per dtype (`linear_in` asks
    on every call)."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=dtype), 1)
        return True
    except RuntimeError:
        return False


def matmul_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype to multiply `x` in, on CPU, against a weight made for this call (widened or dequantized): without
    oneDNN's bf16 GEMM (AVX2 CPUs) torch's bf16 matmul is 5-7x slower than float32 at prefill sizes, so bfloat16
    rows are multiplied in float32 there."""
    if x.dtype == torch.bfloat16 and x.device.type == "cpu" and slow_bf16_gemm():
        return torch.float32
    return x.dtype


@functools.cache
def slow_bf16_gemm() -> bool:
    """Whether this CPU lacks oneDNN's bf16 GEMM (AVX2), where torch's bf16 matmul is slow: decided once."""
    return not onednn_linear_available(torch.bfloat16)


def linear_in(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x W^T + b computed in w's dtype (from `matmul_dtype`), returned in x's. A float32 weight made for this call
    (widened or dequantized) goes to oneDNN's GEMM where it can, unpacked: `F.linear` takes MKL's sgemm, which on
    an AVX2 AMD EPYC was 1.6-1.8x slower for a layer at 128 rows (BENCHMARKS.md, "On a second AVX2 CPU")."""
    b = None if bias is None else bias.to(w.dtype)
    xw = x if w.dtype == x.dtype else x.to(w.dtype)
    if w.dtype == torch.float32 and x.dim() == 2 and x.device.type == "cpu" and onednn_linear_available():
        y = onednn_linear(xw.contiguous(), w, b)
    else:
        y = F.linear(xw, w, b)
    return y if y.dtype == x.dtype else y.to(x.dtype)


def onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    m = x.shape[0]
    rows = padded_rows(m) if x.dim() == 2 else m
    if rows != m:
        x = F.pad(x, (0, 0, 0, rows - m))
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")[:m]


@dataclass(frozen=True)
class LoadContext:
    """What `process_after_loading` may need to know about the whole load."""

    device: str
    dtype: torch.dtype
    cpu_kernel: str = "torch"  # the resolved cpu_linear_kernel for unquantized layers (models/loader.py)


@dataclass(frozen=True)
class DecodeRowsKernel:
    """The C kernels a Linear's `apply` runs on CPU for one row and for up to `max_rows` rows (in chunks of 8),
    with their operands, so that the fused decode step (ops/cpu_decode.py) can call the same kernels without
    Python in between. kind: "f32" / "bf16" (ops/cpu_gemv.c: GEMV, gemm_rows; bias in the weights' dtype), "s8" /
    "u4" (ops/cpu_qgemv.c; bias float32)."""

    kind: str
    weight: torch.Tensor
    out_features: int
    in_features: int
    bias: torch.Tensor | None = None
    scales: torch.Tensor | None = None
    zeros: torch.Tensor | None = None
    group_size: int = 0
    max_rows: int = cpu_gemv.MAX_ROWS


INT4_AVX2_KERNEL_ROWS = 512
INT4_AVX512_KERNEL_ROWS = 512
INT8_AVX512_KERNEL_ROWS = 512
BF16_AVX2_KERNEL_ROWS = 128
F32_AVX2_KERNEL_ROWS = 32
F32_AVX512_KERNEL_ROWS = 16


def kernel_rows(dtype: torch.dtype, weight_only_quantized: bool = False, int4: bool = False) -> int:
    """Up to how many rows a CPU linear takes the few-row C kernels, each chunk of 8 rows reading the weights
    once. Where torch has no fast bf16 GEMM (AVX2), bfloat16 layers take them up to BF16_AVX2_KERNEL_ROWS: at
    Qwen2.5-0.5B's MLP shape 4.0 ms against 6.1 ms for the weight widened to float32 per call at 64 rows, and a
    whole layer 36-37 ms against 44-46 ms (widened, then oneDNN) at 128 rows; they tie at 256 (BENCHMARKS.md, issue 14).
    Weight-only quantized layers take them up to 32 rows everywhere, since their other path dequantizes the
    whole weight per call: at batch 32 (128 + 128 tokens) int8 + int8 head ran 48.3 s with 8 and 22.1 s with
    32, AWQ + int8 head 43.9 and 26.3 s (AMX machine, BENCHMARKS.md). Where the AMX-BF16 GEMM takes their
    bfloat16 steps instead (quantization/int8.py choose_weight_only_kernels), they stop at 4. Without a fast bf16
    GEMM, int4 (AWQ) layers take them up to INT4_AVX2_KERNEL_ROWS: dequantizing writes 8x the int4 bytes as
    float32 per call, and at 128 rows a Qwen2.5-0.5B layer's four int4 linears took 38 ms in chunks against 61 ms
    dequantized (AVX2 EPYC; BENCHMARKS.md, "On a second AVX2 CPU"). int8 stays at 64 there: at 128 rows its chunks
    tie with dequantizing. Float32 layers on CPUs without AVX-512 take them up to F32_AVX2_KERNEL_ROWS: on a Zen 3
    EPYC they beat oneDNN's packed GEMM 1.2-2.3x at 9-20 rows and tie at 32, for the shipped model's shapes and
    Qwen2.5-0.5B's (`benchmarks/bench_float_rows.py`; BENCHMARKS.md, issue 15, "Greedy steps with the LM head and
    argmax in the one call, and float32 steps of up to 32 rows"). With AVX-512 they take them up to
    F32_AVX512_KERNEL_ROWS: on a Zen 4 EPYC the kernel beat oneDNN 1.3-2.8x at 9-32 rows on the shipped model's
    shapes and tied or won at up to 16 on Qwen2.5-0.5B's, where its 9728 x 896 gate/up lost 15-20 % at 24-32
    (BENCHMARKS.md, issue 16, "n-gram at k = 8: verifications of up to 16 rows in the one call"). Weight-only
    bfloat16 layers with AVX-512 (and no AMX GEMM) take them up to INT4_AVX512_KERNEL_ROWS (AWQ) or
    INT8_AVX512_KERNEL_ROWS (int8): on a Zen 4 EPYC at Qwen2.5-0.5B's 4864 x 896, chunks of 8 rows beat
    dequantizing + oneDNN 1.7x at 128 rows for both, 1.3x (int4) and 1.2x (int8) at 256, and tied at 512 (int4)
    or lost 10 % there (int8), so a 128-token prompt's prefill stays on the kernels (BENCHMARKS.md, issue 14,
    "Weight-only prefill on the kernels"); since their dot products went to asm (session 24) int8 wins 1.26x at
    384 rows and 1.13-1.18x at 512, and ties at 768 ("VNNI dots in asm and one-row kernels")."""
    if dtype == torch.bfloat16 and slow_bf16_gemm():
        if int4:
            return INT4_AVX2_KERNEL_ROWS
        return 64 if weight_only_quantized else BF16_AVX2_KERNEL_ROWS
    if dtype == torch.float32 and not weight_only_quantized:
        return F32_AVX512_KERNEL_ROWS if "avx512f" in native.cpu_flags() else F32_AVX2_KERNEL_ROWS
    if weight_only_quantized and dtype == torch.bfloat16 and "avx512f" in native.cpu_flags():
        return INT4_AVX512_KERNEL_ROWS if int4 else INT8_AVX512_KERNEL_ROWS
    return 32 if weight_only_quantized else cpu_gemv.MAX_ROWS


class LinearMethod:
    """How one Linear holds and applies its weights. Subclasses create their parameters in
    `create_weights` with `output_dim` / `pack_factor` set; loading merged shards is shared here."""

    def create_weights(self, layer: "Linear", in_features: int, out_features: int, dtype: torch.dtype) -> None:
        raise NotImplementedError

    def load_weight(self, layer: "Linear", param: torch.Tensor, loaded: torch.Tensor, shard_id: str | None) -> None:
        target = param.data
        if shard_id is not None:
            off, size = layer.offsets[shard_id]
            dim, pack = getattr(param, "output_dim", None), getattr(param, "pack_factor", 1)
            if dim is None:
                raise ValueError(f"parameter of shape {tuple(param.shape)} cannot hold shard {shard_id!r}")
            target = target.narrow(dim, off // pack, size // pack)
        default_weight_loader(target, layer.checkpoint_slice(param, loaded, shard_id))

    def process_after_loading(self, layer: "Linear", ctx: LoadContext) -> None:
        pass

    def apply(self, layer: "Linear", x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def dense_weight(self, layer: "Linear") -> torch.Tensor:
        """The float W [N, K] this method computes with (tests and references compare against it)."""
        raise NotImplementedError

    def decode_rows_kernel(self, layer: "Linear") -> DecodeRowsKernel | None:
        """What `apply` runs for one to eight rows on CPU, when those are the C kernels; else None."""
        return None


def add_param(layer: nn.Module, name: str, tensor: torch.Tensor, output_dim: int | None, pack_factor: int = 1,
              loader=None, input_dim: int | None = None, input_pack: int = 1) -> nn.Parameter:
    p = nn.Parameter(tensor, requires_grad=False)
    p.output_dim, p.pack_factor = output_dim, pack_factor
    p.input_dim, p.input_pack = input_dim, input_pack
    if loader is not None:
        p.weight_loader = loader
    layer.register_parameter(name, p)
    return p


class UnquantizedLinearMethod(LinearMethod):
    """Float weights. On CPU the weight can be repacked once into oneDNN's blocked layout, whose GEMM
    streams weights much faster than `F.linear` for the few-row matrices of decoding, plus a second copy
    in the GEMV kernels' layout (ops/cpu_gemv.py), which serve one to eight rows (decode batches). Where oneDNN
    cannot pack the dtype (bfloat16 on AVX2-only CPUs), "torch+gemv" keeps the plain weight for F.linear and
    adds the GEMV copy."""

    def create_weights(self, layer, in_features, out_features, dtype):
        add_param(layer, "weight", torch.empty(out_features, in_features, dtype=dtype), output_dim=0, input_dim=1)

    def process_after_loading(self, layer, ctx):
        layer.packed = layer.gemv_packed = None
        layer.widen_rows = False
        if ctx.cpu_kernel == "torch":
            return
        if ctx.cpu_kernel in ("onednn+gemv", "torch+gemv") and cpu_gemv.supports(layer.weight):
            layer.gemv_packed = cpu_gemv.pack(layer.weight)
            layer.kernel_rows = kernel_rows(layer.weight.dtype)
        if ctx.cpu_kernel == "torch+gemv":
            # without oneDNN's bf16 GEMM (AVX2 CPUs) torch's bf16 matmul is 5-7x slower than float32 at prefill
            # sizes: widening the weight per call and multiplying in float32 pays from a few rows up
            layer.widen_rows = layer.weight.dtype == torch.bfloat16
            return
        # A weight shared with another module (tied embeddings) stays alive through that module.
        layer.packed = torch.ops.mkldnn._reorder_linear_weight(layer.weight.detach(), 1)
        layer.weight = None

    def apply(self, layer, x):
        packed = getattr(layer, "gemv_packed", None)
        if packed is not None and x.shape[0] <= layer.kernel_rows:  # a decode batch: each panel read once per 8 rows
            return (cpu_gemv.gemv if x.shape[0] == 1 else cpu_gemv.gemm_rows)(x, packed, layer.bias)
        if getattr(layer, "packed", None) is not None:
            return onednn_linear(x, layer.packed, layer.bias)
        if getattr(layer, "widen_rows", False) and x.shape[0] > WIDEN_MIN_ROWS:
            return linear_in(x, layer.weight.float(), layer.bias)
        return F.linear(x, layer.weight, layer.bias)

    def decode_rows_kernel(self, layer):
        packed = getattr(layer, "gemv_packed", None)
        if packed is None:
            return None
        kind = "bf16" if packed.dtype == torch.bfloat16 else "f32"
        return DecodeRowsKernel(kind, packed, layer.out_features, layer.in_features, layer.bias,
                                max_rows=layer.kernel_rows)

    def dense_weight(self, layer):
        if layer.weight is None:
            raise RuntimeError("the float weight was repacked; use cpu_linear_kernel='torch' to keep it")
        return layer.weight


class Linear(nn.Module):
    """y = x W^T + b, with W held by `method` (default: unquantized). `shards` names slices of the output
    dim, e.g. {"q": 2048, "k": 512, "v": 512} for a merged projection; each checkpoint tensor loads into
    its slice. `prefix` is the layer's name in the model (quantization configs skip layers by name).

    Sizes are this rank's. Tensor parallelism sets `out_starts` (where each shard's rows begin in the
    checkpoint tensor) or `in_start` (where the input columns begin), and `reduce_over` for the all-reduce
    of a row-parallel layer; the subclasses below compute them."""

    def __init__(self, in_features: int, out_features: int | None = None, bias: bool = False,
                 method: LinearMethod | None = None, shards: dict[str, int] | None = None, prefix: str = "",
                 out_starts: dict | None = None, in_start: int | None = None, reduce_over: TensorParallel | None = None):
        super().__init__()
        if shards is not None:
            out_features = sum(shards.values())
        self.in_features, self.out_features, self.prefix = in_features, out_features, prefix
        self.offsets, off = {}, 0
        for name, size in (shards or {}).items():
            self.offsets[name] = (off, size)
            off += size
        self.out_starts, self.in_start, self.reduce_over = out_starts, in_start, reduce_over
        self.method = method or UnquantizedLinearMethod()
        self.method.create_weights(self, in_features, out_features, torch.get_default_dtype())
        for p in self.parameters(recurse=False):
            p.weight_loader = self._load
        self.bias = add_param(self, "bias", torch.empty(out_features), 0, loader=self._load) if bias else None

    def checkpoint_slice(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: str | None) -> torch.Tensor:
        """This rank's part of a checkpoint tensor (all of it without tensor parallelism)."""
        dim = getattr(param, "output_dim", None)
        if self.out_starts is not None and dim is not None:
            pack = param.pack_factor
            size = self.offsets[shard_id][1] if shard_id is not None else self.out_features
            loaded = loaded.narrow(dim, self.out_starts[shard_id] // pack, size // pack)
        dim = getattr(param, "input_dim", None)
        if self.in_start is not None and dim is not None:
            pack = param.input_pack
            loaded = loaded.narrow(dim, self.in_start // pack, self.in_features // pack)
        return loaded

    def _load(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: str | None = None) -> None:
        self.method.load_weight(self, param, loaded, shard_id)

    def process_after_loading(self, ctx: LoadContext) -> None:
        self.method.process_after_loading(self, ctx)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.method.apply(self, x)
        return y if self.reduce_over is None else self.reduce_over.all_reduce(y)


class MergedLinear(Linear):
    """Several projections of the same input stacked along the output dim, e.g. [q | k | v]. With `tp`, each
    shard is split evenly over the ranks (column-parallel), unless `split` gives this rank's (size, start
    row in the checkpoint tensor) per shard (KV heads replicated over more ranks than there are heads)."""

    def __init__(self, in_features: int, shards: dict[str, int], bias: bool = False,
                 method: LinearMethod | None = None, prefix: str = "", tp: TensorParallel = SINGLE,
                 split: dict[str, tuple[int, int]] | None = None):
        if split is None:
            split = {}
            for name, size in shards.items():
                n = _split(size, tp, prefix)
                split[name] = (n, tp.rank * n)
        super().__init__(in_features, bias=bias, method=method, shards={k: n for k, (n, _) in split.items()},
                         prefix=prefix, out_starts={k: st for k, (_, st) in split.items()} if tp.size > 1 else None)


class ColumnParallelLinear(Linear):
    """Output features split over the TP ranks (the LM head: each rank scores its slice of the vocabulary)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, method: LinearMethod | None = None,
                 prefix: str = "", tp: TensorParallel = SINGLE):
        n = _split(out_features, tp, prefix)
        super().__init__(in_features, n, bias, method, prefix=prefix,
                         out_starts={None: tp.rank * n} if tp.size > 1 else None)


class RowParallelLinear(Linear):
    """Input features split over the TP ranks, the partial outputs summed by one all-reduce. The bias is
    added by rank 0 only, so the sum holds it once."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, method: LinearMethod | None = None,
                 prefix: str = "", tp: TensorParallel = SINGLE):
        k = _split(in_features, tp, prefix)
        sharded = tp.size > 1
        super().__init__(k, out_features, bias, method, prefix=prefix, in_start=tp.rank * k if sharded else None,
                         reduce_over=tp if sharded else None)
        self.tp_rank = tp.rank

    def process_after_loading(self, ctx: LoadContext) -> None:
        if self.bias is not None and self.tp_rank != 0:
            self.bias.data.zero_()
        super().process_after_loading(ctx)


def _split(size: int, tp: TensorParallel, prefix: str) -> int:
    if size % tp.size:
        raise ValueError(f"{prefix or 'linear layer'}: {size} features do not split over {tp.size} ranks")
    return size // tp.size
