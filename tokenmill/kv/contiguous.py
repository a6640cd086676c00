"""Contiguous KV, the ladder's baseline: a request's first allocation reserves one adjacent run of blocks
for `max_model_len` tokens, as engines without paging preallocate per-request KV. Nothing is shared
(no prefix caching), and a free run long enough must exist: that fragmentation is what paging removes.

    pool   [a a a a][. .][b b b b][. . .]     reserve = 4 blocks
    a new request needs 4 adjacent free blocks: 5 are free, but no run of 4 -> it waits
"""
from __future__ import annotations

from tokenmill.engine.request import Request
from tokenmill.kv.block_pool import KVBlock
from tokenmill.kv.manager import KVCacheManager, cdiv


class ContiguousKVCacheManager(KVCacheManager):
    def __init__(self, num_blocks: int, block_size: int, reserve_tokens: int):
        super().__init__(num_blocks, block_size, enable_caching=False)
        self.reserve_blocks = cdiv(reserve_tokens, block_size)

    def allocate_slots(self, req: Request, num_new_tokens: int, cached: list[KVBlock] = (), **_) -> bool:
        if req.request_id in self.req_blocks:
            return True  # the first allocation reserved room for max_model_len
        run = self._free_run(self.reserve_blocks)
        if run is None:
            return False
        for b in run:
            self.pool.take_free(b)
        self.req_blocks[req.request_id] = run
        return True

    def _free_run(self, n: int) -> list[KVBlock] | None:
        """The first n adjacent free blocks, O(num_blocks)."""
        length = 0
        for b in self.pool.blocks:
            length = length + 1 if b.ref_cnt == 0 else 0
            if length == n:
                return self.pool.blocks[b.block_id - n + 1: b.block_id + 1]
        return None
