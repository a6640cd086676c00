"""The settings `tokenmill tune` searches. A setting given on the command line (an engine flag whose value
differs from its default) is fixed instead. `--search a,b` narrows the space to those names."""
from __future__ import annotations

import json
from dataclasses import fields

from tokenmill.config import EngineConfig

NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4})
SPACE: dict[str, list] = {
    "max_num_seqs": [4, 8, 16, 32, 64, 128, 256],
    "max_num_batched_tokens": [256, 512, 1024, 2048, 4096],
    "enable_chunked_prefill": [True, False],
    "long_prefill_token_threshold": [0, 256, 512, 1024, 2048],
    "max_long_partial_prefills": [0, 1],
    "enable_prefix_caching": [True, False],
    "block_size": [16, 32],
    # precision: both change the model's numbers (docs/quantization.md has each format's quality cost)
    "quantization": [None, "int8", "w8a8"],
    "dtype": [None, "bfloat16"],
    "speculative_config": [None, NGRAM],
    "kv_host_cache_gb": [0.0, 1.0],
    # parallelism: sizes the model splits over and the machine has ranks for (`constraints`)
    "tensor_parallel_size": [1, 2, 4, 8],
    "pipeline_parallel_size": [1, 2, 4],
}


def searched(names: list[str] | None, fixed: dict, limits: dict | None = None) -> dict[str, list]:
    """The space to search. `limits` (from `constraints`) drops what the checkpoint or the machine rules out."""
    if names:
        unknown = [n for n in names if n not in SPACE]
        if unknown:
            raise ValueError(f"unknown setting(s) to search: {', '.join(unknown)}; searchable: {', '.join(SPACE)}")
    chosen = names or list(SPACE)
    space = {n: SPACE[n] for n in chosen if n not in fixed}
    if "long_prefill_token_threshold" not in space and not fixed.get("long_prefill_token_threshold"):
        space.pop("max_long_partial_prefills", None)  # which prompts are long comes from the threshold
    limits = limits or {}
    for name in limits.get("not_searchable", ()):
        space.pop(name, None)
    for name, allowed in limits.get("choices", {}).items():
        if name in space:
            space[name] = [v for v in space[name] if v in allowed]
            if len(space[name]) < 2:
                del space[name]  # one choice is no choice
    return space


def constraints(hf_config, max_ranks: int) -> dict:
    """What this checkpoint and machine leave to search: a quantized checkpoint keeps its own format (and
    dtype); bfloat16 is only a choice for a float32 checkpoint (float16 already runs as bfloat16 on CPUs);
    parallel sizes must split the model (heads, vocabulary, MLP, layers) and fit `max_ranks` (cores on a
    CPU, GPUs on CUDA); multimodal models do not split yet."""
    from tokenmill.config import ModelConfig
    from tokenmill.distributed.layout import ParallelLayout, check_model_split
    from tokenmill.quantization.config import checkpoint_quantization

    moot = []
    if checkpoint_quantization(hf_config) is not None:
        moot += ["quantization", "dtype"]
    else:
        dt = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None) or "float32"
        if str(dt).replace("torch.", "") != "float32":
            moot.append("dtype")
    mc = ModelConfig.from_hf(hf_config)

    def splits(tp: int, pp: int) -> bool:
        try:
            check_model_split(ParallelLayout(tp, pp), mc)
            return tp * pp <= max_ranks
        except ValueError:
            return False

    choices = {"tensor_parallel_size": [t for t in SPACE["tensor_parallel_size"] if splits(t, 1)],
               "pipeline_parallel_size": [p for p in SPACE["pipeline_parallel_size"] if splits(1, p)]}
    if getattr(hf_config, "vision_config", None) is not None:
        moot += ["tensor_parallel_size", "pipeline_parallel_size"]
    return {"not_searchable": moot, "choices": choices, "max_ranks": max_ranks}


def fixed_settings(engine_kwargs: dict) -> dict:
    """Engine options the command line set away from their defaults."""
    defaults = {f.name: f.default for f in fields(EngineConfig)}
    return {k: v for k, v in engine_kwargs.items() if k in defaults and v != defaults[k]}


def normalize(settings: dict, max_ranks: int | None = None) -> dict:
    """Drop combinations the engine would refuse: without chunked prefill the budget is the context; tp x pp
    beyond the machine's ranks; KV tiers with parallelism, speculation with a pipeline (not supported yet)."""
    s = dict(settings)
    tp, pp = s.get("tensor_parallel_size") or 1, s.get("pipeline_parallel_size") or 1
    if max_ranks and tp * pp > max_ranks:
        s["pipeline_parallel_size"] = pp = max(1, max_ranks // tp)
    if tp * pp > 1 and s.get("kv_host_cache_gb"):
        s["kv_host_cache_gb"] = 0.0
    if pp > 1 and s.get("speculative_config"):
        s["speculative_config"] = None
    if s.get("enable_chunked_prefill") is False:
        s.pop("max_num_batched_tokens", None)
        s.pop("long_prefill_token_threshold", None)
        s.pop("max_long_partial_prefills", None)
    elif s.get("long_prefill_token_threshold", 0) >= s.get("max_num_batched_tokens", 2048):
        s["long_prefill_token_threshold"] = 0  # a cap at or above the budget caps nothing
    if s.get("long_prefill_token_threshold", None) == 0 and s.get("max_long_partial_prefills"):
        s["max_long_partial_prefills"] = 0  # no threshold: no prompt counts as long
    if s.get("kv_host_cache_gb") and s.get("enable_prefix_caching") is False:
        s["kv_host_cache_gb"] = 0.0  # tiers store prefix-cache blocks
    return s


def to_flags(settings: dict) -> list[str]:
    """`tokenmill serve` flags for settings (booleans as --x / --no-x; None: the default)."""
    out = []
    for name, value in settings.items():
        flag = "--" + name.replace("_", "-")
        if value is None:
            continue
        if isinstance(value, bool):
            out.append(flag if value else f"--no-{name.replace('_', '-')}")
        else:
            out += [flag, str(value)]
    return out
