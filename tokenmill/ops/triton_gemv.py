"""Decode-row GEMVs for the GPU path that take the small op before them into their prologue, with twins.

    gemv(x, weight, bias=None)                        x [M, K] @ weight[N, K]^T (+ bias) -> [M, N]
    add_rmsnorm_gemv(x, residual, norm_weight, eps, weight, bias=None)
                                                      RMSNorm(x + residual) @ weight^T -> (y, x + residual)
    silu_mul_gemv(gate_up, weight, bias=None)         (silu(gate) * up) @ weight^T, gate_up [M, 2K] -> [M, N]

At batch 1 a Llama layer is four GEMVs and six small kernels (two add+RMSNorms, rotary and the KV write,
attention, SiLU-and-mul); in a CUDA graph each small kernel still costs a few microseconds of launch and
ramp, about a quarter of the 8B shape's step beyond the HBM roofline (BENCHMARKS.md, issue 15). These
fold the norms and SiLU-and-mul into the GEMV that reads their output: each program recomputes the row
it needs from L2, which costs far less than a launch. M <= MAX_ROWS; float32, float16 or bfloat16, one
dtype for all operands; weights [N, K] with a contiguous last dimension (rows of x may be strided).

The twins (`*_ref`) compute what layers/norm.py, layers/activation.py and F.linear compute, rounding
where they round; they are the tests' oracle. The Llama layers take them for steps of at most 8 rows when
TOKENMILL_TRITON_GEMV=1 (off by default: `benchmarks/gpu_check.py`, sections `gemv_fusion` and
`decode_profile`, times them against cuBLAS after the separate small kernels, which decides the default).
On CPU the kernel runs only under Triton's interpreter (TRITON_INTERPRET=1). No host-device syncs.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.nn.functional as F

from tokenmill.ops import triton_lazy as triton  # cdiv, next_power_of_2; triton loads with the kernels
from tokenmill.ops.failure_latch import FailureLatch
from tokenmill.ops.triton_attention import _sm_count  # 132 (H100 / H200) off the GPU, as the planners there


ENABLE_ENV = "TOKENMILL_TRITON_GEMV"
MAX_ROWS = 8
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_TILE = 4096  # weight elements per K step: 32 float32 accumulators a thread at 4 warps (one row)
_STAT_TILE = 4096  # elements per step of the RMSNorm statistic loop (rows x columns)


_failure = FailureLatch("folded GEMVs failed (%s); the layers run the plain ops from now on")  # then enabled()
# is False for good


def enabled() -> bool:
    """TOKENMILL_TRITON_GEMV=1 and triton installed: the Llama layers fold their GEMVs (models/llama.py)."""
    return os.environ.get(ENABLE_ENV) == "1" and triton.installed() and not _failure


def give_up(error: Exception) -> None:
    """A layer's folded GEMV raised (a compile failure on this GPU, say: before it wrote anything): one warning,
    and every layer runs the plain ops from now on (a layer that already folds fails the same way, silently)."""
    _failure.trip(error)


def runs_on(x: torch.Tensor) -> bool:
    """The kernel runs on CUDA tensors, and on CPU ones under Triton's interpreter (the tests)."""
    return x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


@lru_cache(maxsize=1)
def _kernels():
    from tokenmill.ops import triton_gemv_kernels
    return triton_gemv_kernels


# ---------------------------------------------------------------- pure-torch twins (the oracle)

def gemv_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    y = x.float() @ weight.float().t()
    return (y if bias is None else y + bias.float()).to(x.dtype)


def add_rmsnorm_gemv_ref(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                         weight: torch.Tensor, bias: torch.Tensor | None = None):
    """layers/norm.py's RMSNorm.forward in torch, then gemv_ref."""
    if residual is not None:
        x = x + residual
    h = x.float()
    normed = norm_weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return gemv_ref(normed, weight, bias), (x if residual is not None else None)


def silu_mul_gemv_ref(gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    k = gate_up.shape[-1] // 2
    return gemv_ref(F.silu(gate_up[:, :k]) * gate_up[:, k:], weight, bias)


# ---------------------------------------------------------------- launch plan

@dataclass(frozen=True)
class GemvPlan:
    block_m: int  # 1 (one row: multiply-and-add), or 16 (2-8 rows padded to a tl.dot tile)
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int

    @property
    def use_dot(self) -> bool:
        return self.block_m > 1


def plan(m: int, n: int, k: int, sms: int, block_n: int | None = None, block_k: int | None = None,
         num_warps: int | None = None, num_stages: int | None = None) -> GemvPlan:
    """Column blocks small enough for at least two programs per SM (a GEMV is a stream of weight rows: the
    bytes in flight, not the arithmetic, set its speed), a weight tile of about _TILE elements, whatever
    the row count. The keyword arguments override each choice (the benchmark's sweep)."""
    block_m = 1 if m == 1 else 16
    floor = 16 if block_m > 1 else 4  # tl.dot tiles are at least 16 wide
    if block_n is None:
        block_n = 64
        while block_n > floor and triton.cdiv(n, block_n) < 2 * sms:
            block_n //= 2
    if block_k is None:
        block_k = max(16, min(512, _TILE // block_n, triton.next_power_of_2(k)))
    return GemvPlan(block_m, max(block_n, floor), max(block_k, 16), num_warps or 4, num_stages or 3)


def constexprs(p: GemvPlan, k: int, dtype: torch.dtype, interpreted: bool) -> dict:
    """The kernel's compile-time parameters for plan `p` (the launch and the compile tests share them)."""
    return dict(USE_DOT=p.use_dot, PRECISION="ieee" if dtype == torch.float32 else None,
                UPCAST_DOT=interpreted and p.use_dot and dtype == torch.bfloat16,  # the interpreter's bf16 dot
                BLOCK_M=p.block_m, BLOCK_N=p.block_n, BLOCK_K=p.block_k,
                STAT_BLOCK=max(16, min(triton.next_power_of_2(k), _STAT_TILE // p.block_m)),
                NUM_STAGES=p.num_stages)


# ---------------------------------------------------------------- the kernels

def _check(name: str, t: torch.Tensor, dtype: torch.dtype, device: torch.device, shape: tuple) -> None:
    if t.dtype != dtype:
        raise TypeError(f"{name} must be {dtype} like x, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device}")
    if tuple(t.shape) != shape or t.stride(-1) != 1:
        raise ValueError(f"{name} must be {list(shape)} with a contiguous last dimension, got "
                         f"{list(t.shape)} (strides {t.stride()})")


def _launch(prologue: int, x, residual, norm_weight, eps, weight, bias, k: int, tune: dict):
    if x.dtype not in DTYPES:
        raise TypeError(f"x must be one of {DTYPES}, got {x.dtype}")
    if x.dim() != 2 or not 0 < x.shape[0] <= MAX_ROWS:
        raise ValueError(f"x must be [M, features] with 1 <= M <= {MAX_ROWS}, got {list(x.shape)}")
    m, dev = x.shape[0], x.device
    if weight.dim() != 2:
        raise ValueError(f"weight must be [N, K], got {list(weight.shape)}")
    n = weight.shape[0]
    _check("x", x, x.dtype, dev, (m, x.shape[1]))
    _check("weight", weight, x.dtype, dev, (n, k))
    if bias is not None:
        _check("bias", bias, x.dtype, dev, (n,))
    if residual is not None:
        _check("residual", residual, x.dtype, dev, (m, k))
    if norm_weight is not None:
        _check("norm_weight", norm_weight, x.dtype, dev, (k,))
    p = plan(m, n, k, _sm_count(dev), **tune)
    y = torch.empty(m, n, dtype=x.dtype, device=dev)
    r_out = torch.empty(m, k, dtype=x.dtype, device=dev) if residual is not None else None
    kernels = _kernels()
    kernels.gemv_kernel[(triton.cdiv(n, p.block_n),)](
        x, x if residual is None else residual, y if r_out is None else r_out,
        x if norm_weight is None else norm_weight, weight, y if bias is None else bias, y, m, n, k, x.stride(0),
        0 if residual is None else residual.stride(0), 0 if r_out is None else r_out.stride(0), weight.stride(0),
        y.stride(0), float(eps), PROLOGUE=prologue, HAS_RESIDUAL=residual is not None, HAS_BIAS=bias is not None,
        **constexprs(p, k, x.dtype, kernels.INTERPRETED), num_warps=p.num_warps)
    return y, r_out


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, **tune) -> torch.Tensor:
    """x [M <= 8, K] @ weight [N, K]^T (+ bias [N]) -> [M, N] in x's dtype, accumulated in float32."""
    return _launch(0, x, None, None, 0.0, weight, bias, x.shape[-1], tune)[0]


def add_rmsnorm_gemv(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                     weight: torch.Tensor, bias: torch.Tensor | None = None, **tune):
    """(RMSNorm(x + residual) @ weight^T (+ bias), x + residual): layers/norm.py's RMSNorm with its residual,
    then the GEMV. The new residual is a new tensor (None without a residual); the inputs stay untouched."""
    return _launch(1, x, residual, norm_weight, eps, weight, bias, x.shape[-1], tune)


def silu_mul_gemv(gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  **tune) -> torch.Tensor:
    """(silu(gate) * up) @ weight^T (+ bias) for gate_up = [gate | up] [M, 2K] -> [M, N]."""
    if gate_up.dim() != 2 or gate_up.shape[-1] % 2:
        raise ValueError(f"gate_up must be [M, 2K], got {list(gate_up.shape)}")
    return _launch(2, gate_up, None, None, 0.0, weight, bias, gate_up.shape[-1] // 2, tune)[0]
