"""Dequantize-GEMM for the GPU path: y = x W^T with W stored as AutoAWQ int4 or tokenmill int8.

    awq_gemm(x, qweight, qzeros, scales, group_size)  AutoAWQ GEMM layout (qweight int32 [K, N/8],
                                                       qzeros int32 [K/G, N/8], scales fp16 [K/G, N])
    int8_gemm(x, qweight, scales)                      W8A16: qweight int8 [N, K], scales [N]

x is [..., K] in float16, bfloat16 or float32; y is [..., N] in x's dtype, accumulated in fp32. The
weights are dequantized tile by tile in registers (kernels in `triton_quant_kernels.py`). Two variants,
picked from M alone: "gemm" (tl.dot tiles, for prefill) and, for M <= SMALL_M, "gemv" (decode: at most
8 rows, a multiply-and-sum instead of a 16-row MMA tile, split-K so that a few rows still fill the GPU).
`variant=` and `split_k=` force a choice (tests cover both). No host-device syncs: every launch
parameter comes from shapes. The block sizes are first guesses, to be tuned on a GPU.

The pure-torch twins `awq_gemm_ref` / `int8_gemm_ref` (awq_format's dequantizers, then a float32
matmul) are the oracle. On CPU the kernels run only under Triton's interpreter (TRITON_INTERPRET=1,
set before this module's kernels are first used). The interpreter's tl.dot multiplies bfloat16 bit
patterns (triton-lang/triton#11584), so there a bf16 tile product goes in as fp32 (UPCAST_DOT).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache

import torch

from tokenmill.quantization.awq_format import SUPPORTED_GROUP_SIZES, dequantize_w4, dequantize_w8

from tokenmill.ops import triton_lazy as triton  # cdiv, next_power_of_2; triton loads with the kernels
from tokenmill.ops.failure_latch import FailureLatch

_failure = FailureLatch("Triton quantized GEMMs failed (%s); quantized layers dequantize and multiply in torch from "
                        "now on (slower, the same outputs)")
SMALL_M = 8
VARIANTS = ("gemm", "gemv")
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_W8_BLOCK_K = 64
_GEMV_BLOCK_K = 32  # divides every AWQ group size, so a K tile never straddles two groups
_MIN_TILES_PER_SPLIT = 4


def available() -> bool:
    """True when triton is importable and TOKENMILL_DISABLE_TRITON_QUANT is unset (on CPU the kernels then
    still need TRITON_INTERPRET=1). The quantized linear methods take these kernels on CUDA when this holds."""
    return triton.installed() and not os.environ.get("TOKENMILL_DISABLE_TRITON_QUANT")


@lru_cache(maxsize=1)
def _kernels():
    from tokenmill.ops import triton_quant_kernels
    return triton_quant_kernels


# ---------------------------------------------------------------- pure-torch twins (the oracle)

def _matmul_ref(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    y = x.float() @ w.t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def awq_gemm_ref(x, qweight, qzeros, scales, group_size: int, bias=None) -> torch.Tensor:
    return _matmul_ref(x, dequantize_w4(qweight, qzeros, scales, group_size), bias)


def int8_gemm_ref(x, qweight, scales, bias=None) -> torch.Tensor:
    return _matmul_ref(x, dequantize_w8(qweight, scales), bias)


# ---------------------------------------------------------------- launch planning (shapes only)

@dataclass(frozen=True)
class _Plan:
    use_dot: bool
    block_m: int
    block_n: int
    block_k: int
    split_k: int
    tiles_per_split: int
    num_warps: int

    def grid(self, m: int, n: int) -> tuple[int, int, int]:
        return (triton.cdiv(m, self.block_m), triton.cdiv(n, self.block_n), self.split_k)

    def constexprs(self, bits: int, group: int, dtype: torch.dtype, has_bias: bool, interpreted: bool) -> dict:
        return dict(BITS=bits, GROUP=group, HAS_BIAS=has_bias, USE_DOT=self.use_dot,
                    PRECISION="ieee" if dtype == torch.float32 else None,  # None: the target's default
                    UPCAST_DOT=interpreted and dtype == torch.bfloat16,
                    BLOCK_M=self.block_m, BLOCK_N=self.block_n, BLOCK_K=self.block_k)


@lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 8  # interpreter: any figure will do
    return torch.cuda.get_device_properties(device).multi_processor_count


def _split_k(programs: int, tiles: int, device: torch.device, forced: int | None) -> int:
    """K slices per output tile: enough programs for two waves, at least 4 K tiles per slice."""
    if forced is not None:
        return max(1, min(forced, tiles))
    wanted = triton.cdiv(2 * _sm_count(device), programs)
    return max(1, min(wanted, tiles // _MIN_TILES_PER_SPLIT))


def _plan(m: int, n: int, k: int, max_block_k: int, device: torch.device, variant: str | None,
          split_k: int | None) -> _Plan:
    variant = variant or ("gemv" if m <= SMALL_M else "gemm")
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS} or None, got {variant!r}")
    if variant == "gemm":
        bm, bn, bk, warps = min(64, max(16, triton.next_power_of_2(m))), 128, min(max_block_k, 64), 4
    else:
        bm, bn, bk, warps = triton.next_power_of_2(min(m, SMALL_M)), 64, _GEMV_BLOCK_K, 4
    tiles = triton.cdiv(k, bk)
    programs = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    if split_k is None and variant == "gemm":
        split_k = 1  # prefill tiles fill the GPU by themselves
    split = _split_k(programs, tiles, device, split_k)
    per_split = triton.cdiv(tiles, split)
    return _Plan(variant == "gemm", bm, bn, bk, triton.cdiv(tiles, per_split), per_split, warps)


# ---------------------------------------------------------------- public kernels

def _check_common(x: torch.Tensor, k: int, n: int, bias: torch.Tensor | None) -> None:
    if x.dtype not in DTYPES:
        raise TypeError(f"activations must be one of {DTYPES}, got {x.dtype}")
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} input features, the weight {k}")
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"bias must have shape ({n},), got {tuple(bias.shape)}")


def _launch(bits: int, x: torch.Tensor, qweight, qzeros, scales, bias, group: int, max_block_k: int,
            variant: str | None, split_k: int | None) -> torch.Tensor:
    if any(t is not None and t.device != x.device for t in (qweight, qzeros, scales, bias)):
        raise ValueError(f"weights, scales and bias must be on x's device ({x.device})")
    n = scales.shape[-1]
    x2 = x.reshape(-1, x.shape[-1])
    m, k = x2.shape
    if m == 0:
        return x.new_empty(*x.shape[:-1], n)
    if not _failure:
        try:
            plan = _plan(m, n, k, max_block_k, x.device, variant, split_k)
            kernels = _kernels()
            out = torch.empty(plan.split_k, m, n, device=x.device,
                              dtype=x.dtype if plan.split_k == 1 else torch.float32)
            kernels.qgemm_kernel[plan.grid(m, n)](
                x2, qweight, qzeros, scales, scales if bias is None else bias.contiguous(), out, m, n, k,
                x2.stride(0), x2.stride(1), plan.tiles_per_split, num_warps=plan.num_warps,
                **plan.constexprs(bits, group, x.dtype, bias is not None, kernels.INTERPRETED))
            y = out[0] if plan.split_k == 1 else out.sum(0).to(x.dtype)
            return y.view(*x.shape[:-1], n)
        except Exception as e:  # a compile failure on this GPU (before anything was written): the twin, for good
            _failure.trip(e)
    w = dequantize_w4(qweight, qzeros, scales, group) if bits == 4 else dequantize_w8(qweight, scales)
    return _matmul_ref(x2, w, bias).view(*x.shape[:-1], n)


def awq_gemm(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int,
             bias: torch.Tensor | None = None, *, variant: str | None = None,
             split_k: int | None = None) -> torch.Tensor:
    """x [..., K] @ dequantize_w4(...)^T (+ bias) -> [..., N] in x's dtype (AutoAWQ GEMM layout)."""
    k, n = qweight.shape[0], qweight.shape[1] * 8
    _check_common(x, k, n, bias)
    if group_size not in SUPPORTED_GROUP_SIZES or k % group_size:
        raise ValueError(f"group size must be one of {SUPPORTED_GROUP_SIZES} and divide K={k}, got {group_size}")
    if qweight.dtype != torch.int32 or tuple(qzeros.shape) != (k // group_size, n // 8) \
            or tuple(scales.shape) != (k // group_size, n):
        raise ValueError("expected qweight int32 [K, N/8], qzeros int32 [K/G, N/8], scales [K/G, N]")
    return _launch(4, x, qweight.contiguous(), qzeros.contiguous(), scales.contiguous(), bias, group_size,
                   group_size, variant, split_k)


def int8_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None, *,
              variant: str | None = None, split_k: int | None = None) -> torch.Tensor:
    """x [..., K] @ (qweight * scales[:, None])^T (+ bias) -> [..., N] in x's dtype; qweight int8 [N, K]."""
    n, k = qweight.shape
    _check_common(x, k, n, bias)
    if qweight.dtype != torch.int8 or tuple(scales.shape) != (n,):
        raise ValueError("expected qweight int8 [N, K] and scales [N]")
    qweight = qweight.contiguous()
    return _launch(8, x, qweight, qweight, scales.contiguous(), bias, 1, _W8_BLOCK_K, variant, split_k)
