"""Builds the tier chain an EngineConfig asks for: host RAM, then local disk, then Redis."""
from __future__ import annotations

import logging

import torch

from tokenmill.kv.tiers.blockfile import payload_bytes
from tokenmill.kv.tiers.chain import TierChain
from tokenmill.kv.tiers.connector import KVConnector
from tokenmill.kv.tiers.fingerprint import model_fingerprint, weights_identity

logger = logging.getLogger("tokenmill")
_GIB = 1 << 30


def build_tier_chain(config, architecture: str, dtype: torch.dtype, block_shape: tuple[int, ...],
                     kv_layout: str, tp_rank: int = 0) -> TierChain | None:
    """`block_shape` is one block of every layer: [layers, 2, block_size, kv_heads, head_dim]."""
    if not config.kv_tiers_enabled:
        return None
    from tokenmill.kv.tiers.disk import DiskTier
    from tokenmill.kv.tiers.host import HostTier
    from tokenmill.kv.tiers.redis_tier import RedisTier

    fp = model_fingerprint(
        architecture=architecture, weights_id=weights_identity(config.model, config.load_format, config.seed),
        dtype=str(dtype), block_size=config.block_size, kv_block_shape=block_shape, kv_layout=kv_layout,
        quantization=config.quantization, mm_encoder_quantization=config.mm_encoder_quantization, tp_rank=tp_rank)
    tiers: list[KVConnector] = []
    if config.kv_host_cache_gb:
        tiers.append(HostTier(int(config.kv_host_cache_gb * _GIB)))
    if config.kv_disk_cache_dir:
        tiers.append(DiskTier(config.kv_disk_cache_dir, int(config.kv_disk_cache_gb * _GIB), fp, block_shape, dtype))
    if config.kv_remote_cache_url:
        tiers.append(RedisTier(config.kv_remote_cache_url, fp, block_shape, dtype))
    block_bytes = payload_bytes(block_shape, dtype)
    logger.info("KV tiers: %s; %d bytes per block (%d per token), model fingerprint %s",
                ", ".join(t.name for t in tiers), block_bytes, block_bytes // config.block_size, fp.hex()[:12])
    return TierChain(tiers)
