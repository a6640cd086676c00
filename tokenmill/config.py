"""Engine and model configuration. One place resolves defaults, so every module sees final values."""
from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch

from tokenmill.engine.generation_defaults import sampling_defaults
from tokenmill.models.registry import check_architecture
from tokenmill.quantization.config import resolve_quantization
from tokenmill.sched.burst import AUTO_BURST_MS, AUTO_BURST_STEPS
from tokenmill.spec_decode.config import SpeculativeConfig

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
    # Llama's attention_bias also biases o_proj (Qwen2's q/k/v biases do not); Llama's mlp_bias, the MLP's
    o_proj_bias: bool = False
    mlp_bias: bool = False
    # LLaVA-style models: the placeholder token of an image and the encoder rows each image becomes
    # (0 / None for text-only models); the text fields above are the language model's
    image_token_id: int | None = None
    mm_tokens_per_image: int = 0

    @property
    def is_multimodal(self) -> bool:
        return self.image_token_id is not None

    @classmethod
    def from_hf(cls, hf_config) -> "ModelConfig":
        archs = getattr(hf_config, "architectures", None) or []
        if not archs:
            raise ValueError("config.json has no 'architectures' entry; cannot pick a model class")
        check_architecture(archs[0])  # unknown architectures fail here, naming themselves
        vision = getattr(hf_config, "vision_config", None)
        if vision is None:
            return cls._from_text_config(hf_config, archs[0])
        text = hf_config.text_config
        if getattr(vision, "model_type", "") != "clip_vision_model":
            raise ValueError(f"vision tower {getattr(vision, 'model_type', None)!r} is not supported; "
                             f"supported: clip_vision_model")
        image_token = getattr(hf_config, "image_token_id", None)
        if image_token is None:
            image_token = getattr(hf_config, "image_token_index", None)
        patches = (vision.image_size // vision.patch_size) ** 2
        strategy = getattr(hf_config, "vision_feature_select_strategy", "default")
        if strategy not in ("default", "full"):
            raise ValueError(f"vision_feature_select_strategy {strategy!r} is not supported (default or full)")
        mc = cls._from_text_config(text, archs[0], getattr(text, "model_type", "llama"))
        if image_token is None or not 0 <= int(image_token) < mc.vocab_size:  # (else every image request fails)
            raise ValueError(f"config.json: image_token_index {image_token!r} is not a token of the "
                             f"{mc.vocab_size}-token vocabulary")
        mc.hf_config, mc.image_token_id = hf_config, int(image_token)
        mc.mm_tokens_per_image = patches if strategy == "default" else patches + 1
        return mc

    @classmethod
    def _from_text_config(cls, hf_config, architecture: str, text_type: str | None = None) -> "ModelConfig":
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
        qwen2 = architecture.startswith("Qwen2") or text_type == "qwen2"  # (q/k/v biases always; no other)
        return cls(
            hf_config=hf_config,
            architecture=architecture,
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
            attention_bias=bool(getattr(hf_config, "attention_bias", False)) or qwen2,
            sliding_window=sliding,
            o_proj_bias=bool(getattr(hf_config, "attention_bias", False)) and not qwen2,
            mlp_bias=bool(getattr(hf_config, "mlp_bias", False)) and not qwen2,
        )


def option(default, help: str, *, choices: tuple | None = None, aliases: tuple[str, ...] = (), const=None):
    """An EngineConfig field whose metadata also defines its command-line flag (engine/arg_utils.py); `const`:
    the value of the flag given without one."""
    return field(default=default, metadata={"help": help, "choices": choices, "aliases": aliases, "const": const})


@dataclass
class EngineConfig:
    """Engine settings; keyword names follow vLLM's so `LLM(...)` calls port unchanged. Each field is
    also the `--flag` of every command that builds an engine, with this help, default and choices."""

    model: str = option(DEFAULT_MODEL, "local Hugging Face model directory (default: the shipped model)")
    tokenizer: str | None = option(None, "tokenizer directory (default: the model's)")
    dtype: str = option("auto", "weight and activation dtype; auto: the checkpoint's (float16 becomes bfloat16 "
                        "on CPU)", choices=("auto", *_DTYPES))
    seed: int = option(0, "engine-wide sampling seed (and dummy-weight seed)")
    max_model_len: int | None = option(None, "longest prompt + output in tokens (default: the model's limit)")
    max_num_seqs: int = option(256, "most sequences in one step")
    max_num_batched_tokens: int | None = option(None, "token budget per step; longer prompts are prefilled in "
                                                "chunks (default: 2048, or max_model_len without chunking)")
    block_size: int = option(16, "tokens per KV block (a power of two)")
    gpu_memory_utilization: float = option(0.9, "GPU: fraction of device memory for weights, activations and "
                                           "KV cache")
    kv_cache_memory_gb: float | None = option(None, "CPU: KV cache budget in GiB (default 4; vLLM's "
                                              "VLLM_CPU_KVCACHE_SPACE)")
    num_kv_blocks: int | None = option(None, "exact KV block count (overrides the memory budget)")
    enable_prefix_caching: bool = option(True, "reuse the KV blocks of shared prompt prefixes")
    enable_chunked_prefill: bool = option(True, "split long prompts across steps, sharing them with decodes")
    long_prefill_token_threshold: int = option(0, "chunked prefill: most tokens one request's prefill takes per "
                                               "step (0: the whole budget), so prompts behind a long one start "
                                               "in the same step instead of after its whole prefill (vLLM's name)")
    max_long_partial_prefills: int = option(0, "chunked prefill: at most this many prompts longer than "
                                            "long_prefill_token_threshold prefill at once (0: no limit); the rest wait "
                                            "while shorter prompts pass them (vLLM's name)")
    scheduling_policy: str = option("fcfs", "fcfs, or priority (lower values run first)",
                                    choices=("fcfs", "priority"))
    load_format: str = option("auto", "dummy: random weights for any config.json (benchmarking real shapes)",
                              choices=("auto", "safetensors", "dummy"))
    quantization: str | None = option(
        None, "weight quantization: int8 (weight-only, made at load time), w8a8 (int8 weights and activations), "
        "awq (AutoAWQ / `tokenmill quantize` checkpoints; detected from config.json)",
        choices=(None, "int8", "awq", "w8a8"), aliases=("-q",))
    quantize_lm_head: str | None = option(
        None, "also quantize the LM head at load time: int8 (the flag alone; weight-only, or W8A8 under w8a8) or "
        "int4 (weight-only, groups of 64, or 32 where 64 does not divide the input); the methods keep it in "
        "float otherwise, as AutoAWQ and vLLM do",
        choices=(None, "int8", "int4"), const="int8")
    kv_host_cache_gb: float = option(0.0, "KV tier in host RAM below the KV pool, GiB (0: off): evicted prefix "
                                     "blocks are kept there and loaded back on a hit (pinned memory on a GPU)")
    kv_disk_cache_dir: str | None = option(None, "KV tier on local disk: one file per block under this directory, "
                                           "reused across restarts and shared by engines on the same model")
    kv_disk_cache_gb: float = option(16.0, "size cap of the disk tier in GiB (least recently used blocks go first)")
    kv_remote_cache_url: str | None = option(None, "KV tier on a Redis server shared by replicas, e.g. "
                                             "redis://127.0.0.1:6379/0 (bound it with Redis's maxmemory + "
                                             "allkeys-lru)")
    kv_cache_store_policy: str = option("evict", "when blocks go down the tiers: evict (as they leave the pool) or "
                                        "write_through (as they fill)", choices=("evict", "write_through"))
    kv_load_timeout_s: float = option(10.0, "a tier load not done after this long is abandoned; the rest of the "
                                      "prompt is recomputed")
    num_scheduler_steps: int | None = option(
        None, "greedy decoding: up to this many decode steps in one engine step, each step's token fed to the next "
        "inside the model runner, so the per-step host work (scheduling, sampling, output handling) is paid once per "
        f"burst; tokens stream in bursts (vLLM's name). 0: automatic, bursts of up to {AUTO_BURST_STEPS} steps that "
        f"last at most {AUTO_BURST_MS:g} ms at the measured step time. Default: 0 in the offline LLM (and `tokenmill "
        "generate`), 1 in the server. Runs where every running request decodes greedily without logprobs or "
        "penalties and no waiting prompt could join (none waits, or every seat is taken); with speculation, in "
        "steps where no request drafts; CPU one-call decode step only")
    generation_config: str = option(
        "auto", "sampling defaults for what a request leaves unset (vLLM's): auto, the model's "
        "generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens); vllm, none "
        "(temperature 1.0, no filters); or a directory holding a generation_config.json")
    override_generation_config: str | None = option(
        None, "sampling defaults set on top of generation_config's, as a dict or JSON, e.g. {\"temperature\": 0.6}")
    speculative_config: str | None = option(
        None, "speculative decoding, vLLM's shape, as a dict or JSON: {\"method\": \"ngram\", "
        "\"num_speculative_tokens\": 5, \"prompt_lookup_max\": 5, \"prompt_lookup_min\": 2}; k adapts to "
        "measured acceptance and step cost unless \"adaptive\": false")
    limit_mm_per_prompt: str | None = option(
        None, "multimodal: most items of each kind per prompt, as a dict or JSON, e.g. {\"image\": 4, \"video\": 1} "
        "(default: 4 images, 1 video)")
    mm_max_image_pixels: int = option(4096 * 4096, "multimodal: an image with more pixels (width x height) is refused")
    mm_allow_remote_urls: bool = option(False, "server: fetch http(s) image_url / video_url parts (data: URIs are "
                                        "always accepted)")
    mm_fetch_timeout_s: float = option(5.0, "server: an image or video fetch that takes longer is refused")
    mm_max_fetch_bytes: int = option(20 * 2**20, "server: a fetched image or video larger than this is refused")
    mm_video_num_frames: int = option(4, "video input: frames sampled uniformly from each clip (each is encoded "
                                      "like an image)")
    mm_encoder_budget: int | None = option(None, "multimodal: most encoder output tokens computed in one step "
                                           "(default: max_num_batched_tokens)")
    mm_encoder_cache_tokens: int | None = option(None, "multimodal: encoder outputs kept across requests, in "
                                                 "tokens, keyed by a hash of the pixels (default: 8 x the budget)")
    mm_encoder_overlap: bool = option(False, "multimodal: encode waiting requests' images in a worker thread while "
                                      "decode steps run (off by default: on a 2-core CPU the thread competes with "
                                      "the decode steps and measured slower, BENCHMARKS.md 'Multimodal')")
    mm_encoder_quantization: str | None = option(None, "multimodal: run the vision encoder's linears in int8 "
                                                 "(w8a8: int8 weights and activations)", choices=(None, "int8", "w8a8"))
    tensor_parallel_size: int = option(1, "tensor-parallel ranks: each holds 1/tp of every layer's heads and MLP, "
                                       "joined by one all-reduce per attention and MLP block", aliases=("-tp",))
    pipeline_parallel_size: int = option(1, "pipeline-parallel stages: each holds 1/pp of the layers; as many "
                                         "batches in flight as stages", aliases=("-pp",))
    distributed_executor_backend: str = option(
        "mp", "how worker ranks start: mp (processes the engine starts, or node agents / torchrun on other "
        "nodes) or ray (actors on the Ray cluster of RAY_ADDRESS, or a local one)", choices=("mp", "ray"))
    nnodes: int = option(1, "machines the tp x pp ranks span (each node starts world / nnodes ranks)")
    node_rank: int = option(0, "this machine's index; node 0 runs the scheduler and serves HTTP")
    master_addr: str = option("127.0.0.1", "address of node 0 for torch.distributed's rendezvous (and tokenmill's "
                              "control channel, on master_port + 1)")
    master_port: int = option(0, "rendezvous port on node 0 (0: a free port, single node only)")
    distributed_timeout_s: float = option(120.0, "a rendezvous or collective that waits longer fails the engine "
                                          "with an error (never a hang)")
    cpu_allreduce: str = option("auto", "CPU tensor parallelism: shm meets the TP ranks of a node in shared memory "
                                "(~100x faster than gloo for a step's small messages); gloo uses torch.distributed "
                                "only; auto: shm where it works (x86-64 Linux)", choices=("auto", "shm", "gloo"))
    allow_cpu_oversubscription: bool = option(False, "CPU: run more ranks on a node than it has cores (slow; "
                                              "for tests)")
    device: str = option("auto", "auto picks cuda when torch sees a GPU, else cpu", choices=("auto", "cpu", "cuda"))
    attention_backend: str = option("auto", "paged attention kernels: torch (the CPU path and the oracle), triton "
                                    "(unified paged attention; falls back to torch if it fails to compile); auto: "
                                    "triton on CUDA, torch on CPU", choices=("auto", "torch", "triton"))
    enforce_eager: bool = option(False, "run every step op by op: no CUDA graphs for decode steps on a GPU, no "
                                        "one-call C decode step on a CPU")
    async_scheduling: bool | None = option(
        None, "overlap the host with the device: step N+1 is scheduled and its inputs prepared while step N runs, "
        "its decode inputs filled in on the device from step N's tokens (vLLM's async scheduling). Default: on "
        "with CUDA on one rank where it applies (no speculation); with tensor parallelism it runs when asked for; "
        "not with pipeline parallelism; on a CPU "
        "the model runs on the host's own thread, so there is nothing to overlap")
    skip_tokenizer_init: bool = option(False, "load no tokenizer (token-id prompts only)")
    revision: str | None = option(None, "accepted for vLLM compatibility; models load from local directories")
    trust_remote_code: bool = option(False, "let transformers run the model directory's own tokenizer code")
    num_threads: int | None = option(None, "CPU threads for torch (default: torch's choice)")
    adaptive_cpu_threads: bool = option(True, "CPU: run fewer threads while other processes take cores, all "
                                        "of them again when the cores are free (cpu_threads.ThreadGovernor)")
    cpu_linear_kernel: str = option(
        "auto", "CPU GEMMs: onednn packs weights once; onednn+gemv adds a batch-1 GEMV kernel (a second weight "
        "copy); torch+gemv: F.linear for several rows, the GEMV kernel for one (for dtypes oneDNN cannot pack here, "
        "e.g. bfloat16 on AVX2); torch uses F.linear; auto picks onednn+gemv, or torch+gemv where oneDNN cannot "
        "pack the dtype, when the copy fits in memory",
        choices=("auto", "onednn", "onednn+gemv", "torch+gemv", "torch"))
    # Baseline modes, for the optimization ladder (`tokenmill bench ladder`): each turns one optimization
    # off, so its effect can be measured in the same engine. engine/variants.py maps them to classes.
    batching: str = option("continuous", "baseline mode static: a batch fills, runs to completion, then the "
                           "next starts", choices=("continuous", "static"))
    kv_layout: str = option("paged", "baseline mode contiguous: each request reserves max_model_len of KV up "
                            "front (no prefix caching)", choices=("paged", "contiguous"))
    attention_impl: str = option("fused", "baseline mode eager: materialized scores, repeated KV heads, one "
                                 "sequence at a time", choices=("fused", "eager"))
    static_batch_wait_s: float = option(0.05, "static batching: how long a partial batch waits to fill")
    mm_encoder_cache: bool = option(True, "baseline mode off: an image's encoder output is dropped once its request "
                                    "has passed it, so the same image is encoded again for every request")

    def __post_init__(self) -> None:
        if isinstance(self.quantize_lm_head, bool):  # the older boolean form: True meant int8
            self.quantize_lm_head = "int8" if self.quantize_lm_head else None
        for f in fields(self):
            choices = f.metadata.get("choices")
            if choices and getattr(self, f.name) not in choices:
                raise ValueError(f"{f.name} must be one of {', '.join(map(str, choices))}; got {getattr(self, f.name)!r}")
        self._check_sizes()
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.kv_layout == "contiguous":
            self.enable_prefix_caching = False  # nothing to share when every request owns a slab
        if self.batching == "static":
            self.enable_chunked_prefill = False
        self._check_parallel()
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        self._resolve_device()
        self._check_kv_tiers()
        self.speculative = SpeculativeConfig.parse(self.speculative_config)
        if not os.path.isdir(self.model):
            raise ValueError(f"model directory not found: {self.model!r} (models load from local directories only)")
        if self.tokenizer is not None and not os.path.isdir(self.tokenizer):  # (before the weights load, not after)
            raise ValueError(f"tokenizer directory not found: {self.tokenizer!r} (tokenizers load from local "
                             "directories only)")
        # a bad file or value fails at startup, not at the first request
        sampling_defaults(self.model, self.generation_config, self.override_generation_config)

    def _check_sizes(self) -> None:
        """Sizes that would fail deep in torch, or hang: a step budget of 0 schedules nothing, ever."""
        for name in ("block_size", "max_num_seqs", "max_model_len", "max_num_batched_tokens", "num_threads",
                     "tensor_parallel_size", "pipeline_parallel_size", "nnodes", "num_kv_blocks",
                     "mm_max_image_pixels", "mm_max_fetch_bytes", "mm_video_num_frames"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        cores = os.cpu_count() or 1
        if self.num_threads is not None and self.num_threads > 8 * cores:  # (torch crashes on 100,000)
            raise ValueError(f"num_threads {self.num_threads} is far past this machine's {cores} CPUs "
                             f"(at most {8 * cores})")
        gb = self.kv_cache_memory_gb
        if gb is not None and (isinstance(gb, bool) or not isinstance(gb, (int, float)) or not 0 < gb < float("inf")):
            raise ValueError(f"kv_cache_memory_gb must be a finite number > 0 (leave it unset for the default), "
                             f"got {gb!r}")
        for name in ("mm_fetch_timeout_s", "distributed_timeout_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < float("inf"):
                raise ValueError(f"{name} must be a finite number of seconds > 0, got {v!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not -2 ** 63 <= self.seed < 2 ** 64:
            raise ValueError(f"seed must be an integer in [-2**63, 2**64) (torch's), got {self.seed!r}")

    def _resolve_device(self) -> None:
        from tokenmill.attention.registry import resolve_attention_backend

        cuda = torch.cuda.is_available()
        if self.device == "auto":
            self.device = "cuda" if cuda else "cpu"
        elif self.device == "cuda" and not cuda:
            raise ValueError("device='cuda' was asked for, but torch sees no CUDA GPU (torch "
                             f"{torch.__version__}, CUDA build: {torch.version.cuda or 'none'}); install a CUDA build "
                             "of torch on a GPU machine, or use device='cpu'")
        self.attention_backend = resolve_attention_backend(self.attention_backend, self.device)

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def _check_parallel(self) -> None:
        tp, pp, nn = self.tensor_parallel_size, self.pipeline_parallel_size, self.nnodes
        if tp < 1 or pp < 1:
            raise ValueError(f"tensor_parallel_size and pipeline_parallel_size must be >= 1, got {tp} and {pp}")
        if nn < 1 or not 0 <= self.node_rank < nn:
            raise ValueError(f"node_rank must be in [0, nnodes), got node_rank={self.node_rank}, nnodes={nn}")
        if self.world_size % nn:
            raise ValueError(f"nnodes={nn} does not divide the {self.world_size} ranks (tp x pp)")
        if nn > 1 and not self.master_port:
            raise ValueError("a multi-node engine needs --master-port (and --master-addr) set on every node")
        if self.world_size == 1:
            return
        if self.kv_tiers_enabled:
            raise ValueError("KV tiers (kv_host_cache_gb, kv_disk_cache_dir, kv_remote_cache_url) do not run with "
                             "tensor or pipeline parallelism yet")
        if pp > 1 and self.speculative_config:
            raise ValueError("speculative decoding does not run with pipeline parallelism yet (tensor parallelism "
                             "is fine)")
        if self.batching == "static" and pp > 1:
            raise ValueError("static batching keeps one batch at a time: it cannot fill a pipeline")

    @property
    def kv_tiers_enabled(self) -> bool:
        return bool(self.kv_host_cache_gb or self.kv_disk_cache_dir or self.kv_remote_cache_url)

    def _check_kv_tiers(self) -> None:
        if not (math.isfinite(self.kv_host_cache_gb) and math.isfinite(self.kv_disk_cache_gb)
                and math.isfinite(self.kv_load_timeout_s)):  # (inf failed late, with a traceback)
            raise ValueError("kv_host_cache_gb, kv_disk_cache_gb and kv_load_timeout_s must be finite numbers")
        if self.kv_host_cache_gb < 0 or self.kv_disk_cache_gb <= 0:
            raise ValueError("kv_host_cache_gb must be >= 0 and kv_disk_cache_gb > 0")
        if self.kv_load_timeout_s <= 0:
            raise ValueError(f"kv_load_timeout_s must be > 0, got {self.kv_load_timeout_s}")
        if not self.kv_tiers_enabled:
            return
        if not self.enable_prefix_caching or self.kv_layout != "paged":
            raise ValueError("KV tiers store prefix-cache blocks: they need enable_prefix_caching and the paged layout")
        url = self.kv_remote_cache_url
        if url and not url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"kv_remote_cache_url must be a redis://, rediss:// or unix:// URL, got {url!r}")

    def _resolve_async_scheduling(self, model_config: ModelConfig) -> None:
        blockers = [why for why, on in (
            ("pipeline parallelism", self.pipeline_parallel_size > 1),
            ("speculative decoding", bool(self.speculative_config)),
            # 0 (automatic) just stays off (core.py); a GPU ignores bursts (the CPU's one-call step runs them)
            ("num_scheduler_steps > 1", self.num_scheduler_steps > 1 and self.device != "cuda")) if on]
        if self.async_scheduling is None:
            # with tensor parallelism it is tested on CPU ranks only: on by default once a multi-GPU run has checked
            # it (gpu_check.py runs one GPU), asked for meanwhile (--async-scheduling)
            self.async_scheduling = self.device == "cuda" and not blockers and self.tensor_parallel_size == 1
        elif self.async_scheduling and blockers:
            raise ValueError(f"async_scheduling does not run with {', '.join(blockers)} yet")

    def resolve(self, model_config: ModelConfig) -> None:
        """Fill defaults that depend on the model."""
        from tokenmill.distributed.layout import ParallelLayout, check_cpu_cores, check_model_split

        check_model_split(ParallelLayout(self.tensor_parallel_size, self.pipeline_parallel_size), model_config)
        if self.world_size > 1 and self.device == "cpu":
            check_cpu_cores(self.world_size // self.nnodes, self.allow_cpu_oversubscription)
        self.quantization = resolve_quantization(self.quantization, model_config.hf_config, self.model)
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
        if self.num_scheduler_steps is None:
            self.num_scheduler_steps = 1
        if self.num_scheduler_steps < 0:
            raise ValueError(f"num_scheduler_steps must be >= 1 (or 0: automatic), got {self.num_scheduler_steps}")
        if self.num_scheduler_steps > 1 and self.speculative_config:
            raise ValueError("num_scheduler_steps > 1 and speculative decoding both run several tokens per step: "
                             "choose one")
        self._resolve_async_scheduling(model_config)
        if self.long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be >= 0, got {self.long_prefill_token_threshold}")
        if self.max_long_partial_prefills < 0:
            raise ValueError(f"max_long_partial_prefills must be >= 0, got {self.max_long_partial_prefills}")
        if self.max_long_partial_prefills and not self.long_prefill_token_threshold:
            raise ValueError("max_long_partial_prefills needs long_prefill_token_threshold (which prompts count as "
                             "long)")
        if self.long_prefill_token_threshold and not self.enable_chunked_prefill:
            raise ValueError("long_prefill_token_threshold needs chunked prefill (a prompt's prefill is split "
                             "across steps only then)")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError("without chunked prefill, max_num_batched_tokens must be >= max_model_len")
        self._resolve_multimodal(model_config)

    def _resolve_multimodal(self, mc: ModelConfig) -> None:
        from tokenmill.multimodal.processor import parse_limits

        parse_limits(self.limit_mm_per_prompt)  # a bad value fails at startup, not at the first request
        if not mc.is_multimodal:
            return
        if self.world_size > 1:
            raise ValueError("multimodal models do not run with tensor or pipeline parallelism yet")
        if self.speculative is not None and self.speculative.method == "draft_model":
            raise ValueError("a draft model cannot see images: use speculative method 'ngram' with multimodal models")
        per_image = mc.mm_tokens_per_image
        if self.mm_encoder_budget is None:
            self.mm_encoder_budget = max(self.max_num_batched_tokens, per_image)
        if self.mm_encoder_cache_tokens is None:
            self.mm_encoder_cache_tokens = 8 * self.mm_encoder_budget
        if self.mm_encoder_budget < per_image:
            raise ValueError(f"mm_encoder_budget={self.mm_encoder_budget} is below one image's {per_image} encoder "
                             f"rows")
        if not self.enable_chunked_prefill and self.mm_encoder_budget < self.max_num_batched_tokens:
            # a prompt then runs whole, its images encoded in its one step: one with more image rows than the
            # budget would wait for ever
            raise ValueError(f"mm_encoder_budget={self.mm_encoder_budget} is below max_num_batched_tokens="
                             f"{self.max_num_batched_tokens}: without chunked prefill a prompt's images are all "
                             f"encoded in its one step (leave mm_encoder_budget unset, or enable chunked prefill)")
        if self.mm_encoder_cache_tokens < 2 * self.mm_encoder_budget:
            raise ValueError(f"mm_encoder_cache_tokens={self.mm_encoder_cache_tokens} must hold at least two steps' "
                             f"encoder budget ({2 * self.mm_encoder_budget})")

    def torch_dtype(self, model_config: ModelConfig) -> torch.dtype:
        if self.dtype != "auto":
            return _DTYPES[self.dtype]
        cfg = model_config.hf_config
        dt = getattr(cfg, "dtype", None) or getattr(cfg, "torch_dtype", None) or torch.float32
        if isinstance(dt, str):
            dt = _DTYPES.get(dt, torch.float32)
        if dt == torch.float16 and self.device == "cpu":
            dt = torch.bfloat16  # CPU float16 kernels are slow; bfloat16 has the same size.
        return dt
