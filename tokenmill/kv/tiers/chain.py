"""The tiers in lookup order (host, disk, remote), seen from the scheduler: prefix lookups across tiers,
and the pool events that decide what to store.

A prefix may be spread over tiers (older blocks on disk, recent ones in RAM), so the lookup walks the
keys and asks the tiers, fastest first, for the longest run one of them holds from there (a run is read
from one tier in one batched call, even where a faster tier also has some of its blocks):

    keys       h0    h1    h2    h3    h4
    host        .     x     x     .     .
    disk        x     x     .     x     .
    lookup  -> [disk, disk, host, disk]       (h4 is in no tier: the run ends)
"""
from __future__ import annotations

from tokenmill.kv.events import BlockRemoved, BlockStored, KVEvent
from tokenmill.kv.tiers.connector import KVConnector
from tokenmill.kv.tiers.host import HostTier
from tokenmill.sched.output import BlockStore

STORE_POLICIES = ("evict", "write_through")


class TierChain:
    def __init__(self, tiers: list[KVConnector]):
        if not tiers:
            raise ValueError("a tier chain needs at least one tier")
        self.tiers = tiers
        self.host: HostTier | None = next((t for t in tiers if isinstance(t, HostTier)), None)

    def lookup(self, keys: list[bytes]) -> list[int]:
        """The tier index of each block in the longest leading run of `keys` found in some tier."""
        where: list[int] = []
        while len(where) < len(keys):
            rest = keys[len(where):]
            for i, tier in enumerate(self.tiers):
                n = tier.batched_exists(rest)
                if n:
                    where += [i] * n
                    break
            else:
                break
        return where

    def count_hits(self, tiers: list[int], block_size: int) -> None:
        for i in tiers:
            self.tiers[i].stats.hit_tokens += block_size

    def snapshot(self) -> dict[str, dict[str, float]]:
        return {t.name: t.snapshot() for t in self.tiers}

    def check_invariants(self) -> None:
        for t in self.tiers:
            t.check_invariants()

    def close(self) -> None:
        for t in self.tiers:
            t.close()


class StoreCollector:
    """Listens to the block pool and lists the blocks to copy down this step: evicted blocks (both
    policies) and, under write-through, blocks as they fill. Blocks the host tier already holds are only
    marked as recently used there."""

    def __init__(self, chain: TierChain, policy: str = "evict"):
        if policy not in STORE_POLICIES:
            raise ValueError(f"kv_cache_store_policy must be one of {', '.join(STORE_POLICIES)}; got {policy!r}")
        self.chain = chain
        self.write_through = policy == "write_through"
        self.evicted: list[BlockStore] = []
        self.filled: dict[bytes, BlockStore] = {}

    def __call__(self, event: KVEvent) -> None:
        if isinstance(event, BlockRemoved):
            if not event.kv_valid:  # never computed (preempted in the step that filled it): nothing to keep
                self.filled.pop(event.block_hash, None)
            elif not self._held(event.block_hash):
                self.evicted.append(BlockStore(event.block_id, event.block_hash))
        elif isinstance(event, BlockStored) and self.write_through and not self._held(event.block_hash):
            self.filled[event.block_hash] = BlockStore(event.block_id, event.block_hash)

    def _held(self, key: bytes) -> bool:
        return self.chain.host is not None and self.chain.host.touch(key)

    def take(self) -> tuple[list[BlockStore], list[BlockStore]]:
        """(evicted, filled) since the last call."""
        evicted, filled = self.evicted, list(self.filled.values())
        self.evicted, self.filled = [], {}
        return evicted, filled
