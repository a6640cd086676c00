"""The model fingerprint that keys every stored block: two engines share blocks only when their KV for
the same tokens is bit-identical, so everything that changes the cache's bytes goes in."""
from __future__ import annotations

import glob
import hashlib
import json
import os

_FORMAT_VERSION = 1
_SAMPLE = 1 << 20  # bytes hashed from each end of each weight file
# and this many windows of _WINDOW bytes spread evenly between the ends: a fine-tune whose ends match its
# base's (a LoRA merged into the MLPs; embeddings, head and norms frozen) changes bytes all through the file
_WINDOWS, _WINDOW = 256, 4096


# files beside the weights that change what the model computes: its shapes, rope, norms (config.json) and
# how an image becomes encoder input (preprocessor_config.json)
_CONFIG_FILES = ("config.json", "preprocessor_config.json")


def weights_identity(model_dir: str, load_format: str, seed: int) -> str:
    """Cheap but content-based: config.json (and the image preprocessor's), plus each weight file's name, size,
    first and last MiB (the safetensors header names every tensor) and 256 windows of 4 KiB spread evenly
    between (the sampled bytes tell retrained weights apart); dummy weights: the seed they are drawn from.
    Hashing whole checkpoints would cost seconds per GB at every start."""
    h = hashlib.blake2b(digest_size=16)
    for name in _CONFIG_FILES:
        path = os.path.join(model_dir, name)
        if name == "config.json" or os.path.exists(path):
            with open(path, "rb") as f:
                h.update(name.encode() + b"\0" + f.read())
    if load_format == "dummy":  # two configs' dummy weights differ even with one seed
        return f"dummy-seed{seed}-{h.hexdigest()}"
    for path in sorted(glob.glob(os.path.join(model_dir, "*.safetensors"))):
        size = os.path.getsize(path)
        h.update(f"{os.path.basename(path)}:{size}".encode())
        with open(path, "rb") as f:
            h.update(f.read(_SAMPLE))
            middle = size - 2 * _SAMPLE
            for i in range(_WINDOWS if middle > 0 else 0):
                f.seek(_SAMPLE + middle * i // _WINDOWS)
                h.update(f.read(_WINDOW))
            f.seek(max(0, size - _SAMPLE))
            h.update(f.read(_SAMPLE))
    return h.hexdigest()


def model_fingerprint(*, architecture: str, weights_id: str, dtype: str, block_size: int,
                      kv_block_shape: tuple[int, ...], kv_layout: str, quantization: str | None,
                      mm_encoder_quantization: str | None = None, tp_rank: int = 0) -> bytes:
    """`mm_encoder_quantization`: an int8 vision encoder gives image tokens other embeddings, so other KV."""
    desc = dict(version=_FORMAT_VERSION, architecture=architecture, weights=weights_id, dtype=dtype,
                block_size=block_size, kv_block_shape=list(kv_block_shape), kv_layout=kv_layout,
                quantization=quantization, mm_encoder_quantization=mm_encoder_quantization, tp_rank=tp_rank)
    return hashlib.blake2b(json.dumps(desc, sort_keys=True).encode(), digest_size=16).digest()
