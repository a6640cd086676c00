"""AutoAWQ "GEMM" checkpoint format (4-bit), as published on the hub, plus tokenmill's 8-bit AWQ format.

4-bit ("version": "gemm"), for a linear layer y = x W^T with W [N, K] and group size G:

    qweight  int32 [K, N/8]    8 nibbles per int32, packed along the output dim N
    qzeros   int32 [K/G, N/8]  zero points, packed the same way
    scales   fp16  [K/G, N]
    W[n, k] = (q[k, n] - z[k // G, n]) * s[k // G, n]

Within one int32, nibble i (bits 4i..4i+3) holds output column 8c + ORDER[i]:

    int32 c:  | bits 28-31 | 24-27 | 20-23 | 16-19 | 12-15 | 8-11 | 4-7 | 0-3 |
    column:   |   8c+7     | 8c+3  | 8c+6  | 8c+2  | 8c+5  | 8c+1 | 8c+4| 8c+0|

8-bit ("version": "tokenmill-w8"; AutoAWQ has no 8-bit format): AWQ scaling is folded into the float
weights as for 4-bit, then each output channel is quantized symmetrically to int8:

    qweight  int8 [N, K]
    scales   fp16 [N]          W[n, k] = q[n, k] * s[n]
"""
from __future__ import annotations

import torch

ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
SUPPORTED_GROUP_SIZES = (32, 64, 128)
VERSION_W4 = "gemm"
VERSION_W8 = "tokenmill-w8"


def pack_int4(values: torch.Tensor) -> torch.Tensor:
    """[R, N] integers in 0..15 -> int32 [R, N/8] in AutoAWQ's order."""
    r, n = values.shape
    if n % 8:
        raise ValueError(f"AWQ packing needs a multiple of 8 columns, got {n}")
    v = values.to(torch.int32).view(r, n // 8, 8)[:, :, list(ORDER)]
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=values.device)
    return (v << shifts).sum(-1, dtype=torch.int32)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, N/8] -> uint8 [R, N] in column order (the inverse of `pack_int4`)."""
    r, c = packed.shape
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    nibbles = (packed.unsqueeze(-1) >> shifts) & 0xF  # [R, C, 8], nibble i -> column ORDER[i]
    out = torch.empty_like(nibbles)
    out[:, :, list(ORDER)] = nibbles
    return out.view(r, c * 8).to(torch.uint8)


def dequantize_w4(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """AutoAWQ GEMM tensors -> float W [N, K] (the torch twin every int4 kernel is checked against)."""
    q = unpack_int4(qweight).to(torch.float32)                    # [K, N]
    z = unpack_int4(qzeros).to(torch.float32).repeat_interleave(group_size, 0)
    s = scales.to(torch.float32).repeat_interleave(group_size, 0)
    return ((q - z) * s).t().contiguous().to(dtype)


def dequantize_w8(qweight: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (qweight.to(torch.float32) * scales.to(torch.float32)[:, None]).to(dtype)


def grid_w4(weight: torch.Tensor, group_size: int, clip: torch.Tensor | None = None):
    """The unpacked numbers of `quantize_w4`: (q [N, K/G, G], zeros [N, K/G], scales [N, K/G]), float32
    (scales already rounded to fp16). `fake_w4` and `quantize_w4` both start here, so they agree exactly."""
    n, k = weight.shape
    w = weight.detach().to(torch.float32).view(n, k // group_size, group_size)
    hi, lo = w.amax(-1), w.amin(-1)
    if clip is not None:
        hi, lo = hi.clamp(max=clip), lo.clamp(min=-clip)
    scales = ((hi - lo).clamp(min=1e-5) / 15).to(torch.float16).to(torch.float32)
    zeros = (-lo / scales).round().clamp(0, 15)
    q = (w / scales[..., None] + zeros[..., None]).round().clamp(0, 15)
    return q, zeros, scales


def quantize_w4(weight: torch.Tensor, group_size: int, clip: torch.Tensor | None = None):
    """Round-to-nearest asymmetric 4-bit of float W [N, K] per group along K. `clip` [N, K/G] (optional)
    caps each group's absolute range (AWQ's clipping search). Returns (qweight, qzeros, scales)."""
    n, k = weight.shape
    q, zeros, scales = grid_w4(weight, group_size, clip)
    return (pack_int4(q.view(n, k).t()), pack_int4(zeros.t()), scales.t().contiguous().to(torch.float16))


def fake_w4(weight: torch.Tensor, group_size: int, clip: torch.Tensor | None = None) -> torch.Tensor:
    """dequantize_w4(*quantize_w4(W, G, clip), G), bit for bit, without packing (AWQ's searches call it often)."""
    q, zeros, scales = grid_w4(weight, group_size, clip)
    return ((q - zeros[..., None]) * scales[..., None]).view(weight.shape)


def quantize_w8(weight: torch.Tensor, clip: torch.Tensor | None = None, amax: torch.Tensor | None = None):
    """Symmetric per-output-channel int8 of float W [N, K]; `clip` [N] caps |W|; `amax` [N], where given, is each
    row's max |W| (over the whole row where W holds part of it: a row-parallel TP shard). Returns (qweight,
    scales)."""
    w = weight.detach().to(torch.float32)
    amax = w.abs().amax(-1) if amax is None else amax
    if clip is not None:
        amax = torch.minimum(amax, clip)
    scales = (amax.clamp(min=1e-8) / 127).to(torch.float16).to(torch.float32)
    q = (w / scales[:, None]).round().clamp(-127, 127).to(torch.int8)
    return q, scales.to(torch.float16)
