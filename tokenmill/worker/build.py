"""One rank's model runner: its shard of the model, the draft (speculation), its KV cache and proposer.
The driver (engine/core.py) and every worker process (distributed/worker.py) build theirs here, so all
ranks make the same decisions from the same config."""
from __future__ import annotations

import logging

import torch

from tokenmill import cpu_malloc
from tokenmill.config import EngineConfig, ModelConfig
from tokenmill.distributed.comm import WHOLE_MODEL, ModelShard, PipelineLink
from tokenmill.distributed.layout import kv_head_split
from tokenmill.engine.variants import build_attention_backend
from tokenmill.kv.manager import cdiv
from tokenmill.models.loader import load_model
from tokenmill.sample.grammar import GrammarCompiler
from tokenmill.tokenizer import load_tokenizer
from tokenmill.spec_decode.build import build_proposer, kv_bytes_per_block, load_draft
from tokenmill.worker.encoder_runner import EncoderRunner
from tokenmill.spec_decode.draft_model import DraftModelProposer
from tokenmill.worker.cpu_decode_step import CpuDecodeStep
from tokenmill.worker.cuda_graphs import MIRRORS, DecodeGraphs
from tokenmill.worker.memory_profile import GIB, GpuMemoryBudget, WorstCase, measure_gpu_budget
from tokenmill.worker.model_runner import ModelRunner

logger = logging.getLogger("tokenmill")
_DEFAULT_CPU_KV_GB = 4.0


def build_runner(config: EngineConfig, mc: ModelConfig, dtype: torch.dtype, shard: ModelShard = WHOLE_MODEL,
                 pipeline: PipelineLink | None = None, agree=lambda n: n) -> ModelRunner:
    """`agree` turns this rank's KV block count into the one every rank uses (the minimum, when distributed)."""
    if config.device == "cuda":  # an earlier engine's cached blocks must not hold this one's weights: they
        torch.cuda.empty_cache()  # could not be released, and the KV sizing would count them as in use
    model = load_model(config, mc, dtype, config.device, shard)
    spec = config.speculative
    # the draft proposes where tokens are sampled: on the last stage, replicated on its TP ranks
    draft = None
    if spec is not None and spec.method == "draft_model" and shard.is_last_stage:
        draft = load_draft(config, mc, dtype)
    layers = len(shard.layers(mc.num_layers))
    kv_heads, _ = kv_head_split(mc.num_kv_heads, shard.tp.size, shard.tp.rank)

    def make_runner(num_blocks: int) -> ModelRunner:
        proposer = None
        if shard.is_last_stage:
            proposer = build_proposer(spec, draft, num_blocks, config.block_size, dtype, config.device,
                                      build_attention_backend(config))
        return ModelRunner(model, build_attention_backend(config), num_blocks, config.block_size, layers, kv_heads,
                           mc.head_dim, dtype, config.device, config.seed, proposer=proposer, pipeline=pipeline,
                           hidden_size=mc.hidden_size)

    budget = None
    if profiles_kv_cache(config, shard):
        worst = WorstCase.for_limits(config.max_num_batched_tokens, config.max_num_seqs, config.max_model_len,
                                     config.block_size, spec.num_speculative_tokens if spec is not None else 0)
        budget = measure_gpu_budget(make_runner, worst, config.gpu_memory_utilization,
                                    kv_block_bytes(config, mc, dtype, layers, kv_heads, draft[1] if draft else None))
    num_blocks = agree(num_kv_blocks(config, mc, dtype, layers, kv_heads, draft[1] if draft else None, budget))
    runner = make_runner(num_blocks)
    if not config.enforce_eager and pipeline is None and not mc.is_multimodal:
        runner.decode_step = captured_decode_step(config, model, runner.backend, runner.kv_caches)
        proposer = runner.proposer
        if isinstance(proposer, DraftModelProposer):  # the draft's own steps too (CUDA graphs or the C step)
            # k + 1 mirrors: a proposal's k chained draft steps are staged without waiting for their copies
            proposer.decode_step = captured_decode_step(config, proposer.model, proposer.backend, proposer.kv_caches,
                                                        mirrors=max(MIRRORS, spec.num_speculative_tokens + 1))
    runner.grammars = GrammarCompiler(None, mc.vocab_size, load_tokenizer=lambda: _tokenizer(config))
    if mc.is_multimodal:
        runner.encoder = EncoderRunner(model, config.device, dtype, config.mm_encoder_overlap)
    if config.device == "cpu":
        cpu_malloc.tune_for_steps()  # after the load: what it freed goes back to the OS first
    return runner


def _tokenizer(config: EngineConfig):
    """The tokenizer, for structured outputs' grammars: loaded by the first such request (None without one)."""
    if config.skip_tokenizer_init:
        return None
    return load_tokenizer(config.tokenizer or config.model, config.trust_remote_code)


def profiles_kv_cache(config: EngineConfig, shard: ModelShard) -> bool:
    """Whether this rank sizes its KV cache by running the worst-case step (CUDA). A rank that holds every
    layer can, tensor-parallel ranks included: they all build with the same config, so they run the same
    profile step at once and its all-reduces pair up. A pipeline stage cannot run a step alone and takes a
    bound (num_kv_blocks)."""
    return (config.device == "cuda" and config.num_kv_blocks is None
            and shard.is_first_stage and shard.is_last_stage)


def captured_decode_step(config: EngineConfig, model, backend, kv_caches, mirrors: int = MIRRORS):
    """CUDA graphs on a GPU, the one-call C decode step on a CPU (None where neither applies)."""
    if config.device == "cuda":
        if not backend.cuda_graph_safe:
            return None
        return DecodeGraphs(model, backend, kv_caches, config.max_num_seqs, config.max_model_len, config.block_size,
                            config.device, mirrors=mirrors)
    return CpuDecodeStep.build(model, backend, kv_caches, config.block_size)


def kv_block_bytes(cfg: EngineConfig, mc: ModelConfig, dtype: torch.dtype, layers: int, kv_heads: int,
                   draft_mc: ModelConfig | None = None) -> int:
    """Bytes of one KV block over this rank's layers and heads (and the draft's, which shares the blocks)."""
    n = 2 * layers * cfg.block_size * kv_heads * mc.head_dim * dtype.itemsize
    if draft_mc is not None:  # the draft's KV lives in the same blocks (spec_decode/draft_model.py)
        n += kv_bytes_per_block(draft_mc, cfg.block_size, dtype)
    return n


def num_kv_blocks(cfg: EngineConfig, mc: ModelConfig, dtype: torch.dtype, layers: int, kv_heads: int,
                  draft_mc: ModelConfig | None = None, budget: GpuMemoryBudget | None = None) -> int:
    """KV blocks for this rank's layers and heads within its memory budget (per rank: each GPU, measured by
    worker/memory_profile.py, or each CPU rank's share of kv_cache_memory_gb)."""
    per_seq = cdiv(cfg.max_model_len, cfg.block_size)
    bytes_per_block = kv_block_bytes(cfg, mc, dtype, layers, kv_heads, draft_mc)
    if cfg.num_kv_blocks is not None:
        n = cfg.num_kv_blocks
    elif cfg.device == "cuda":
        if budget is None:  # a pipeline stage cannot run a step alone: a bound (logits dominate)
            free, total = torch.cuda.mem_get_info()
            act = cfg.max_num_batched_tokens * (mc.hidden_size * 16 + mc.vocab_size * 4)
            budget = GpuMemoryBudget(total, cfg.gpu_memory_utilization, total - free, act)
        n = max(budget.kv_bytes // bytes_per_block, 0)
        # as on a CPU: blocks past every sequence at full length only hold cached prefixes, and each costs
        # the block pool a host object (a tiny model on a big GPU would get millions)
        n = min(n, cfg.max_num_seqs * per_seq + per_seq)
        if n >= per_seq:
            logger.info("GPU KV cache: %d blocks of %d tokens (%.2f GiB); %s", n, cfg.block_size,
                        n * bytes_per_block / GIB, budget.describe())
        else:
            raise ValueError(f"not enough GPU memory for one {cfg.max_model_len}-token sequence: it needs {per_seq} "
                             f"KV blocks of {bytes_per_block / 2**20:.2f} MiB ({per_seq * bytes_per_block / GIB:.2f} "
                             f"GiB), and {n} fit. {budget.describe()}. Raise gpu_memory_utilization, lower "
                             "max_model_len or max_num_batched_tokens, or quantize the weights")
    else:
        gb = (cfg.kv_cache_memory_gb or _DEFAULT_CPU_KV_GB) / cfg.world_size
        # more blocks than every sequence at full length can use only ever holds cached prefixes
        n = min(int(gb * 2**30 // bytes_per_block), cfg.max_num_seqs * per_seq + per_seq)
    if n < per_seq:
        raise ValueError(f"the KV cache holds {n} blocks but one {cfg.max_model_len}-token sequence needs "
                         f"{per_seq}; raise the KV memory budget or lower max_model_len")
    return n
