"""One rank's model runner: its shard of the model, the draft (speculation), its KV cache and proposer.
The driver (engine/core.py) and every worker process (distributed/worker.py) build theirs here, so all
ranks make the same decisions from the same config."""
from __future__ import annotations

import torch

from tokenmill.config import EngineConfig, ModelConfig
from tokenmill.distributed.comm import WHOLE_MODEL, ModelShard, PipelineLink
from tokenmill.distributed.layout import kv_head_split
from tokenmill.engine.variants import build_attention_backend
from tokenmill.kv.manager import cdiv
from tokenmill.models.loader import load_model
from tokenmill.spec_decode.build import build_proposer, kv_bytes_per_block, load_draft
from tokenmill.worker.encoder_runner import EncoderRunner
from tokenmill.worker.model_runner import ModelRunner

_DEFAULT_CPU_KV_GB = 4.0


def build_runner(config: EngineConfig, mc: ModelConfig, dtype: torch.dtype, shard: ModelShard = WHOLE_MODEL,
                 pipeline: PipelineLink | None = None, agree=lambda n: n) -> ModelRunner:
    """`agree` turns this rank's KV block count into the one every rank uses (the minimum, when distributed)."""
    model = load_model(config, mc, dtype, config.device, shard)
    spec = config.speculative
    # the draft proposes where tokens are sampled: on the last stage, replicated on its TP ranks
    draft = None
    if spec is not None and spec.method == "draft_model" and shard.is_last_stage:
        draft = load_draft(config, mc, dtype)
    layers = len(shard.layers(mc.num_layers))
    kv_heads, _ = kv_head_split(mc.num_kv_heads, shard.tp.size, shard.tp.rank)
    num_blocks = agree(num_kv_blocks(config, mc, dtype, layers, kv_heads, draft[1] if draft else None))
    proposer = None
    if shard.is_last_stage:
        proposer = build_proposer(spec, draft, num_blocks, config.block_size, dtype, config.device,
                                  build_attention_backend(config))
    runner = ModelRunner(model, build_attention_backend(config), num_blocks, config.block_size, layers, kv_heads,
                         mc.head_dim, dtype, config.device, config.seed, proposer=proposer, pipeline=pipeline,
                         hidden_size=mc.hidden_size)
    if mc.is_multimodal:
        runner.encoder = EncoderRunner(model, config.device, dtype, config.mm_encoder_overlap)
    return runner


def num_kv_blocks(cfg: EngineConfig, mc: ModelConfig, dtype: torch.dtype, layers: int, kv_heads: int,
                  draft_mc: ModelConfig | None = None) -> int:
    """KV blocks for this rank's layers and heads within its memory budget (per rank: each GPU, or each CPU
    rank's share of kv_cache_memory_gb)."""
    per_seq = cdiv(cfg.max_model_len, cfg.block_size)
    bytes_per_block = 2 * layers * cfg.block_size * kv_heads * mc.head_dim * dtype.itemsize
    if draft_mc is not None:  # the draft's KV lives in the same blocks (spec_decode/draft_model.py)
        bytes_per_block += kv_bytes_per_block(draft_mc, cfg.block_size, dtype)
    if cfg.num_kv_blocks is not None:
        n = cfg.num_kv_blocks
    elif cfg.device == "cuda":
        free, total = torch.cuda.mem_get_info()
        used = total - free
        # leave room for one worst-case step's activations (a rough bound; logits dominate)
        act = cfg.max_num_batched_tokens * (mc.hidden_size * 16 + mc.vocab_size * 4)
        n = int((total * cfg.gpu_memory_utilization - used - act) // bytes_per_block)
    else:
        gb = (cfg.kv_cache_memory_gb or _DEFAULT_CPU_KV_GB) / cfg.world_size
        # more blocks than every sequence at full length can use only ever holds cached prefixes
        n = min(int(gb * 2**30 // bytes_per_block), cfg.max_num_seqs * per_seq + per_seq)
    if n < per_seq:
        raise ValueError(f"the KV cache holds {n} blocks but one {cfg.max_model_len}-token sequence needs "
                         f"{per_seq}; raise the KV memory budget or lower max_model_len")
    return n
