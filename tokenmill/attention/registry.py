"""Attention backends by name. Entries are import paths, resolved on first use, so a GPU backend's imports
(Triton) load only where it is chosen.

    attention_backend="auto"   -> the first entry of AUTO_ORDER[device] whose class `supports(device)`
    attention_backend="torch"  -> TorchAttentionBackend   (the CPU path, and the oracle of the GPU kernels)
    attention_backend="triton" -> TritonAttentionBackend  (unified paged attention; falls back to torch)
    attention_impl="eager"     -> EagerAttentionBackend   (the ladder's unfused baseline, whatever the above)

An optional FlashAttention or FlashInfer backend joins by adding an entry here and putting it first in
AUTO_ORDER["cuda"]; its `supports` returns False where its wheel is not installed, so auto skips it.
"""
from __future__ import annotations

import importlib

from tokenmill.attention.backend import AttentionBackend

_BACKENDS = {
    "torch": "tokenmill.attention.torch_backend:TorchAttentionBackend",
    "triton": "tokenmill.attention.triton_backend:TritonAttentionBackend",
    "eager": "tokenmill.attention.eager_backend:EagerAttentionBackend",
}
AUTO_ORDER = {"cuda": ("triton", "torch"), "cpu": ("torch",)}


def attention_backend_class(name: str) -> type[AttentionBackend]:
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose from {', '.join(_BACKENDS)}")
    module, cls = _BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), cls)


def resolve_attention_backend(name: str, device: str) -> str:
    """The backend `name` stands for on `device` ("auto": the first in AUTO_ORDER that runs there)."""
    if name != "auto":
        attention_backend_class(name)  # an unknown name fails here, with the choices
        return name
    for candidate in AUTO_ORDER.get(device, ("torch",)):
        if attention_backend_class(candidate).supports(device):
            return candidate
    return "torch"
