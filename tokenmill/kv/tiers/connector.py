"""The storage interface every KV tier implements, in the shape of LMCache's storage backends and vLLM's
KV connectors: get / put / exists and batched forms, keyed by a block's chained hash.

A stored value is one block's KV for every layer, a contiguous CPU tensor:

    [num_layers, 2 (key | value), block_size, num_kv_heads, head_dim]   in the cache dtype

Batched lookups have prefix semantics: because a block hash covers every token before it, the useful
answer is how many of the leading keys are present, not which ones. Tiers never raise on I/O trouble:
a failed read is a miss, a failed write is a dropped block, and both are counted and logged.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import torch

logger = logging.getLogger("tokenmill")


@dataclass
class TierStats:
    """Counters of one tier; `get_stats()`, /metrics and the bench output report them."""
    hit_tokens: int = 0  # prompt tokens served from this tier (counted by the scheduler when a load lands)
    blocks_stored: int = 0
    bytes_stored: int = 0
    blocks_loaded: int = 0
    bytes_loaded: int = 0
    store_seconds: float = 0.0  # time spent writing blocks, summed
    load_seconds: float = 0.0  # time spent reading blocks, summed
    errors: int = 0  # failed reads and writes, corrupt files included
    stores_dropped: int = 0  # blocks never written because the tier's store queue was full (it is behind)
    blocks: int = 0  # occupancy now
    bytes: int = 0
    capacity_bytes: int = 0

    def as_dict(self) -> dict[str, float]:
        return dict(vars(self))  # flat numbers: no deep copy needed (this runs every step)


class KVConnector:
    """One tier. Implementations are thread-safe: the scheduler looks up, the transfer threads read and write."""

    name = "tier"
    capacity_bytes = 0  # a bounded tier sets its cap (a full disk may lower it); 0: bounded elsewhere (Redis)

    def __init__(self) -> None:
        self.stats = TierStats()
        self._lock = threading.Lock()
        self._last_warning = 0.0
        self._lookups_off_until = 0.0  # a tier whose lookups were slow answers misses until then

    # -- the interface ------------------------------------------------------------------------------------
    def exists(self, key: bytes) -> bool:
        raise NotImplementedError

    def get(self, key: bytes) -> torch.Tensor | None:
        raise NotImplementedError

    def put(self, key: bytes, block: torch.Tensor) -> None:
        raise NotImplementedError

    def batched_exists(self, keys: list[bytes]) -> int:
        """How many of the leading `keys` this tier holds."""
        n = 0
        for k in keys:
            if not self.exists(k):
                break
            n += 1
        return n

    def batched_get(self, keys: list[bytes]) -> list[torch.Tensor]:
        """The leading run of `keys` this tier could read (stops at the first miss)."""
        out = []
        for k in keys:
            block = self.get(k)
            if block is None:
                break
            out.append(block)
        return out

    def batched_put(self, keys: list[bytes], blocks: list[torch.Tensor]) -> None:
        for k, b in zip(keys, blocks):
            self.put(k, b)

    def occupancy(self) -> tuple[int, int]:
        """(blocks, bytes) held now."""
        raise NotImplementedError

    def close(self) -> None:
        pass

    def check_invariants(self) -> None:
        """The tier's byte accounting matches what it holds, within its cap."""

    # -- shared bookkeeping -------------------------------------------------------------------------------
    def _lookups_paused(self) -> bool:
        return time.monotonic() < self._lookups_off_until

    def _pause_if_slow(self, t0: float, limit_s: float, pause_s: float, what: str) -> None:
        """Lookups run on the scheduler's thread, once per waiting request and step: one that took over `limit_s`
        (since monotonic `t0`) turns this tier's lookups into misses for `pause_s`, so a slow tier costs a slow
        step now and then, not every step."""
        took = time.monotonic() - t0
        if took > limit_s:
            self._lookups_off_until = time.monotonic() + pause_s
            self._warn("%s took %.0f ms for a lookup; lookups skipped (misses) for %.0f s", what, took * 1e3,
                       pause_s)
    def snapshot(self) -> dict[str, float]:
        self.stats.blocks, self.stats.bytes = self.occupancy()
        self.stats.capacity_bytes = self.capacity_bytes
        return self.stats.as_dict()

    def _count_store(self, nbytes: int, t0: float) -> None:
        s = self.stats
        s.blocks_stored += 1
        s.bytes_stored += nbytes
        s.store_seconds += time.perf_counter() - t0

    def _count_load(self, nbytes: int, t0: float) -> None:
        s = self.stats
        s.blocks_loaded += 1
        s.bytes_loaded += nbytes
        s.load_seconds += time.perf_counter() - t0

    def _warn(self, msg: str, *args) -> None:
        """Count an error; log at most one warning per 10 s per tier (a dead disk must not flood the log)."""
        self.stats.errors += 1
        now = time.monotonic()
        if now - self._last_warning >= 10.0:
            self._last_warning = now
            logger.warning("KV %s tier: " + msg, self.name, *args)
