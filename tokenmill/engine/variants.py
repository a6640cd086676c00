"""The one place where an EngineConfig picks the classes of the step loop. The production classes know
nothing of the ladder's baseline modes (`tokenmill bench ladder`); each mode is a small subclass,
swapped in here:

    batching="static"        -> sched/static.py      StaticBatchScheduler
    kv_layout="contiguous"   -> kv/contiguous.py     ContiguousKVCacheManager
    attention_backend        -> attention/registry.py -> TorchAttentionBackend | TritonAttentionBackend
    attention_impl="eager"   -> attention/registry.py -> EagerAttentionBackend
    mm_encoder_cache=False   -> multimodal/encoder_cache.py NoReuseEncoderCache
"""
from __future__ import annotations

from tokenmill.attention.backend import AttentionBackend
from tokenmill.attention.registry import attention_backend_class
from tokenmill.config import EngineConfig
from tokenmill.kv.contiguous import ContiguousKVCacheManager
from tokenmill.kv.manager import KVCacheManager
from tokenmill.kv.tiers.chain import TierChain
from tokenmill.multimodal.encoder_cache import EncoderCacheManager, NoReuseEncoderCache
from tokenmill.multimodal.encoder_scheduler import EncoderScheduler
from tokenmill.sched.scheduler import Scheduler
from tokenmill.sched.static import StaticBatchScheduler
from tokenmill.spec_decode.build import build_draft_policy


def build_kv_manager(config: EngineConfig, num_blocks: int, tiers: TierChain | None = None) -> KVCacheManager:
    if config.kv_layout == "contiguous":
        return ContiguousKVCacheManager(num_blocks, config.block_size, reserve_tokens=config.max_model_len)
    return KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching, tiers,
                          config.kv_cache_store_policy)


def build_scheduler(config: EngineConfig, kv: KVCacheManager, multimodal: bool = False) -> Scheduler:
    args = (kv, config.max_num_seqs, config.max_num_batched_tokens, config.max_model_len, config.scheduling_policy,
            config.enable_chunked_prefill, build_draft_policy(config.speculative), config.long_prefill_token_threshold)
    encoder = None
    if multimodal:
        cache_class = EncoderCacheManager if config.mm_encoder_cache else NoReuseEncoderCache
        encoder = EncoderScheduler(cache_class(config.mm_encoder_cache_tokens), config.mm_encoder_budget,
                                   config.mm_encoder_overlap)
    if config.batching == "static":
        return StaticBatchScheduler(*args, encoder=encoder, batch_wait_s=config.static_batch_wait_s)
    return Scheduler(*args, encoder=encoder, max_long_partial_prefills=config.max_long_partial_prefills)


def build_attention_backend(config: EngineConfig) -> AttentionBackend:
    name = "eager" if config.attention_impl == "eager" else config.attention_backend
    return attention_backend_class(name)()
