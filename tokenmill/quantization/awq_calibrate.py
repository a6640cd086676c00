"""`tokenmill quantize`: activation-aware weight quantization (AWQ) of a float Llama / Mistral / Qwen2
checkpoint, or plain round-to-nearest (RTN, the baseline) into the same format.

Algorithm (AWQ, method "awq"; the searches are in awq_search.py)
-----------------------------------------------------------------
The float model runs in transformers, float32, one decoder layer at a time:

    calibration text -> N samples x L tokens -> embeddings -> inputs of layer 0
    for each decoder layer:
        run the float layer, keeping the inputs of its linears (one tensor per scaling group)
        scale search per group (x_mean ** alpha, 20 alphas), fold the winners into the weights:
            input_layernorm          -> q, k, v        (MSE of the attention block's output)
            v_proj                   -> o_proj         (only without GQA, as AutoAWQ)
            post_attention_layernorm -> gate, up       (MSE of the MLP's output)
            up_proj                  -> down_proj      (MSE of down_proj's output)
        clip search per linear except q, k (max |w| per output row and group shrunk up to 50 %)
        quantize every linear, put its dequantized weight back into the layer
        run the quantized layer: its output is the next layer's input (errors do not hide)

Embeddings, the final norm and lm_head stay float. Memory: the float model plus one layer's
activations (N x L x width, a few tensors of it) at a time. RTN quantizes each linear as it is.

Output format (`--output DIR`)
------------------------------
    config.json              the source config plus "quantization_config" (below)
    model.safetensors        per quantized linear `P` (P = model.layers.{i}.self_attn.q_proj, ...):
                               4-bit: P.qweight int32 [K, N/8], P.qzeros int32 [K/G, N/8], P.scales fp16 [K/G, N]
                                      (AutoAWQ GEMM packing, awq_format.py)
                               8-bit: P.qweight int8 [N, K], P.scales fp16 [N]   (W = q * s, per row)
                             P.bias when the layer has one; every other tensor (embeddings, norms with the
                             AWQ scales folded in, an untied lm_head) in the *source dtype*
    tokenizer*, special_tokens_map.json, chat_template*, generation_config.json   copied

    4-bit: {"quant_method": "awq", "bits": 4, "group_size": G, "zero_point": true, "version": "gemm"}
    8-bit: {"quant_method": "awq", "bits": 8, "group_size": -1, "zero_point": false, "version": "tokenmill-w8"}

The 4-bit checkpoint is a valid AutoAWQ GEMM checkpoint. AutoAWQ itself saves the unquantized tensors
in float16; we keep the source dtype instead (float32 for the shipped model), so the checkpoint holds
exactly the folded norms the calibration measured with, and any loader casts to its own dtype anyway.

Refused with a ValueError before any weights are loaded: bits not 4 or 8; a 4-bit group size not 32,
64 or 128; a linear whose input features are not a multiple of the group size (named, with its
shape) or whose outputs are not a multiple of 8 (4-bit packing); an unsupported architecture; an
already-quantized model (a quantization_config, or `.qweight` tensors); weights not in safetensors;
an output directory that exists and is not empty (there is no --force: nothing of the user's is ever
overwritten); a calibration file that is missing or too short (calib_data.py).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

from tokenmill.quantization.awq_format import SUPPORTED_GROUP_SIZES, VERSION_W4, VERSION_W8
from tokenmill.quantization.awq_search import (Quantizer, apply_scale, run_chunked, scale_groups, search_clip,
                                               search_scale)
from tokenmill.quantization.calib_data import DEFAULT_CALIB_PATH, calibration_samples, check_sample_shape
from tokenmill.quantization.checkpoint import read_config, tensor_names, write_model_dir

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
NO_CLIP = ("self_attn.q_proj", "self_attn.k_proj")
METHODS = ("awq", "rtn")


@dataclass
class QuantizeOptions:
    """The CLI's flags, plus search knobs for the Python API. Defaults are AutoAWQ's (128 x 512 tokens,
    20 alphas, clipping on 512 tokens shrinking max |w| by up to 50 %), except `duo_scaling`: AutoAWQ
    divides by w_mean ** (1 - alpha) by default; here s = x_mean ** alpha unless asked."""

    method: str = "awq"
    bits: int = 4
    group_size: int | None = None  # None: 128, or the largest supported size that divides every layer
    calib_data: str | None = None  # None: the shipped training-split sample
    num_samples: int = 128
    seq_len: int = 512
    seed: int = 0
    n_grid: int = 20               # alphas tried: 0, 1/n_grid, ..., (n_grid - 1)/n_grid
    clip: bool = True              # the clip search (q/k are never clipped)
    clip_tokens: int = 512         # tokens the clip search scores each candidate on
    duo_scaling: bool = False
    progress: bool = True


def quantization_config(opts: QuantizeOptions) -> dict:
    if opts.bits == 4:
        return {"quant_method": "awq", "bits": 4, "group_size": opts.group_size, "zero_point": True,
                "version": VERSION_W4}
    return {"quant_method": "awq", "bits": 8, "group_size": -1, "zero_point": False, "version": VERSION_W8}


# ----------------------------------------------------------------------------- checks


def check_options(opts: QuantizeOptions) -> None:
    if opts.method not in METHODS:
        raise ValueError(f"--method must be one of {', '.join(METHODS)}, got {opts.method!r}")
    if opts.bits not in (4, 8):
        raise ValueError(f"--bits must be 4 or 8, got {opts.bits}")
    if opts.bits == 4 and opts.group_size is not None and opts.group_size not in SUPPORTED_GROUP_SIZES:
        raise ValueError(f"--group-size must be one of {', '.join(map(str, SUPPORTED_GROUP_SIZES))} for 4-bit, "
                         f"got {opts.group_size}")
    if opts.method == "awq":
        check_sample_shape(opts.num_samples, opts.seq_len, None)


def check_output_dir(output_dir: str | Path) -> None:
    out = Path(output_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"output directory {str(out)!r} exists and is not empty; choose a new one")


def linear_shapes(hf_config) -> dict[str, tuple[int, int]]:
    """[N, K] of each linear of a decoder layer (the same in every layer), from a weightless model."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    layer = model.model.layers[0]
    return {name: tuple(layer.get_submodule(name).weight.shape) for name in LINEARS}


def fitting_group_sizes(shapes: dict[str, tuple[int, int]]) -> list[int]:
    return [g for g in SUPPORTED_GROUP_SIZES if all(k % g == 0 for _, k in shapes.values())]


def check_shapes(shapes: dict[str, tuple[int, int]], opts: QuantizeOptions) -> None:
    """Also settles a group size left unset: AutoAWQ's 128 where every layer's input divides by it, else the
    largest supported size that fits (the shipped model's MLP width, 704, takes 64)."""
    if opts.bits != 4:
        return
    if opts.group_size is None:
        fits = fitting_group_sizes(shapes)
        opts.group_size = fits[-1] if fits else max(SUPPORTED_GROUP_SIZES)
    for name, (n, k) in shapes.items():
        if k % opts.group_size:
            fits = fitting_group_sizes(shapes)
            raise ValueError(f"{name} (weight [{n}, {k}] in every decoder layer) has {k} input features, not a "
                             f"multiple of --group-size {opts.group_size}; group sizes that fit this model: "
                             f"{', '.join(map(str, fits)) or 'none'}")
        if n % 8:
            raise ValueError(f"{name} (weight [{n}, {k}]) has {n} output features; 4-bit packing needs a multiple of 8")


def check_model(model_dir: str | Path, opts: QuantizeOptions):
    """The model's transformers config, once it is known to be a float checkpoint we can quantize."""
    from transformers import AutoConfig

    raw = read_config(model_dir)
    if "quantization_config" in raw or any(n.endswith(".qweight") for n in tensor_names(model_dir)):
        qc = raw.get("quantization_config", {"tensors": ".qweight"})
        raise ValueError(f"{str(model_dir)!r} is already quantized ({qc}); quantize a float checkpoint")
    arch = (raw.get("architectures") or ["(none)"])[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"architecture {arch} is not supported by tokenmill quantize "
                         f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    hf_config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    check_shapes(linear_shapes(hf_config), opts)
    return hf_config


# ----------------------------------------------------------------------------- calibration


class _Stop(Exception):
    pass


def _keep_kwargs(store: list, i: int, module, args, kwargs) -> None:
    store[i] = {k: v for k, v in kwargs.items() if k != "hidden_states"}


def _stop_with_input(store: list, module, args, kwargs) -> None:
    store.append(args[0] if args else kwargs["hidden_states"])
    raise _Stop


@torch.no_grad()
def capture_layer_inputs(model: nn.Module, samples: torch.Tensor) -> tuple[torch.Tensor, list[dict]]:
    """(hidden states entering layer 0 [N, L, H], each layer's keyword arguments). The kwargs (mask,
    rotary cos/sin) come from a batch-1 pass, so they broadcast over any chunk of samples."""
    layers = model.model.layers
    kwargs: list = [None] * len(layers)
    handles = [layer.register_forward_pre_hook(partial(_keep_kwargs, kwargs, i), with_kwargs=True)
               for i, layer in enumerate(layers)]
    try:
        model(samples[:1], use_cache=False)
    finally:
        for h in handles:
            h.remove()
    hidden: list = []
    handle = layers[0].register_forward_pre_hook(partial(_stop_with_input, hidden), with_kwargs=True)
    try:
        for chunk in samples.split(max(1, 4096 // samples.shape[1])):
            try:
                model(chunk, use_cache=False)
            except _Stop:
                pass
    finally:
        handle.remove()
    return torch.cat(hidden), kwargs


@torch.no_grad()
def linear_inputs(layer: nn.Module, x: torch.Tensor, kwargs: dict, names) -> dict[str, torch.Tensor]:
    """Inputs of the named linears while the layer runs on x."""
    feats: dict[str, list] = {n: [] for n in names}
    handles = [layer.get_submodule(n).register_forward_pre_hook(lambda m, a, n=n: feats[n].append(a[0]))
               for n in names]
    try:
        run_chunked(layer, x, kwargs)
    finally:
        for h in handles:
            h.remove()
    return {n: torch.cat(v) for n, v in feats.items()}


def awq_search_layer(layer: nn.Module, x: torch.Tensor, kwargs: dict, quantizer: Quantizer,
                     opts: QuantizeOptions) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """Scale search + folding, then clip search, on one float layer. Returns (clips, alpha per group)."""
    groups = scale_groups(layer)
    feats = linear_inputs(layer, x, kwargs, [g.linears[0] for g in groups])
    found = [search_scale(layer, g, feats[g.linears[0]], kwargs, quantizer, opts.n_grid, opts.duo_scaling)
             for g in groups]
    for g, (s, _, _) in zip(groups, found):
        apply_scale(layer, g, s)
        feats[g.linears[0]] /= s  # what the scaled linears now see
    clips = {name: search_clip(layer.get_submodule(name).weight, feats[g.linears[0]], quantizer,
                               n_tokens=opts.clip_tokens)
             for g in groups for name in g.linears if opts.clip and name not in NO_CLIP}
    return clips, {f"{g.prev}->{g.linears[-1]}": alpha for g, (_, alpha, _) in zip(groups, found)}


@torch.no_grad()
def quantize_linears(layer: nn.Module, prefix: str, quantizer: Quantizer,
                     clips: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """Quantize each linear; its weight becomes the dequantized one (what later layers are calibrated on)."""
    out = {}
    for name in LINEARS:
        lin = layer.get_submodule(name)
        tensors = quantizer.quantize(lin.weight.data, clips.get(name))
        lin.weight.data = quantizer.dequantize(tensors).to(lin.weight.dtype)
        out[f"{prefix}.{name}"] = tensors
    return out


def calibrate(model: nn.Module, samples: torch.Tensor | None, opts: QuantizeOptions):
    """Quantize `model` in place (linears -> dequantized weights). Returns (tensors per linear, report)."""
    quantizer = Quantizer(opts.bits, opts.group_size)
    layers = model.model.layers
    if opts.method == "awq":
        x, kwargs = capture_layer_inputs(model, samples)
    tensors, report = {}, []
    bar = tqdm(range(len(layers)), desc=f"{opts.method} w{opts.bits}", unit="layer", disable=not opts.progress)
    for i in bar:
        clips, alphas = {}, {}
        if opts.method == "awq":
            clips, alphas = awq_search_layer(layers[i], x, kwargs[i], quantizer, opts)
        tensors.update(quantize_linears(layers[i], f"model.layers.{i}", quantizer, clips))
        if opts.method == "awq" and i + 1 < len(layers):
            x = run_chunked(layers[i], x, kwargs[i])  # the quantized layer feeds the next
        report.append({"layer": i, "alpha": alphas})
    return tensors, report


# ----------------------------------------------------------------------------- end to end


def checkpoint_tensors(model: nn.Module, qtensors: dict[str, dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Quantized tensors for the linears, the model's own tensors for everything else (a tied lm_head once)."""
    sd, seen = {}, set()
    for key, v in model.state_dict().items():
        module, _, param = key.rpartition(".")
        if (module in qtensors and param == "weight") or v.data_ptr() in seen:
            continue
        seen.add(v.data_ptr())
        sd[key] = v
    for prefix, tensors in qtensors.items():
        sd.update({f"{prefix}.{k}": v for k, v in tensors.items()})
    return sd


def load_float_model(model_dir: str | Path) -> nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True).eval()


def prepare(model_dir: str | Path, output_dir: str | Path, opts: QuantizeOptions) -> torch.Tensor | None:
    """Every check, then the calibration samples (None for RTN): all of it before any weights load."""
    from transformers import AutoTokenizer

    check_options(opts)
    check_output_dir(output_dir)
    hf_config = check_model(model_dir, opts)
    if opts.method != "awq":
        return None
    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    return calibration_samples(tok, opts.calib_data or DEFAULT_CALIB_PATH, opts.num_samples, opts.seq_len,
                               opts.seed, getattr(hf_config, "max_position_embeddings", None))


def quantize_model(model_dir: str | Path, output_dir: str | Path, **options) -> tuple[nn.Module, dict]:
    """Quantize `model_dir` into `output_dir` (format in the module docstring). Returns (the float model
    holding the dequantized weights the checkpoint stores, a summary)."""
    opts = QuantizeOptions(**options)
    samples = prepare(model_dir, output_dir, opts)
    t0 = time.perf_counter()
    model = load_float_model(model_dir)
    qtensors, report = calibrate(model, samples, opts)
    config = read_config(model_dir)
    config["quantization_config"] = quantization_config(opts)
    write_model_dir(output_dir, model_dir, config, checkpoint_tensors(model, qtensors))
    summary = {"output": str(output_dir), "method": opts.method, **config["quantization_config"],
               "calib_tokens": 0 if samples is None else samples.numel(),
               "seconds": round(time.perf_counter() - t0, 1), "layers": report}
    return model, summary
