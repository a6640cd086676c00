"""Attention backends by name (EngineConfig.attention_impl). Entries are import paths, resolved on first
use, so a GPU backend's imports (Triton) load only where it is chosen."""
from __future__ import annotations

import importlib

from tokenmill.attention.backend import AttentionBackend

_BACKENDS = {
    "fused": "tokenmill.attention.torch_backend:TorchAttentionBackend",  # the CPU path, and the GPU oracle
    "eager": "tokenmill.attention.eager_backend:EagerAttentionBackend",  # the ladder's unfused baseline
}


def attention_backend_class(name: str) -> type[AttentionBackend]:
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose from {', '.join(_BACKENDS)}")
    module, cls = _BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), cls)
