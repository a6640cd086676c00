"""The two searches of AWQ (Lin et al. 2023, as AutoAWQ implements them), on one decoder layer.

Scale search, per scaling group (a norm or linear `prev` feeding linears that share one input x):

    s(alpha) = x_mean ** alpha, then s /= sqrt(s.max() * s.min())      (x_mean = mean |x| per channel)
    loss(alpha) = MSE( block(x; W -> Q(W * s) / s),  block(x; W) )     alpha = 0, 1/n_grid, ... < 1

`Q(W*s)/s` applied to x equals `Q(W*s)` applied to `x/s`, so the search never touches `prev`. The winner
is folded: prev's weight (a norm) or output rows (a linear) divided by s, the linears' input columns
multiplied by s; alpha = 0 is s = 1, i.e. plain round-to-nearest, so the search never loses to it on
the calibration set.

Clip search, per linear (not q/k: their error passes through q.k^T, which a per-linear output MSE does
not see), on the scaled weights and the scaled inputs:

    for each output row n and input group g:   clip = max|W[n, g]| * (1 - i / n_grid), i < max_shrink * n_grid
    err(clip) = mean over tokens of ( x[:, g] . (Q_clip(W)[n, g] - W[n, g]) )^2      -> keep the best

Every candidate goes through the real quantizer (`Quantizer.fake`), so the searched numbers are
exactly what the checkpoint stores.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tokenmill.quantization.awq_format import dequantize_w4, dequantize_w8, fake_w4, quantize_w4, quantize_w8

TOKENS_PER_CHUNK = 16384  # tokens per forward call: bounds activation memory, keeps matmuls large


@dataclass(frozen=True)
class Quantizer:
    """4-bit: AutoAWQ GEMM groups of `group_size` along K; 8-bit: one symmetric scale per output row."""

    bits: int
    group_size: int

    def group(self, in_features: int) -> int:
        return self.group_size if self.bits == 4 else in_features

    def quantize(self, w: torch.Tensor, clip: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """clip: [N, K / group] (as `group` gives) or None."""
        if self.bits == 4:
            return dict(zip(("qweight", "qzeros", "scales"), quantize_w4(w, self.group_size, clip)))
        qweight, scales = quantize_w8(w, None if clip is None else clip[:, 0])
        return {"qweight": qweight, "scales": scales}

    def dequantize(self, t: dict[str, torch.Tensor]) -> torch.Tensor:
        if self.bits == 4:
            return dequantize_w4(t["qweight"], t["qzeros"], t["scales"], self.group_size)
        return dequantize_w8(t["qweight"], t["scales"])

    def fake(self, w: torch.Tensor, clip: torch.Tensor | None = None) -> torch.Tensor:
        """dequantize(quantize(w, clip)), exactly."""
        if self.bits == 4:
            return fake_w4(w, self.group_size, clip)
        return self.dequantize(self.quantize(w, clip))


def first_output(out):
    return out[0] if isinstance(out, tuple) else out


@torch.no_grad()
def run_chunked(module: nn.Module, x: torch.Tensor, kwargs: dict | None = None) -> torch.Tensor:
    """module(x[i:j], **kwargs) over sample chunks of x [N, L, ...], concatenated."""
    step = max(1, TOKENS_PER_CHUNK // x.shape[1])
    return torch.cat([first_output(module(x[i:i + step], **(kwargs or {}))) for i in range(0, len(x), step)])


@dataclass(frozen=True)
class ScaleGroup:
    """Linears sharing one input, the op whose output they read (`prev`), the block whose output MSE is
    measured (`inspect`; `kwargs` says it is the attention block, which needs the layer's kwargs)."""

    prev: str
    linears: tuple[str, ...]
    inspect: str
    kwargs: bool = False


def scale_groups(layer: nn.Module) -> list[ScaleGroup]:
    """AutoAWQ's groups for Llama/Mistral/Qwen2; v_proj -> o_proj only when v's output rows map one to
    one onto o's input columns (no GQA)."""
    groups = [ScaleGroup("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                         "self_attn", kwargs=True)]
    attn = layer.self_attn
    if attn.v_proj.weight.shape == attn.o_proj.weight.shape:
        groups.append(ScaleGroup("self_attn.v_proj", ("self_attn.o_proj",), "self_attn.o_proj"))
    groups.append(ScaleGroup("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj"), "mlp"))
    groups.append(ScaleGroup("mlp.up_proj", ("mlp.down_proj",), "mlp.down_proj"))
    return groups


def weight_mean(weights: list[torch.Tensor], group: int) -> torch.Tensor:
    """AutoAWQ's duo-scaling statistic: mean over output rows of |w| / (max |w| of its group), per input channel."""
    w = torch.cat(weights).abs()
    w = w.view(-1, group) / (w.view(-1, group).amax(1, keepdim=True) + 1e-6)
    return w.view(-1, weights[0].shape[1]).mean(0)


def candidate_scales(x_mean: torch.Tensor, alpha: float, w_mean: torch.Tensor | None = None) -> torch.Tensor:
    s = x_mean.pow(alpha)
    if w_mean is not None:
        s = s / (w_mean.pow(1 - alpha) + 1e-4)
    s = s.clamp(min=1e-4)
    s = s / (s.max() * s.min()).sqrt()
    return torch.where(torch.isfinite(s), s, torch.ones_like(s))


@torch.no_grad()
def search_scale(layer: nn.Module, group: ScaleGroup, x: torch.Tensor, kwargs: dict, quantizer: Quantizer,
                 n_grid: int = 20, duo: bool = False) -> tuple[torch.Tensor, float, float]:
    """Best s for `group` given its input x [N, L, K]. Returns (s, alpha, loss); the layer is left as it was."""
    block = layer.get_submodule(group.inspect)
    kw = kwargs if group.kwargs else None
    x_mean = x.abs().reshape(-1, x.shape[-1]).mean(0)
    ref = run_chunked(block, x, kw)
    linears = [layer.get_submodule(n) for n in group.linears]
    originals = [lin.weight.data for lin in linears]
    w_mean = weight_mean(originals, quantizer.group(x.shape[-1])) if duo else None
    best = (float("inf"), None, 0.0)
    for i in range(n_grid):
        s = candidate_scales(x_mean, i / n_grid, w_mean)
        for lin, w in zip(linears, originals):
            lin.weight.data = quantizer.fake(w * s) / s
        loss = (run_chunked(block, x, kw) - ref).pow(2).mean().item()
        if loss < best[0]:
            best = (loss, s, i / n_grid)
    for lin, w in zip(linears, originals):
        lin.weight.data = w
    return best[1], best[2], best[0]


@torch.no_grad()
def apply_scale(layer: nn.Module, group: ScaleGroup, s: torch.Tensor) -> None:
    """Fold 1/s into prev (norm weight, or a linear's last len(s) output rows and bias), s into the linears."""
    prev = layer.get_submodule(group.prev)
    if isinstance(prev, nn.Linear):
        prev.weight.data[-len(s):] /= s[:, None]
    else:
        prev.weight.data /= s
    if getattr(prev, "bias", None) is not None:
        prev.bias.data[-len(s):] /= s
    for name in group.linears:
        layer.get_submodule(name).weight.data *= s


@torch.no_grad()
def search_clip(w: torch.Tensor, x: torch.Tensor, quantizer: Quantizer, n_grid: int = 20,
                max_shrink: float = 0.5, n_tokens: int = 512, rows: int = 256) -> torch.Tensor:
    """Per (output row, input group) clip of W [N, K] for inputs x [..., K]; returns [N, K / group]."""
    n, k = w.shape
    g = quantizer.group(k)
    x = x.reshape(-1, k)
    # a fixed random subset: a stride would hit the same positions (e.g. every sample's bos) again and again
    pick = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))[:n_tokens]
    x = x[pick.sort().values].reshape(-1, k // g, g)                     # [T, groups, g]
    best = []
    for r in range(0, n, rows):
        wr = w[r:r + rows]
        amax = wr.abs().reshape(len(wr), k // g, g).amax(-1)            # [n, groups]
        best_err, best_clip = torch.full_like(amax, float("inf")), amax
        for i in range(int(max_shrink * n_grid)):
            clip = amax * (1 - i / n_grid)
            dw = (quantizer.fake(wr, clip) - wr).reshape(len(wr), k // g, g)
            err = torch.einsum("tjc,njc->ntj", x, dw).pow(2).mean(1)    # [n, groups]
            better = err < best_err
            best_err, best_clip = torch.where(better, err, best_err), torch.where(better, clip, best_clip)
        best.append(best_clip)
    return torch.cat(best)
