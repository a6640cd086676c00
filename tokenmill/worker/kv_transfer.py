"""Moves KV blocks between the paged cache and the tiers, off the step's critical path.

    main thread, each step:   poll() ----------------------------> KVLoadResult (to the scheduler)
                              store(kv_stores)   copy evicted blocks out before the forward overwrites
                                                 them; host tier at once, lower tiers via the store thread
                              start_loads(kv_loads) -> load thread: tier reads -> copy into pool blocks
                              [forward]
                              store(kv_backups)  write-through copies of blocks this step filled

A load writes only blocks that its request holds, and the scheduler frees them only after the load's
result, so nothing else reads or writes them meanwhile. A load past its deadline, or cancelled, is
finished by the main thread under the load's lock; the load thread checks that flag under the same lock
before each block it writes, so a late read can never land in a block that has been given back. A read
that never returns (a hung network mount) holds its thread: once its load misses the deadline another
load thread starts (up to _MAX_LOAD_THREADS), so the loads behind it are not all late too.
On CPU, the copies are memcpys. On a GPU a step's stored blocks are gathered on the stream in chunks and
copied to pinned host memory without waiting; they land in the tiers at a later poll, once the copy is done
(async scheduling keeps its overlap). Loads copy host blocks into the cache through pinned memory on the
default stream, without waiting for the steps queued there; the step that reads them is queued after.
"""
from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

import torch

from tokenmill.device_copy import to_pinned_host
from tokenmill.kv.tiers.chain import TierChain
from tokenmill.sched.output import BlockStore, KVLoad, KVLoadResult

logger = logging.getLogger("tokenmill")
_GATHER_BLOCKS = 64  # evicted blocks gathered on a GPU per copy to the host (an 8B model's: 128 MiB)

_READ_BATCH = 32  # blocks per batched tier read (one Redis MGET)
_MAX_LOAD_THREADS = 4  # load threads, counting those stuck in a read that never returned


@dataclass(eq=False)
class _Load:
    spec: KVLoad
    deadline: float
    lock: threading.Lock = field(default_factory=threading.Lock)
    num_loaded: int = 0
    tiers: list[int] = field(default_factory=list)
    started: bool = False  # a load thread took it
    done: bool = False  # the load thread finished it
    cancelled: bool = False  # the main thread finished it first


class KVTransferWorker:
    def __init__(self, kv_cache: torch.Tensor, chain: TierChain, load_timeout_s: float = 10.0,
                 max_queued_stores: int = 4096):
        self.kv_cache = kv_cache  # [layers, 2, num_blocks, *block layout]
        self.chain = chain
        self.load_timeout_s = load_timeout_s
        self.lower = [t for t in chain.tiers if t is not chain.host]
        # the tiers hold host tensors: a GPU's blocks are gathered and copied to the host (_host_blocks)
        self.gather_to_host = kv_cache.device.type != "cpu"
        self._store_q: queue.Queue = queue.Queue(maxsize=max_queued_stores)
        self._load_q: queue.Queue = queue.Queue()
        self._loads: dict[str, _Load] = {}
        self._landed = threading.Event()
        self._landing: collections.deque = collections.deque()  # (stores, host blocks, copy event) on a GPU
        self._store_thread = threading.Thread(target=self._store_loop, name="kv-store", daemon=True)
        self._store_thread.start()
        self._load_threads: list[threading.Thread] = []
        self._add_load_thread()

    def _add_load_thread(self) -> None:
        t = threading.Thread(target=self._load_loop, name=f"kv-load-{len(self._load_threads)}", daemon=True)
        self._load_threads.append(t)
        t.start()

    def block(self, block_id: int) -> torch.Tensor:
        return self.kv_cache[:, :, block_id]

    # -- stores -----------------------------------------------------------------------------------------
    def _gathered(self, block_ids: list[int]):
        """(start, the blocks stacked) per _GATHER_BLOCKS of them: a GPU gathers on the stream, a chunk at a time
        to bound the gather's device memory."""
        for i in range(0, len(block_ids), _GATHER_BLOCKS):
            yield i, torch.stack([self.block(b) for b in block_ids[i:i + _GATHER_BLOCKS]])

    def _host_blocks(self, block_ids: list[int]) -> list[torch.Tensor]:
        """Each block as its own contiguous host tensor [layers, 2, block_size, heads, head_dim], now (a GPU's
        wait for the stream: shutdown only; steps store through `store`)."""
        if not self.gather_to_host:
            return [self.block(b).clone() for b in block_ids]
        return [b.clone() for _, together in self._gathered(block_ids) for b in together.cpu()]

    def store(self, stores: list[BlockStore]) -> None:
        """Copy blocks out to the tiers. On a GPU without waiting: the blocks are gathered on the stream (before
        any later kernel can overwrite them) and copied to pinned host memory; they land in the tiers once that
        copy is done, checked at the next `poll` (so async scheduling keeps its overlap)."""
        if not stores:
            return
        ids = [s.block_id for s in stores]
        if not self.gather_to_host:
            self._put_stored(stores, self._host_blocks(ids))
            return
        for i, together in self._gathered(ids):
            chunk = stores[i:i + _GATHER_BLOCKS]
            copied = None
            if together.is_cuda:  # (the tests take this path on a CPU, where the gather is the copy)
                together = to_pinned_host(together)
                copied = torch.cuda.Event()
                copied.record()
            self._landing.append((chunk, together, copied))

    @property
    def has_landing(self) -> bool:
        """Stores still on their way to the host (an idle engine steps once more to land them)."""
        return bool(self._landing)

    def land(self, wait: bool = False) -> None:
        """Stores whose copy to the host is done go into the tiers (oldest first; `wait`: all of them)."""
        while self._landing:
            chunk, together, copied = self._landing[0]
            if copied is not None and not wait and not copied.query():
                return
            if copied is not None:
                copied.synchronize()
            self._landing.popleft()
            # a host copy each, so that a tier that keeps one block keeps no other's memory alive
            self._put_stored(chunk, [b.clone() for b in together])

    def _put_stored(self, stores: list[BlockStore], blocks: list[torch.Tensor]) -> None:
        for s, data in zip(stores, blocks):
            if self.chain.host is not None:
                self.chain.host.put(s.block_hash, data)
            if self.lower:
                try:
                    self._store_q.put_nowait((s.block_hash, data))
                except queue.Full:  # the disk or the network is behind: drop rather than stall the step
                    for tier in self.lower:
                        tier.stats.stores_dropped += 1

    def store_lower(self, stores: list[BlockStore], timeout_s: float = 10.0) -> int:
        """Write blocks to the lower tiers now, on this thread (shutdown), after the queued stores; stops
        when `timeout_s` is spent. Returns how many it wrote."""
        end, n = time.monotonic() + timeout_s, 0
        self.land(wait=True)
        self.flush(timeout_s)
        for s in stores:
            if time.monotonic() >= end:
                break
            self._put_lower(s.block_hash, self._host_blocks([s.block_id])[0])
            n += 1
        return n

    def _put_lower(self, key: bytes, data: torch.Tensor) -> None:
        for tier in self.lower:
            try:
                if not tier.exists(key):
                    tier.put(key, data)
            except Exception:  # a tier bug must not kill the thread; tiers report I/O errors themselves
                logger.exception("KV %s tier: store failed", tier.name)

    def _store_loop(self) -> None:
        while True:
            item = self._store_q.get()
            try:
                if item is None:
                    return
                self._put_lower(*item)
            finally:
                self._store_q.task_done()

    def flush(self, timeout_s: float) -> bool:
        """Wait until stores have reached the tiers; False if `timeout_s` ran out first."""
        self.land(wait=True)
        end = time.monotonic() + timeout_s
        while self._store_q.unfinished_tasks:
            if time.monotonic() >= end:
                return False
            time.sleep(0.005)
        return True

    # -- loads ------------------------------------------------------------------------------------------
    def start_loads(self, loads: list[KVLoad]) -> None:
        now = time.monotonic()
        for spec in loads:
            job = _Load(spec, now + self.load_timeout_s)
            self._loads[spec.request_id] = job
            self._load_q.put(job)

    def cancel(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            job = self._loads.get(rid)
            if job is not None:
                with job.lock:
                    job.cancelled = True

    @property
    def num_in_flight(self) -> int:
        return len(self._loads)

    def poll(self) -> list[KVLoadResult]:
        """Loads that landed, were cancelled or ran past their deadline; each is reported once. Also puts
        stores whose copy to the host is done into the tiers."""
        self.land()
        now, out = time.monotonic(), []
        for rid, job in list(self._loads.items()):
            with job.lock:
                if not job.done and not job.cancelled and now < job.deadline:
                    continue
                if not job.done and not job.cancelled:
                    logger.warning("KV load for %s missed its %.1f s deadline after %d of %d blocks; recomputing "
                                   "the rest", rid, self.load_timeout_s, job.num_loaded, len(job.spec.block_ids))
                    if job.started and len(self._load_threads) < _MAX_LOAD_THREADS:
                        # its thread is still in a read: the loads queued behind it get a thread of their own
                        logger.warning("a KV tier read has taken %.1f s; starting another load thread",
                                       self.load_timeout_s)
                        self._add_load_thread()
                job.cancelled = True
                failed = job.num_loaded < len(job.spec.block_ids)
                out.append(KVLoadResult(rid, job.num_loaded, list(job.tiers), failed))
            del self._loads[rid]
        return out

    def wait(self, timeout: float) -> None:
        """Sleep until some load lands (or `timeout`): an idle engine waiting on loads must not spin."""
        self._landed.wait(timeout)
        self._landed.clear()

    def _load_loop(self) -> None:
        while True:
            job = self._load_q.get()
            if job is None:
                return
            with job.lock:
                job.started = True
            try:
                self._run_load(job)
            except Exception:
                logger.exception("KV load for %s failed; recomputing", job.spec.request_id)
            with job.lock:
                job.done = True
            self._landed.set()

    def _run_load(self, job: _Load) -> None:
        spec = job.spec
        i = 0
        while i < len(spec.block_ids):
            if job.cancelled:
                return
            tier = spec.tiers[i]
            j = i + 1  # a run of blocks listed in the same tier, read in one call
            while j < len(spec.tiers) and j - i < _READ_BATCH and spec.tiers[j] == tier:
                j += 1
            wanted = j - i
            got = self._read(spec.block_hashes[i:j], tier)
            for block, where in got:
                with job.lock:
                    if job.cancelled:
                        return
                    dst = self.block(spec.block_ids[i])
                    if dst.is_cuda:  # from pinned memory, not waiting for the steps queued on the stream (the
                        # step that reads the block is queued after this copy)
                        dst.copy_(block.pin_memory(), non_blocking=True)
                    else:
                        dst.copy_(block)
                    job.num_loaded += 1
                    job.tiers.append(where)
                if self.chain.host is not None and self.chain.tiers[where] is not self.chain.host:
                    self.chain.host.put(spec.block_hashes[i], block)  # promote: the next hit is a RAM hit
                i += 1
            if len(got) < wanted:
                return  # a block could not be read from any tier: the rest is recomputed

    def _read(self, keys: list[bytes], tier: int) -> list[tuple[torch.Tensor, int]]:
        """The leading run of `keys` readable from `tier`, then from the other tiers block by block."""
        got = [(b, tier) for b in self.chain.tiers[tier].batched_get(keys)]
        for key in keys[len(got):]:
            for i, t in enumerate(self.chain.tiers):
                if i == tier:
                    continue
                block = t.get(key)
                if block is not None:
                    got.append((block, i))
                    break
            else:
                break
        return got

    def close(self, flush_timeout_s: float = 10.0) -> None:
        """Finish queued stores (up to `flush_timeout_s`), stop the threads, close the tiers."""
        try:
            self.flush(flush_timeout_s)
        except Exception:  # e.g. a CUDA error that ended the context: still stop the threads and close
            logger.exception("KV stores could not be finished at shutdown")
        try:
            self._store_q.put(None, timeout=1.0)
        except queue.Full:
            pass
        for _ in self._load_threads:
            self._load_q.put(None)
        for t in [self._store_thread, *self._load_threads]:
            t.join(timeout=2.0 if t.is_alive() else 0)
        self.chain.close()
