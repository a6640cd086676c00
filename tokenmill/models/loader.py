"""Build a model from a local Hugging Face directory: safetensors (single or sharded) or dummy weights."""
from __future__ import annotations

import json
import logging
import os

import torch
from safetensors import SafetensorError, safe_open
from tqdm.auto import tqdm

from tokenmill.config import EngineConfig, ModelConfig
from tokenmill.distributed.comm import WHOLE_MODEL, ModelShard
from tokenmill.layers.linear import Linear, LoadContext, UnquantizedLinearMethod, onednn_linear_available
from tokenmill.ops import cpu_gemv
from tokenmill.models.registry import model_class
from tokenmill.quantization.registry import build_quant_config

logger = logging.getLogger("tokenmill")


def load_hf_config(path: str):
    from transformers import AutoConfig

    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"no config.json in model directory {path!r}")
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as e:  # transformers' own kinds (a bad JSON file, a field of the wrong type, ...)
        raise ValueError(f"{os.path.join(path, 'config.json')}: {type(e).__name__}: {e}") from e
    if getattr(config, "quantization_config", None) is None:
        config.quantization_config = _quantization_elsewhere(config, path)
    return config


# quantization settings kept outside config.json's quantization_config by older tools: (file, its method)
_QUANT_FILES = (("quant_config.json", "awq"), ("quantize_config.json", "gptq"))


def _quantization_elsewhere(config, path: str) -> dict | None:
    """llm-compressor's older `compression_config` key, AutoAWQ's older quant_config.json or AutoGPTQ's
    quantize_config.json: read as the checkpoint's quantization, so that it loads (AWQ) or is refused by name,
    never read as float weights."""
    older = getattr(config, "compression_config", None)
    if older is not None:
        return dict(older) if isinstance(older, dict) else older.to_dict()
    for name, method in _QUANT_FILES:
        file = os.path.join(path, name)
        if os.path.isfile(file):
            try:
                with open(file) as f:
                    settings = json.load(f)
            except ValueError as e:
                raise ValueError(f"{file}: not a JSON file ({e})") from e
            if not isinstance(settings, dict):
                raise ValueError(f"{file}: not a JSON object of quantization settings")
            return {"quant_method": method, **settings}
    return None


def safetensors_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index) as f:
                shards = sorted(set(json.load(f)["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{index}: not a safetensors index with a weight_map ({type(e).__name__}: {e})") from e
        missing = [s for s in shards if not os.path.isfile(os.path.join(path, s))]
        if missing:
            raise ValueError(f"safetensors shard(s) listed in the index are missing: {', '.join(missing)}")
        return [os.path.join(path, s) for s in shards]
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    raise ValueError(f"no model.safetensors or model.safetensors.index.json in {path!r} "
                     f"(use load_format='dummy' for random weights)")


def iterate_weights(files: list[str], show_progress: bool = True):
    """(name, tensor) for every tensor of the files; a corrupt or truncated file, or a name in two of them,
    is a ValueError naming the file."""
    handles = [(f, _read(f, safe_open, f, framework="pt")) for f in files]
    total = sum(len(h.keys()) for _, h in handles)
    seen = set()
    with tqdm(total=total, desc="Loading weights", unit="tensor", disable=not show_progress, leave=False) as bar:
        for f, h in handles:
            for name in h.keys():
                if name in seen:  # (which copy is right? the last would silently win)
                    raise ValueError(f"{f}: checkpoint tensor {name!r} is also in another file")
                seen.add(name)
                yield name, _read(f, h.get_tensor, name)
                bar.update(1)


def _read(file: str, fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except SafetensorError as e:
        raise ValueError(f"{file}: corrupt or truncated safetensors file ({e})") from e


def init_dummy_weights(model: torch.nn.Module, seed: int) -> None:
    """Small uniform values (vLLM's choice) keep activations finite for any shape; norms stay at 1. Values are
    drawn on the parameter's device (an 8B model's worth of CPU draws would take minutes)."""
    gens: dict[torch.device, torch.Generator] = {}
    for name, p in model.named_parameters():
        g = gens.get(p.device) or gens.setdefault(p.device, torch.Generator(device=p.device).manual_seed(seed))
        like = dict(dtype=torch.float32, device=p.device)
        if "norm" in name:
            p.data.fill_(1.0)
        elif not p.dtype.is_floating_point:  # quantized codes: any bit pattern is a valid weight
            info = torch.iinfo(p.dtype)
            p.data.copy_(torch.randint(info.min, info.max, p.shape, dtype=torch.int64, generator=g,
                                       device=p.device).to(p.dtype))
        elif name.endswith(".scales"):  # keep dequantized weights as small as the float ones
            p.data.copy_(torch.empty(p.shape, **like).uniform_(1e-5, 1e-4, generator=g))
        else:
            p.data.copy_(torch.empty(p.shape, **like).uniform_(-1e-3, 1e-3, generator=g))


def load_model(cfg: EngineConfig, mcfg: ModelConfig, dtype: torch.dtype, device: str,
               shard: ModelShard = WHOLE_MODEL):
    """The model, or this rank's shard of it (its TP slice of the layers of its pipeline stage)."""
    cls = model_class(mcfg.architecture)
    quant = build_quant_config(cfg.quantization, mcfg.hf_config, cfg.quantize_lm_head)
    extra = {}
    if getattr(cls, "is_multimodal", False):
        extra["encoder_quant"] = build_quant_config(cfg.mm_encoder_quantization, mcfg.hf_config)
    with torch.device(device):
        prev = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            model = cls(mcfg, dtype, cfg.max_model_len, quant, shard, **extra)
        finally:
            torch.set_default_dtype(prev)
    if cfg.load_format == "dummy":
        init_dummy_weights(model, cfg.seed)
    else:
        loaded = model.load_weights(iterate_weights(safetensors_files(cfg.model)))
        missing = {n for n, _ in model.named_parameters()} - loaded
        if missing:
            raise ValueError(f"checkpoint is missing weights: {', '.join(sorted(missing)[:5])}")
    ctx = LoadContext(device=device, dtype=dtype, cpu_kernel=cpu_linear_kernel(cfg, device, model, dtype))
    for m in model.modules():
        if isinstance(m, Linear):
            m.process_after_loading(ctx)
    for p in model.parameters():  # each loader is a bound method of its layer: a cycle that gc.freeze() (llm.py)
        p.__dict__.pop("weight_loader", None)  # would keep alive, weights and all, after the engine is gone
    return model.eval()


def cpu_linear_kernel(cfg: EngineConfig, device: str, model: torch.nn.Module, dtype: torch.dtype) -> str:
    """Which CPU GEMM path to prepare. For one row the GEMV kernel is used whenever it takes the weights:
    with oneDNN for more rows where oneDNN packs `dtype` ("onednn+gemv"), else with F.linear ("torch+gemv";
    oneDNN packs no bfloat16 on AVX2-only CPUs). The GEMV kernel keeps a second copy of every linear
    weight, so "auto" takes it only when that copy fits comfortably in free memory."""
    kind = cfg.cpu_linear_kernel
    if device != "cpu":
        return "torch"
    onednn = onednn_linear_available(dtype)
    gemv = dtype in cpu_gemv.DTYPES and cpu_gemv.available()
    if kind in ("onednn", "onednn+gemv") and not onednn:
        raise ValueError(f"cpu_linear_kernel={kind!r} needs a PyTorch build with oneDNN (mkldnn) that packs "
                         f"{dtype} weights on this CPU")
    if kind in ("onednn+gemv", "torch+gemv") and not gemv:
        raise ValueError(f"cpu_linear_kernel={kind!r} needs bfloat16 or float32 weights, an x86-64 CPU with "
                         "AVX2 and FMA, and gcc")
    if kind == "auto":
        extra = sum(m.weight.numel() * m.weight.element_size() for m in model.modules()
                    if isinstance(m, Linear) and isinstance(m.method, UnquantizedLinearMethod))
        use_gemv = gemv and extra < 0.25 * _available_memory()
        if onednn:
            return "onednn+gemv" if use_gemv else "onednn"
        return "torch+gemv" if use_gemv else "torch"
    return kind


def _available_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
