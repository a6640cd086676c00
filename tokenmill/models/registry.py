"""Architecture name -> model class. Entries are import paths, resolved on first use, so this table can be
read (config validation) without importing model code, which itself imports the config."""
from __future__ import annotations

import importlib

_MODELS = {
    "LlamaForCausalLM": "tokenmill.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "tokenmill.models.llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "tokenmill.models.llama:LlamaForCausalLM",
    "LlavaForConditionalGeneration": "tokenmill.models.llava:LlavaForConditionalGeneration",
}


def check_architecture(architecture: str) -> None:
    if architecture not in _MODELS:
        raise ValueError(f"unsupported model architecture {architecture!r}; "
                         f"supported: {', '.join(sorted(_MODELS))}")


def model_class(architecture: str):
    check_architecture(architecture)
    module, name = _MODELS[architecture].split(":")
    return getattr(importlib.import_module(module), name)
