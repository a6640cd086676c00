"""Per-request block tables over the block pool, with automatic prefix caching.

A request's block table maps token positions to cache slots:

    position p  ->  block_table[p // block_size] * block_size + p % block_size   (its slot)

    block_table  [ 4 ][ 9 ][ 2 ]            block_size = 4
    positions     0-3  4-7  8-9 (2 free slots: the only waste, one partial block)
"""
from __future__ import annotations

from dataclasses import dataclass

from tokenmill.engine.request import Request
from tokenmill.kv.block_pool import BlockPool, KVBlock
from tokenmill.kv.hashing import extend_block_hashes
from tokenmill.kv.tiers.chain import StoreCollector, TierChain


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of which found in the cache

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    """`tiers`, when given, are consulted after the pool (find_tier_prefix) and receive what the pool
    evicts (take_stores); see kv/tiers/chain.py."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 tiers: TierChain | None = None, store_policy: str = "evict"):
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks)
        self.req_blocks: dict[str, list[KVBlock]] = {}
        self._num_cached: dict[str, int] = {}
        self._registered: list[tuple[KVBlock, bytes]] = []  # since the last take_registered (one step's)
        self.stats = PrefixCacheStats()
        self.tiers = tiers
        self._stores = None
        if tiers is not None:
            self._stores = StoreCollector(tiers, store_policy)
            self.pool.subscribe(self._stores)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def usage(self) -> float:
        return 1.0 - self.pool.num_free / self.pool.num_blocks

    def fits(self, num_new_blocks: int, cached: list[KVBlock] = (), reserved: int = 0) -> bool:
        """Whether `num_new_blocks` beyond the prefix hits `cached` can be taken while `reserved` free blocks
        stay for others (cached hits sitting in the free queue leave it when adopted)."""
        reclaimed = sum(1 for b in cached if b.ref_cnt == 0)
        return num_new_blocks + reserved <= self.pool.num_free - reclaimed

    def blocks_still_needed(self, req: Request, num_tokens: int) -> int:
        """Blocks `req` lacks to hold `num_tokens` tokens (0 once it holds them)."""
        return max(0, cdiv(num_tokens, self.block_size) - len(self.req_blocks.get(req.request_id, ())))

    def block_ids(self, request_id: str, start: int = 0) -> list[int]:
        """The request's block table from entry `start` on."""
        blocks = self.req_blocks.get(request_id, ())
        return [b.block_id for b in blocks[start:]] if len(blocks) > start else []  # most steps: none new

    def _hashes(self, req: Request, num_tokens: int) -> list[bytes]:
        extend_block_hashes(req.block_hashes, req.token_ids, num_tokens, self.block_size, req.block_extra_keys)
        return req.block_hashes

    def _cacheable(self, req: Request) -> bool:
        """Whether `req` looks up the prefix cache (prompt logprobs need every prompt position computed)."""
        return self.enable_caching and req.sampling_params.prompt_logprobs is None

    def find_cached_prefix(self, req: Request) -> list[KVBlock]:
        """Longest run of cached full blocks at the start of the request. At least one token is left
        to compute, because sampling needs the last position's logits. Counts nothing: a waiting request is
        looked up again every step it is not admitted (`count_prefix_lookup` counts the one that admits it)."""
        if not self._cacheable(req):
            return []
        max_blocks = (req.num_tokens - 1) // self.block_size
        hit = []
        for h in self._hashes(req, max_blocks * self.block_size)[:max_blocks]:
            b = self.pool.lookup(h)
            if b is None:
                break
            hit.append(b)
        return hit

    def count_prefix_lookup(self, req: Request, hit: list[KVBlock]) -> None:
        """The prefix-cache stats of one admission (or tier load start): `req`'s tokens, `hit` found cached."""
        if self._cacheable(req):
            self.stats.queries += req.num_tokens
            self.stats.hits += len(hit) * self.block_size

    def find_tier_prefix(self, req: Request, num_pool_blocks: int) -> list[int]:
        """After `num_pool_blocks` pool hits: the tier of each following block the tiers hold (same limit
        as the pool: the last token is always computed)."""
        if self.tiers is None or not self.enable_caching or req.sampling_params.prompt_logprobs is not None:
            return []
        max_blocks = (req.num_tokens - 1) // self.block_size
        return self.tiers.lookup(req.block_hashes[num_pool_blocks:max_blocks])

    def allocate_for_load(self, req: Request, cached: list[KVBlock], num_blocks: int, reserved: int = 0) -> bool:
        """Adopt the pool hits and take `num_blocks` fresh blocks for a tier load, leaving `reserved` free; their
        hashes are registered only once the load lands (finish_load)."""
        if not self.fits(num_blocks, cached, reserved) or not self.allocate_slots(
                req, num_blocks * self.block_size, cached, register=False):
            return False
        self._num_cached[req.request_id] = len(cached)
        return True

    def finish_load(self, req: Request, num_loaded: int) -> None:
        """Register the first `num_loaded` loaded blocks in the prefix cache, then give every block back:
        the loaded ones stay findable there, so the request's admission finds them as pool hits."""
        blocks = self.req_blocks.get(req.request_id, [])
        start = self._num_cached.get(req.request_id, 0)
        for i in range(start, start + num_loaded):
            self.pool.cache(blocks[i], req.block_hashes[i], req.block_hashes[i - 1] if i else None)
        self.free(req)

    def take_stores(self):
        """(evicted, filled) blocks to copy down the tiers this step; see StoreCollector."""
        return self._stores.take() if self._stores is not None else ([], [])

    def allocate_slots(self, req: Request, num_new_tokens: int, cached: list[KVBlock] = (),
                       register: bool = True, num_draft_tokens: int = 0) -> bool:
        """Reserve slots for `num_new_tokens` after `req.num_computed_tokens`, adopting `cached`
        (prefix hits, whose tokens `req.num_computed_tokens` already counts). False if blocks run out.
        The last `num_draft_tokens` are speculative: they get slots but never enter the prefix cache."""
        blocks = self.req_blocks.get(req.request_id)
        total = req.num_computed_tokens + num_new_tokens
        if blocks is not None and not cached and total <= len(blocks) * self.block_size:
            need = 0  # most decodes: the slots are in blocks it holds
        else:
            need = cdiv(total, self.block_size) - (len(blocks) if blocks else 0) - len(cached)
        if blocks is None or need > 0 or cached:
            if not self.fits(need, cached):
                return False
            self.pool.touch(cached)
            blocks = self.req_blocks.setdefault(req.request_id, [])
            blocks.extend(cached)
            if need > 0:
                blocks.extend(self.pool.allocate(need))
        if self.enable_caching and register:
            # Blocks that will be full once this step runs are registered now; their tokens are known.
            full = (total - num_draft_tokens) // self.block_size
            if full > self._num_cached.get(req.request_id, 0):  # most decodes fill none
                self._register(req, blocks, full)
        return True

    def _register(self, req: Request, blocks: list[KVBlock], full: int) -> None:
        """Offer the request's first `full` blocks to the prefix cache (those not offered yet)."""
        done = self._num_cached.get(req.request_id, 0)
        if full > done:
            hashes = self._hashes(req, full * self.block_size)
            for i in range(done, full):
                # only what this step caches: a prefix hit's block holds KV an earlier step computed, which a
                # failure of this step must not take out of the cache
                if self.pool.cache(blocks[i], hashes[i], hashes[i - 1] if i else None):
                    self._registered.append((blocks[i], hashes[i]))
            self._num_cached[req.request_id] = full

    def take_registered(self) -> list[tuple[KVBlock, bytes]]:
        """The (block, hash) pairs registered since the last call: the scheduler keeps a step's, to take them
        back out of the cache if that step fails (their KV then never exists)."""
        out, self._registered = self._registered, []
        return out

    def unregister(self, registered: list[tuple[KVBlock, bytes]]) -> dict[str, int]:
        """A failed step's registrations leave the prefix cache (where the block still holds that hash), whoever
        holds the blocks now. Returns, per request holding one of them, the index of its first such block."""
        dropped = {b.block_id for b, h in registered if self.pool.uncache_if(b, h)}
        lost = {}
        if dropped:
            for rid, blocks in self.req_blocks.items():
                n = self._num_cached.get(rid, 0)
                first = next((i for i in range(n) if blocks[i].block_id in dropped), n)
                if first < n:
                    self._num_cached[rid] = lost[rid] = first  # registered again once it has recomputed them
        return lost

    def cache_written(self, req: Request, num_tokens: int) -> None:
        """Register the full blocks among the first `num_tokens` tokens, whose KV is written and whose ids are
        `req`'s: a request that finishes after a burst or a verification, where the last blocks' slots were
        reserved like drafts' (registered only at a next allocation, which a finished request never makes)."""
        blocks = self.req_blocks.get(req.request_id)
        if self.enable_caching and blocks:
            self._register(req, blocks, min(num_tokens // self.block_size, len(blocks)))

    def free(self, req: Request, num_valid_tokens: int | None = None) -> None:
        """Give the request's blocks back. With `num_valid_tokens` (a preemption inside the step that
        scheduled the request), blocks registered for tokens past it were never computed: they lose their
        hash first, so no later request can hit them."""
        blocks = self.req_blocks.pop(req.request_id, None)
        registered = self._num_cached.pop(req.request_id, 0)
        if blocks:
            if num_valid_tokens is not None:
                for b in blocks[num_valid_tokens // self.block_size:registered]:
                    self.pool.uncache(b)
            self.pool.free(reversed(blocks))  # tail blocks first: they are the least likely to be shared

    def reset_prefix_cache(self) -> None:
        self.pool.reset_prefix_cache()

    def check_invariants(self) -> None:
        """Every block's ref count equals the number of block tables that hold it."""
        refs: dict[int, int] = {}
        for blocks in self.req_blocks.values():
            for b in blocks:
                refs[b.block_id] = refs.get(b.block_id, 0) + 1
        for b in self.pool.blocks:
            assert b.ref_cnt == refs.get(b.block_id, 0), (
                f"block {b.block_id}: ref_cnt {b.ref_cnt} but held by {refs.get(b.block_id, 0)} requests")
        self.pool.check_invariants()
