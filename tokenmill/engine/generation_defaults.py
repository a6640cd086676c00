"""Sampling defaults a model ships (vLLM's `--generation-config auto`, its default): the sampling keys of the
model's generation_config.json fill in what a request leaves unset, so that an instruct model samples as its
makers tuned it (Qwen2.5: temperature 0.7, top_p 0.8, top_k 20, repetition_penalty 1.05) without each
client repeating it.

    generation_config = "auto"      the model directory's generation_config.json (none there: no defaults)
                      = "vllm"      none: tokenmill's (and OpenAI's) own defaults, temperature 1.0 and no filters
                      = DIRECTORY   that directory's generation_config.json (it must be there)
    override_generation_config      keys set on top, as a dict or JSON: {"temperature": 0.6}

Only these keys are read (vLLM's set); HF's max_new_tokens is our max_tokens. Explicit request values win:
the server fills only fields a request leaves null or absent, LLM.generate uses them when given no
SamplingParams (LLM.get_default_sampling_params).
"""
from __future__ import annotations

import json
import os

KEYS = ("repetition_penalty", "temperature", "top_k", "top_p", "min_p", "max_new_tokens")


def sampling_defaults(model: str, generation_config: str = "auto", override=None) -> dict:
    """{SamplingParams field: value}; ValueError naming the source for a bad file, key or value."""
    found = {}
    if generation_config != "vllm":
        folder = model if generation_config == "auto" else generation_config
        path = os.path.join(folder, "generation_config.json")
        if os.path.isfile(path):
            try:
                with open(path, encoding="utf-8") as f:
                    data = json.load(f)
            except (OSError, ValueError) as e:
                raise ValueError(f"generation_config: cannot read {path}: {e}") from None
            if not isinstance(data, dict):
                raise ValueError(f"generation_config: {path} is not a JSON object")
            found = {k: data[k] for k in KEYS if data.get(k) is not None}
        elif generation_config != "auto":
            raise ValueError(f"generation_config: no generation_config.json in {folder!r} (give 'auto', 'vllm' or "
                             "a directory that holds one)")
    if override:
        try:
            extra = json.loads(override) if isinstance(override, str) else dict(override)
        except (ValueError, TypeError) as e:
            raise ValueError(f"override_generation_config must be a dict or JSON object: {e}") from None
        if not isinstance(extra, dict):
            raise ValueError(f"override_generation_config must be a dict or JSON object, got {override!r}")
        unknown = sorted(set(extra) - set(KEYS))
        if unknown:
            raise ValueError(f"override_generation_config: unknown keys {unknown}; it takes {', '.join(KEYS)}")
        found.update(extra)
    for key in ("top_k", "max_new_tokens"):  # (20.0 in a file: an integer, as vLLM reads it)
        if isinstance(found.get(key), float) and found[key].is_integer():
            found[key] = int(found[key])
    if "max_new_tokens" in found:
        found["max_tokens"] = found.pop("max_new_tokens")
    from tokenmill.sampling_params import SamplingParams

    try:
        SamplingParams(**found)  # a bad value fails at startup, naming where it came from
    except (ValueError, TypeError) as e:
        raise ValueError(f"the sampling defaults from generation_config={generation_config!r} "
                         f"(and override_generation_config) are invalid: {e}") from None
    return found
