"""Host-RAM tier: an LRU of block tensors bounded in bytes. On a GPU the blocks would live in pinned
memory so that copies to and from the device run asynchronously; on CPU they are plain tensors."""
from __future__ import annotations

import time
from collections import OrderedDict

import torch

from tokenmill.kv.tiers.connector import KVConnector


class HostTier(KVConnector):
    name = "host"

    def __init__(self, capacity_bytes: int):
        super().__init__()
        self.capacity_bytes = capacity_bytes
        self._blocks: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self._bytes = 0

    def exists(self, key: bytes) -> bool:
        with self._lock:
            return key in self._blocks

    def touch(self, key: bytes) -> bool:
        """Mark a held block as recently used; False if it is not held."""
        with self._lock:
            if key not in self._blocks:
                return False
            self._blocks.move_to_end(key)
            return True

    def get(self, key: bytes) -> torch.Tensor | None:
        t0 = time.perf_counter()
        with self._lock:
            block = self._blocks.get(key)
            if block is None:
                return None
            self._blocks.move_to_end(key)
        self._count_load(block.nbytes, t0)
        return block  # blocks are never written in place, so readers may share them

    def put(self, key: bytes, block: torch.Tensor) -> None:
        if block.nbytes > self.capacity_bytes:
            return
        t0 = time.perf_counter()
        with self._lock:
            if key in self._blocks:
                self._blocks.move_to_end(key)
                return
            self._blocks[key] = block
            self._bytes += block.nbytes
            while self._bytes > self.capacity_bytes:  # a full tier drops its oldest blocks
                _, old = self._blocks.popitem(last=False)
                self._bytes -= old.nbytes
        self._count_store(block.nbytes, t0)

    def occupancy(self) -> tuple[int, int]:
        with self._lock:
            return len(self._blocks), self._bytes

    def check_invariants(self) -> None:
        with self._lock:
            assert self._bytes == sum(b.nbytes for b in self._blocks.values()), "host tier byte count drifted"
            assert self._bytes <= self.capacity_bytes, "host tier over its cap"
