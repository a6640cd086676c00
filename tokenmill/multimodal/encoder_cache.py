"""The scheduler's ledger of the worker's encoder cache (vLLM v1's EncoderCacheManager, shared across
requests): which images have encoder outputs on the worker, keyed by their pixel hash, within a capacity
counted in encoder output rows (tokens).

    entries   hash -> rows, least recently used first; an entry no request refers to stays cached (the
              next request with the same image skips its encoder) until room is needed
    refs      hash -> requests that still need its rows (their prefill has not passed its placeholders)
    pending   hashes being encoded in the background (worker thread), not usable yet
    freed     hashes evicted since the last step: the worker drops their tensors

Only unreferenced, finished entries are evicted, so rows a scheduled step needs are always there.
"""
from __future__ import annotations

from collections import OrderedDict


class EncoderCacheManager:
    def __init__(self, capacity_tokens: int):
        self.capacity = capacity_tokens
        self.used = 0
        self.entries: OrderedDict[str, int] = OrderedDict()
        self.refs: dict[str, set[str]] = {}
        self.pending: set[str] = set()
        self._freed: list[str] = []
        self.hits = self.misses = 0  # lookups of images a step needed: found cached / had to be encoded

    def cached(self, h: str) -> bool:
        return h in self.entries and h not in self.pending

    def _evictable(self, h: str) -> bool:
        return not self.refs.get(h) and h not in self.pending

    def room_for(self, tokens: int) -> bool:
        free = self.capacity - self.used
        return free >= tokens or free + sum(n for h, n in self.entries.items() if self._evictable(h)) >= tokens

    def add(self, h: str, tokens: int, request_id: str, pending: bool = False) -> None:
        """Reserve rows for an image about to be encoded (call room_for first)."""
        for old in [o for o in self.entries if self._evictable(o)]:
            if self.capacity - self.used >= tokens:
                break
            self._evict(old)
        if self.capacity - self.used < tokens:
            raise RuntimeError("encoder cache has no room: room_for() was not checked")
        self.entries[h] = tokens
        self.used += tokens
        if pending:
            self.pending.add(h)
        self.ref(h, request_id)

    def drop(self, h: str) -> None:
        """Forget an image whatever refers to it (its encode may never have run): whoever needs its rows
        encodes it again, and the worker frees what it holds of it."""
        if h in self.entries:
            self.pending.discard(h)
            self._evict(h)

    def free_again(self, hashes) -> None:
        """Evictions whose order never reached the worker; an image added back since keeps its new rows."""
        self._freed.extend(h for h in hashes if h not in self.entries)

    def _evict(self, h: str) -> None:
        self.used -= self.entries.pop(h)
        self.refs.pop(h, None)
        self._freed.append(h)

    def ref(self, h: str, request_id: str) -> None:
        self.refs.setdefault(h, set()).add(request_id)
        self.entries.move_to_end(h)

    def release(self, request_id: str, hashes) -> None:
        for h in hashes:
            users = self.refs.get(h)
            if users is not None:
                users.discard(request_id)

    def finish_pending(self, hashes) -> None:
        self.pending.difference_update(hashes)

    def take_freed(self) -> list[str]:
        freed, self._freed = self._freed, []
        return freed

    def check_invariants(self) -> None:
        assert self.pending <= set(self.entries), "a pending encode has no entry"
        assert self.used == sum(self.entries.values()) <= self.capacity, "encoder cache rows miscounted"


class NoReuseEncoderCache(EncoderCacheManager):
    """The ladder's baseline (mm_encoder_cache=False): rows live only while a request needs them, so every
    request encodes its images again, as engines without a shared encoder cache do."""

    def release(self, request_id: str, hashes) -> None:
        super().release(request_id, hashes)
        for h in hashes:
            if h in self.entries and self._evictable(h):
                self._evict(h)

