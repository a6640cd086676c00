"""AutoAWQ checkpoints packed by autoawq's own code (`WQLinear_GEMM.from_linear`), independently of
tokenmill's unpacking. autoawq's package __init__ pulls in its whole quantizer stack (datasets, ...),
so only its linear-layer module is imported, under a bare package entry."""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import types

import torch
from safetensors.torch import load_file, save_file

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def autoawq_linear_class():
    if "awq" not in sys.modules:
        spec = importlib.util.find_spec("awq")
        if spec is None:
            return None
        pkg = types.ModuleType("awq")
        pkg.__path__ = list(spec.submodule_search_locations)
        sys.modules["awq"] = pkg
    from awq.modules.linear.gemm import WQLinear_GEMM

    return WQLinear_GEMM


def rtn_scales_zeros(w: torch.Tensor, group: int):
    """Asymmetric 4-bit round-to-nearest parameters, [K/G, N] each (AutoAWQ's shapes)."""
    n, k = w.shape
    wg = w.float().view(n, k // group, group)
    hi, lo = wg.amax(-1), wg.amin(-1)
    s = ((hi - lo).clamp(min=1e-5) / 15).half().float()
    z = (-lo / s).round().clamp(0, 15)
    return s.t().contiguous(), z.t().contiguous()


def write_autoawq_checkpoint(src: str, dst: str, group: int, config_overrides: dict | None = None,
                             drop: tuple[str, ...] = (), keep_float: tuple[str, ...] = ()) -> str:
    """Quantize `src`'s linear layers with RTN and pack them with autoawq into `dst`; also write the
    dequantized float model (what the checkpoint means) to `dst`-float. Returns that float directory.
    `keep_float`: module names left in float and listed in modules_to_not_convert (AutoAWQ's)."""
    WQLinear_GEMM = autoawq_linear_class()
    sd = load_file(os.path.join(src, "model.safetensors"))
    qsd, fsd = {}, {}
    for name, t in sd.items():
        parts = name.split(".")
        if len(parts) > 2 and parts[-2] in LINEARS and parts[-1] == "weight" \
                and not any(k in name for k in keep_float):
            base = name[: -len(".weight")]
            s, z = rtn_scales_zeros(t, group)
            n, k = t.shape
            # from_linear rounds (w + z s) / s without clamping: feed it the weights already on the grid
            w_grid = ((torch.round(t.float().t() / s.repeat_interleave(group, 0)) +
                       z.repeat_interleave(group, 0)).clamp(0, 15) - z.repeat_interleave(group, 0)) \
                * s.repeat_interleave(group, 0)
            lin = torch.nn.Linear(k, n, bias=False)
            lin.weight.data = w_grid.t().contiguous()
            q = WQLinear_GEMM.from_linear(lin, 4, group, scales=s, zeros=z)
            qsd[base + ".qweight"], qsd[base + ".qzeros"], qsd[base + ".scales"] = q.qweight, q.qzeros, q.scales
            fsd[name] = lin.weight.data.clone()
        else:
            qsd[name] = fsd[name] = t
    for key in drop:
        qsd = {k: v for k, v in qsd.items() if not k.endswith(key)}
    float_dir = dst + "-float"
    for d in (dst, float_dir):
        shutil.copytree(src, d, dirs_exist_ok=True)
    save_file(qsd, os.path.join(dst, "model.safetensors"))
    save_file(fsd, os.path.join(float_dir, "model.safetensors"))
    with open(os.path.join(dst, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
                                  "version": "gemm", **({"modules_to_not_convert": list(keep_float)} if keep_float
                                                        else {}), **(config_overrides or {})}
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    return float_dir
