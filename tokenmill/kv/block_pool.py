"""Fixed-size KV blocks: O(1) allocate, free, and LRU eviction of cached blocks.

Free blocks live in one insertion-ordered dict used as an LRU queue. A free block may still hold a
cached prefix (it keeps its hash) until it is reallocated; a prefix hit pulls it back out of the queue.

    free queue (front = evicted first)
    [b7 (hash h3)] [b2] [b9 (hash h0)] ... <- freed blocks appended here

Caching a block and evicting one are reported to listeners as KV events (kv/events.py).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from tokenmill.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, KVEventListener


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None


class BlockPool:
    def __init__(self, num_blocks: int):
        if num_blocks <= 0:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[bytes, KVBlock] = {}
        self._listeners: list[KVEventListener] = []

    def subscribe(self, listener: KVEventListener) -> None:
        self._listeners.append(listener)

    def _emit(self, event: KVEvent) -> None:
        for listener in self._listeners:
            listener(event)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def free_blocks(self) -> list[KVBlock]:
        """Free blocks, least recently used first."""
        return list(self._free.values())

    def blocks_in_use(self) -> list[KVBlock]:
        return [b for b in self.blocks if b.ref_cnt > 0]

    def lookup(self, block_hash: bytes) -> KVBlock | None:
        return self._cached.get(block_hash)

    def touch(self, blocks: list[KVBlock]) -> None:
        """Take a reference to cached blocks (prefix hits), pulling free ones out of the queue."""
        for b in blocks:
            if b.ref_cnt == 0:
                del self._free[b.block_id]
            b.ref_cnt += 1

    def allocate(self, n: int) -> list[KVBlock]:
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} KV blocks with {len(self._free)} free")
        out = []
        for _ in range(n):
            _, b = self._free.popitem(last=False)
            self.evict(b)  # the least recently used cached prefix, if it holds one
            b.ref_cnt = 1
            out.append(b)
        return out

    def evict(self, b: KVBlock) -> None:
        """Drop a free block's cached prefix before the block is reused."""
        if b.block_hash is not None:
            del self._cached[b.block_hash]
            self._emit(BlockRemoved(b.block_id, b.block_hash))
            b.block_hash = None

    def uncache(self, b: KVBlock) -> None:
        """Forget a held block's hash because its KV was never computed (see KVCacheManager.free)."""
        if b.block_hash is not None and self._cached.get(b.block_hash) is b:
            del self._cached[b.block_hash]
            self._emit(BlockRemoved(b.block_id, b.block_hash, kv_valid=False))
        b.block_hash = None

    def take_free(self, b: KVBlock) -> None:
        """Allocate one particular free block (a baseline that needs adjacent ids picks its own)."""
        del self._free[b.block_id]
        self.evict(b)
        b.ref_cnt = 1

    def free(self, blocks_in_eviction_order) -> None:
        for b in blocks_in_eviction_order:
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                self._free[b.block_id] = b

    def cache(self, block: KVBlock, block_hash: bytes, parent_hash: bytes | None = None) -> bool:
        """Whether `block` was cached by this call (False: the hash was cached already, by this block, as a
        prefix hit, or by another that computed the same prefix: the first is kept)."""
        if block_hash in self._cached:
            return False
        block.block_hash = block_hash
        self._cached[block_hash] = block
        self._emit(BlockStored(block.block_id, block_hash, parent_hash))
        return True

    def uncache_if(self, block: KVBlock, block_hash: bytes) -> bool:
        """Forget `block_hash` if `block` still holds it (its KV was never computed); False where it moved on
        (evicted, or cached again under another hash)."""
        if block.block_hash != block_hash or self._cached.get(block_hash) is not block:
            return False
        self.uncache(block)
        return True

    def reset_prefix_cache(self) -> None:
        for b in self._cached.values():
            b.block_hash = None
        self._cached.clear()
        self._emit(AllBlocksCleared())

    def check_invariants(self) -> None:
        for b in self.blocks:
            assert b.ref_cnt >= 0, f"block {b.block_id} has ref_cnt {b.ref_cnt}"
            assert (b.ref_cnt == 0) == (b.block_id in self._free), f"block {b.block_id} free-list mismatch"
        for h, b in self._cached.items():
            assert b.block_hash == h, f"block {b.block_id} cache key mismatch"
