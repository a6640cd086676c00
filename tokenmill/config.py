"""Engine and model configuration. One place resolves defaults, so every module sees final values."""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

logger = logging.getLogger("tokenmill")

DEFAULT_MODEL = str(Path(__file__).parent / "assets" / "models" / "tiny-shakespeare")

_DTYPES = {
    "float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
}


@dataclass
class ModelConfig:
    """The parts of a Hugging Face config our model code needs, normalised across transformers versions."""

    hf_config: object
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float
    rope_scaling: dict | None
    tie_word_embeddings: bool
    attention_bias: bool
    sliding_window: int | None

    @classmethod
    def from_hf(cls, hf_config) -> "ModelConfig":
        archs = getattr(hf_config, "architectures", None) or []
        if not archs:
            raise ValueError("config.json has no 'architectures' entry; cannot pick a model class")
        from tokenmill.models.registry import model_class

        model_class(archs[0])  # unknown architectures fail here, naming themselves
        num_heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
        rope = dict(getattr(hf_config, "rope_parameters", None) or {})  # transformers >= 5
        theta = rope.pop("rope_theta", None) or getattr(hf_config, "rope_theta", 10000.0)
        scaling = rope or getattr(hf_config, "rope_scaling", None)
        if scaling and scaling.get("rope_type", scaling.get("type")) in (None, "default"):
            scaling = None
        sliding = getattr(hf_config, "sliding_window", None)
        if getattr(hf_config, "use_sliding_window", True) is False:
            sliding = None
        return cls(
            hf_config=hf_config,
            architecture=archs[0],
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_layers=hf_config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=hf_config.rms_norm_eps,
            max_position_embeddings=hf_config.max_position_embeddings,
            rope_theta=float(theta),
            rope_scaling=dict(scaling) if scaling else None,
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            # Qwen2 always has q/k/v bias; Llama/Mistral only when attention_bias is set.
            attention_bias=bool(getattr(hf_config, "attention_bias", False)) or archs[0].startswith("Qwen2"),
            sliding_window=sliding,
        )


@dataclass
class EngineConfig:
    """Engine settings; keyword names follow vLLM's so `LLM(...)` calls port unchanged."""

    model: str = DEFAULT_MODEL
    tokenizer: str | None = None
    dtype: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_gb: float | None = None  # CPU: KV budget in GiB (vLLM's VLLM_CPU_KVCACHE_SPACE)
    num_kv_blocks: int | None = None  # override the budget with an exact block count
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    scheduling_policy: str = "fcfs"  # or "priority"
    load_format: str = "auto"  # "auto" | "safetensors" | "dummy"
    quantization: str | None = None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    device: str = "auto"
    skip_tokenizer_init: bool = False
    revision: str | None = None
    trust_remote_code: bool = False
    num_threads: int | None = None
    # "auto" | "onednn" (packed weights) | "onednn+gemv" (plus a batch-1 bf16/fp32 GEMV kernel) | "torch" (F.linear)
    cpu_linear_kernel: str = "auto"
    # Baseline modes, for the optimization ladder (`tokenmill bench ladder`): each turns one
    # optimization off, so its effect can be measured in the same engine.
    batching: str = "continuous"  # "static": a batch fills, runs to completion, then the next starts
    kv_layout: str = "paged"  # "contiguous": each request reserves max_model_len of KV up front
    attention_impl: str = "fused"  # "eager": materialized scores, GQA heads repeated, per sequence
    static_batch_wait_s: float = 0.05  # static batching: how long a partial batch waits to fill
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}")
        if self.load_format not in ("auto", "safetensors", "dummy"):
            raise ValueError(f"load_format must be 'auto', 'safetensors' or 'dummy', got {self.load_format!r}")
        if self.cpu_linear_kernel not in ("auto", "onednn", "onednn+gemv", "torch"):
            raise ValueError("cpu_linear_kernel must be 'auto', 'onednn', 'onednn+gemv' or 'torch', "
                             f"got {self.cpu_linear_kernel!r}")
        for name, allowed in (("batching", ("continuous", "static")), ("kv_layout", ("paged", "contiguous")),
                              ("attention_impl", ("fused", "eager"))):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(allowed)}; got {getattr(self, name)!r}")
        if self.kv_layout == "contiguous":
            self.enable_prefix_caching = False  # nothing to share when every request owns a slab
        if self.batching == "static":
            self.enable_chunked_prefill = False
        if self.quantization is not None:
            raise ValueError(f"quantization={self.quantization!r} is not supported yet")
        if self.tensor_parallel_size != 1 or self.pipeline_parallel_size != 1:
            raise ValueError("tensor/pipeline parallelism is not supported yet; use size 1")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.device == "auto":
            self.device = "cpu"  # the GPU path (Triton kernels, device-side sampling) has not landed yet
        if self.device != "cpu":
            raise ValueError(f"device={self.device!r} is not supported yet; tokenmill runs on CPU for now")
        if not os.path.isdir(self.model):
            raise ValueError(f"model directory not found: {self.model!r} (models load from local directories only)")

    def resolve(self, model_config: ModelConfig) -> None:
        """Fill defaults that depend on the model."""
        limit = model_config.max_position_embeddings
        if model_config.sliding_window and model_config.sliding_window < limit:
            # Our attention has no sliding-window mask yet: stay inside the window, where it is exact.
            logger.warning("sliding_window=%d: capping max_model_len to it", model_config.sliding_window)
            limit = model_config.sliding_window
        if self.max_model_len is None:
            self.max_model_len = limit
        elif self.max_model_len > limit:
            raise ValueError(f"max_model_len={self.max_model_len} exceeds the model's limit of {limit} tokens")
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = 2048 if self.enable_chunked_prefill else self.max_model_len
        if self.batching == "static":  # a static batch prefills all its prompts in one step
            self.max_num_batched_tokens = max(self.max_num_batched_tokens, self.max_num_seqs * self.max_model_len)
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError("without chunked prefill, max_num_batched_tokens must be >= max_model_len")

    def torch_dtype(self, model_config: ModelConfig) -> torch.dtype:
        if self.dtype != "auto":
            if self.dtype not in _DTYPES:
                raise ValueError(f"dtype must be one of auto, float32, bfloat16, float16; got {self.dtype!r}")
            return _DTYPES[self.dtype]
        cfg = model_config.hf_config
        dt = getattr(cfg, "dtype", None) or getattr(cfg, "torch_dtype", None) or torch.float32
        if isinstance(dt, str):
            dt = _DTYPES.get(dt, torch.float32)
        if dt == torch.float16 and self.device == "cpu":
            dt = torch.bfloat16  # CPU float16 kernels are slow; bfloat16 has the same size.
        return dt
