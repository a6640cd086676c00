"""The model fingerprint that keys every stored block: two engines share blocks only when their KV for
the same tokens is bit-identical, so everything that changes the cache's bytes goes in."""
from __future__ import annotations

import glob
import hashlib
import json
import os

_FORMAT_VERSION = 1
_SAMPLE = 1 << 20  # bytes hashed from each end of each weight file


def weights_identity(model_dir: str, load_format: str, seed: int) -> str:
    """Cheap but content-based: config.json, plus each weight file's name, size and first and last MiB
    (the safetensors header names every tensor; the sampled bytes tell retrained weights apart).
    Hashing whole checkpoints would cost seconds per GB at every start."""
    if load_format == "dummy":
        return f"dummy-seed{seed}"
    h = hashlib.blake2b(digest_size=16)
    with open(os.path.join(model_dir, "config.json"), "rb") as f:
        h.update(f.read())
    for path in sorted(glob.glob(os.path.join(model_dir, "*.safetensors"))):
        size = os.path.getsize(path)
        h.update(f"{os.path.basename(path)}:{size}".encode())
        with open(path, "rb") as f:
            h.update(f.read(_SAMPLE))
            f.seek(max(0, size - _SAMPLE))
            h.update(f.read(_SAMPLE))
    return h.hexdigest()


def model_fingerprint(*, architecture: str, weights_id: str, dtype: str, block_size: int,
                      kv_block_shape: tuple[int, ...], kv_layout: str, quantization: str | None,
                      tp_rank: int = 0) -> bytes:
    desc = dict(version=_FORMAT_VERSION, architecture=architecture, weights=weights_id, dtype=dtype,
                block_size=block_size, kv_block_shape=list(kv_block_shape), kv_layout=kv_layout,
                quantization=quantization, tp_rank=tp_rank)
    return hashlib.blake2b(json.dumps(desc, sort_keys=True).encode(), digest_size=16).digest()
