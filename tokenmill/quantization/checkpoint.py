"""Reading and writing model directories for `tokenmill quantize` and its helpers.

`dequantize_checkpoint` turns a checkpoint written by `tokenmill quantize` (4-bit AutoAWQ GEMM or
8-bit tokenmill-w8, see awq_calibrate.py) back into a plain float32 Hugging Face directory, so that
transformers can score exactly the weights the checkpoint holds (perplexity, tests).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tokenmill.quantization.awq_format import dequantize_w4, dequantize_w8

# What travels with the weights: tokenizer, chat template, generation defaults.
SIDE_FILES = ("tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.*", "merges.txt",
              "chat_template*", "generation_config.json")


def weight_files(model_dir: str | Path) -> list[Path]:
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ValueError(f"{str(model_dir)!r} has no *.safetensors weights")
    return files


def tensor_names(model_dir: str | Path) -> list[str]:
    """Tensor names without reading any data."""
    names = []
    for f in weight_files(model_dir):
        with safe_open(str(f), framework="pt") as fh:
            names += list(fh.keys())
    return names


def load_state_dict(model_dir: str | Path) -> dict[str, torch.Tensor]:
    sd: dict[str, torch.Tensor] = {}
    for f in weight_files(model_dir):
        sd.update(load_file(str(f)))
    return sd


def read_config(model_dir: str | Path) -> dict:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ValueError(f"{str(model_dir)!r} is not a model directory (no config.json)")
    return json.loads(path.read_text())


def write_model_dir(out_dir: str | Path, src_dir: str | Path, config: dict, tensors: dict[str, torch.Tensor]) -> None:
    """config.json + one model.safetensors + the source's tokenizer and generation files."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for pattern in SIDE_FILES:
        for f in Path(src_dir).glob(pattern):
            if f.is_file():
                shutil.copy2(f, out / f.name)


def dequantize_tensors(sd: dict[str, torch.Tensor], qc: dict) -> dict[str, torch.Tensor]:
    """{prefix.qweight, prefix.qzeros, prefix.scales} -> prefix.weight (float32); other tensors as they are."""
    out = {k: v for k, v in sd.items() if not k.endswith((".qweight", ".qzeros", ".scales"))}
    for key in (k for k in sd if k.endswith(".qweight")):
        prefix = key[: -len(".qweight")]
        if qc["bits"] == 4:
            w = dequantize_w4(sd[key], sd[prefix + ".qzeros"], sd[prefix + ".scales"], qc["group_size"])
        else:
            w = dequantize_w8(sd[key], sd[prefix + ".scales"])
        out[prefix + ".weight"] = w
    return out


def dequantize_checkpoint(in_dir: str | Path, out_dir: str | Path) -> Path:
    """A `tokenmill quantize` output -> a float32 HF model directory holding the same (dequantized) weights."""
    config = read_config(in_dir)
    qc = config.pop("quantization_config", None)
    if not qc or qc.get("quant_method") != "awq" or qc.get("bits") not in (4, 8):
        raise ValueError(f"{str(in_dir)!r} is not an AWQ checkpoint written by tokenmill quantize")
    sd = {k: v.float() for k, v in dequantize_tensors(load_state_dict(in_dir), qc).items()}
    config["dtype"] = "float32"
    config.pop("torch_dtype", None)
    write_model_dir(out_dir, in_dir, config, sd)
    return Path(out_dir)
