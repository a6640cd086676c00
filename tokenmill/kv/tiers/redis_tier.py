"""Remote tier on Redis: the store several engine replicas share. Values use the disk tier's byte format
(blockfile.py), under `tokenmill:kv:<fingerprint hex>:<key hex>`.

Redis bounds itself: run it with `maxmemory` and `maxmemory-policy allkeys-lru` and it evicts the least
recently used blocks. A dead or slow server must not stall the step: every call has a short socket
timeout, and after a failure the tier reports misses and drops stores for `retry_after_s` before it
tries the server again (redis-py reconnects by itself). A timeout stops only its own side for that long:
a store too large to land in time drops stores, not the lookups and loads of blocks already there (and a
slow read does not stop stores); a connection error stops both. Lookups run on the scheduler's thread, once per
waiting request and step, so a server that answers but slowly (over `slow_lookup_s` a lookup) has its
lookups skipped, as misses, for `retry_after_s` too; reads and writes run on the transfer threads. A
write the server refuses (out of memory under `noeviction`) drops that block only.
"""
from __future__ import annotations

import time

import torch

from tokenmill.kv.tiers.blockfile import CorruptBlock, decode_block, encode_block
from tokenmill.kv.tiers.connector import KVConnector


class RedisTier(KVConnector):
    name = "remote"

    def __init__(self, url: str, fingerprint: bytes, block_shape: tuple[int, ...], dtype: torch.dtype,
                 timeout_s: float = 0.5, retry_after_s: float = 2.0, slow_lookup_s: float = 0.05):
        super().__init__()
        try:
            import redis
        except ImportError as e:
            raise ValueError("kv_remote_cache_url needs the redis package: pip install redis") from e
        self._errors = (redis.RedisError, OSError)
        self._timeouts = (redis.TimeoutError, TimeoutError)  # (socket.timeout is TimeoutError)
        self.client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self.url = url
        self.fingerprint, self.block_shape, self.dtype = fingerprint, tuple(block_shape), dtype
        self._prefix = f"tokenmill:kv:{fingerprint.hex()}:".encode()
        self.retry_after_s = retry_after_s
        self._down_until = {"read": 0.0, "write": 0.0}  # each side's breaker (monotonic time)
        self.slow_lookup_s = slow_lookup_s
        self._keys_written = 0
        self._bytes_written = 0

    def _key(self, key: bytes) -> bytes:
        return self._prefix + key.hex().encode()

    def _call(self, fn, default, side: str):
        """Run one Redis call on `side` ("read": lookups and loads, "write": stores); on failure return `default`
        and stop that side for retry_after_s (both sides unless the call timed out: the server is down)."""
        if time.monotonic() < self._down_until[side]:
            return default
        try:
            return fn()
        except Exception as e:  # (redis-py raises TypeError, AttributeError .. on a reply it cannot parse)
            until = time.monotonic() + self.retry_after_s
            # (a timeout connecting is a server out of reach, not a slow call: both sides)
            slow = isinstance(e, self._timeouts) and "connect" not in str(e).lower()
            sides = (side,) if slow else tuple(self._down_until)
            for s in sides:
                self._down_until[s] = until
            what = "reads" if sides == ("read",) else "writes" if sides == ("write",) else "reads and writes"
            self._warn("%s failed (%s); %s off for %.0f s", self.url, e, what, self.retry_after_s)
            return default

    def exists(self, key: bytes) -> bool:
        return self.batched_exists([key]) == 1

    def batched_exists(self, keys: list[bytes]) -> int:
        if not keys or self._lookups_paused():
            return 0

        def run():
            pipe = self.client.pipeline(transaction=False)
            for k in keys:
                pipe.exists(self._key(k))
            return _replies(pipe.execute(), len(keys), (int,))

        t0 = time.monotonic()
        answers = self._call(run, [], "read")
        self._pause_if_slow(t0, self.slow_lookup_s, self.retry_after_s, self.url)
        n = 0
        for present in answers:
            if not present:
                break
            n += 1
        return n

    def get(self, key: bytes) -> torch.Tensor | None:
        got = self.batched_get([key])
        return got[0] if got else None

    def batched_get(self, keys: list[bytes]) -> list[torch.Tensor]:
        t0 = time.perf_counter()
        values = self._call(lambda: _replies(self.client.mget([self._key(k) for k in keys]), len(keys),
                                             (bytes, type(None))), [], "read")
        out = []
        for k, data in zip(keys, values):
            if data is None:
                break
            try:
                out.append(decode_block(data, self.fingerprint, k, self.block_shape, self.dtype))
            except CorruptBlock as e:
                self._warn("block %s: %s; treating it as a miss", k.hex(), e)
                self._call(lambda: self.client.delete(self._key(k)), None, "write")
                break
        for b in out:
            self._count_load(b.nbytes, t0)
            t0 = time.perf_counter()
        return out

    def put(self, key: bytes, block: torch.Tensor) -> None:
        self.batched_put([key], [block])

    def batched_put(self, keys: list[bytes], blocks: list[torch.Tensor]) -> None:
        t0 = time.perf_counter()
        values = [encode_block(self.fingerprint, k, b) for k, b in zip(keys, blocks)]

        def run():
            pipe = self.client.pipeline(transaction=False)
            for k, v in zip(keys, values):
                pipe.set(self._key(k), v)
            # a refused SET is that block's, not the server's fault
            return _replies(pipe.execute(raise_on_error=False), len(keys), (bool, bytes, Exception))

        results = self._call(run, None, "write")
        if results is None:
            return
        for b, v, res in zip(blocks, values, results):
            if isinstance(res, Exception):
                self._warn("%s refused a block (%s); dropped", self.url, res)
                continue
            self._count_store(b.nbytes, t0)
            self._keys_written += 1
            self._bytes_written += len(v)
            t0 = time.perf_counter()

    def occupancy(self) -> tuple[int, int]:
        """What this engine wrote (the server's own eviction is invisible to us without a scan)."""
        return self._keys_written, self._bytes_written

    def close(self) -> None:
        try:
            self.client.close()
        except self._errors:
            pass


def _replies(values, n: int, types: tuple) -> list:
    """`values` if it is n replies of `types`; else a TypeError, which `_call` takes as a server gone wrong (a
    proxy or another protocol on the port): garbage is never read as hits."""
    if not isinstance(values, list) or len(values) != n or not all(isinstance(v, types) for v in values):
        raise TypeError(f"unexpected reply {str(values)[:80]}")
    return values
