"""The proposer (worker side) and the draft policy (scheduler side) an EngineConfig asks for."""
from __future__ import annotations

from dataclasses import replace

import torch

from tokenmill.spec_decode.adaptive import DraftPolicy
from tokenmill.spec_decode.config import SpeculativeConfig
from tokenmill.spec_decode.ngram import NgramProposer


def load_draft(config, target_mc, dtype: torch.dtype):
    """(draft model, its ModelConfig) for method draft_model, checked against the target first."""
    from tokenmill.config import ModelConfig
    from tokenmill.models.loader import load_hf_config, load_model

    spec = config.speculative
    draft_cfg = replace(config, model=spec.model, tokenizer=None, quantization=None, speculative_config=None,
                        load_format="auto", kv_host_cache_gb=0.0, kv_disk_cache_dir=None, kv_remote_cache_url=None,
                        tensor_parallel_size=1, pipeline_parallel_size=1, nnodes=1, node_rank=0)  # replicated
    mc = ModelConfig.from_hf(load_hf_config(spec.model))
    if mc.vocab_size != target_mc.vocab_size:
        raise ValueError(f"the draft model {spec.model!r} has a vocabulary of {mc.vocab_size} tokens, the target "
                         f"{target_mc.vocab_size}: a draft must share the target's tokenizer")
    if mc.max_position_embeddings < config.max_model_len:
        raise ValueError(f"the draft model {spec.model!r} handles {mc.max_position_embeddings} positions, fewer than "
                         f"max_model_len={config.max_model_len}; lower max_model_len or use a longer draft")
    draft_cfg.resolve(mc)
    draft_cfg.max_model_len = config.max_model_len
    return load_model(draft_cfg, mc, dtype, config.device), mc


def kv_bytes_per_block(mc, block_size: int, dtype: torch.dtype) -> int:
    return 2 * mc.num_layers * block_size * mc.num_kv_heads * mc.head_dim * dtype.itemsize


def build_proposer(spec: SpeculativeConfig | None, draft=None, num_blocks: int = 0, block_size: int = 0,
                   dtype: torch.dtype = torch.float32, device: str = "cpu", backend=None):
    if spec is None:
        return None
    if spec.method == "ngram":
        return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
    from tokenmill.spec_decode.draft_model import DraftModelProposer

    model, mc = draft
    shape = backend.kv_cache_shape(num_blocks, block_size, mc.num_kv_heads, mc.head_dim)
    kv = torch.zeros(mc.num_layers, 2, *shape, dtype=dtype, device=device)
    return DraftModelProposer(model, kv, backend)


def build_draft_policy(spec: SpeculativeConfig | None) -> DraftPolicy | None:
    if spec is None:
        return None
    # a draft model's first drafts after depth 0 cost it a catch-up over every live context: explore priced
    model = spec.method == "draft_model"
    return DraftPolicy(spec.num_speculative_tokens, spec.adaptive, price_looks=model, model_proposer=model,
                       per_request=not model)
