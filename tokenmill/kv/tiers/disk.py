"""Local-disk tier: one file per block, named by its hash, under a directory per model fingerprint.

    <kv_disk_cache_dir>/<fingerprint hex>/<first 2 hex of key>/<key hex>.kvb      (format: blockfile.py)

Writes go to a temporary file in the same directory, then `os.replace`, so a reader sees a whole file
or none; two engines on one model can share the directory (each keeps its own LRU index and size cap,
so together they may hold up to the sum of their caps). Every failure is a miss or a dropped block:
  - a corrupt or foreign file, or anything but a regular file of a block's size, is deleted and reported;
  - a file gone missing makes the tier check its whole index (at most every few seconds), so that the blocks
    of a deleted directory are stored again rather than found missing one request at a time;
  - a missing directory is recreated, at startup too (one that cannot be made leaves the tier empty);
  - a full disk lowers the cap to what the disk holds, and the configured cap is tried again later;
  - a lookup's stat runs on a thread of its own and is waited for briefly: a mount that hangs turns lookups of
    blocks this engine did not index into misses, instead of stopping the scheduler (a slow hand-off to the
    thread costs that one lookup; a slow stat pauses such lookups for a while).
"""
from __future__ import annotations

import errno
import os
import queue
import shutil
import stat
import threading
import time
import uuid
import weakref
from collections import OrderedDict
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

import torch

from tokenmill.kv.tiers.blockfile import HEADER_SIZE, CorruptBlock, decode_block, encode_block, payload_bytes
from tokenmill.kv.tiers.connector import KVConnector

_SUFFIX = ".kvb"
_STALE_TMP_S = 3600.0  # temporary files older than this were left by a crashed writer
_REVALIDATE_S = 5.0  # a missing file checks the whole index at most this often
_CAP_RETRY_S = 30.0  # a cap lowered by a full disk goes back to the configured one after this long
_SLOW_STAT_S, _STAT_OFF_S = 0.05, 10.0  # a lookup's stat slower than this turns stats off for that long


class DiskTier(KVConnector):
    name = "disk"

    def __init__(self, root: str, capacity_bytes: int, fingerprint: bytes, block_shape: tuple[int, ...],
                 dtype: torch.dtype):
        super().__init__()
        self.dir = os.path.join(root, fingerprint.hex())
        self.capacity_bytes = self.configured_bytes = capacity_bytes
        self.fingerprint, self.block_shape, self.dtype = fingerprint, tuple(block_shape), dtype
        self.file_bytes = HEADER_SIZE + payload_bytes(block_shape, dtype)
        self._index: OrderedDict[bytes, int] = OrderedDict()  # key -> file size, least recently used first
        self._bytes = 0
        self._cap_lowered_at = 0.0  # when a full disk last lowered the cap
        self._stats = None  # lookups' stats run there (_stat_size)
        self._stat_running = None  # a stat that outlived its wait: no other is started until it returns
        self._revalidated_at = 0.0
        self._added_while_revalidating: set[bytes] | None = None  # None: no revalidation running
        try:
            os.makedirs(self.dir, exist_ok=True)
            self._scan()
        except OSError as e:  # a read-only or missing mount degrades the tier (writes retry), never the engine
            self._warn("cannot use %s: %s; the disk tier starts empty", self.dir, e)

    def _path(self, key: bytes) -> str:
        h = key.hex()
        return os.path.join(self.dir, h[:2], h + _SUFFIX)

    def _scan(self) -> None:
        """Index what earlier runs left, oldest first, and trim it to the cap."""
        found = []
        for sub in os.scandir(self.dir):
            if not sub.is_dir():
                continue
            for f in os.scandir(sub.path):
                try:
                    st = f.stat()
                except OSError:  # removed by another engine while we scan
                    continue
                if f.name.endswith(_SUFFIX):
                    try:
                        found.append((st.st_mtime, bytes.fromhex(f.name[:-len(_SUFFIX)]), st.st_size))
                    except ValueError:
                        pass
                elif f.name.endswith(".tmp") and time.time() - st.st_mtime > _STALE_TMP_S:
                    _unlink(f.path)
        for _, key, size in sorted(found):
            self._index[key] = size
            self._bytes += size
        self._trim()

    # -- lookups ----------------------------------------------------------------------------------------
    def exists(self, key: bytes) -> bool:
        with self._lock:
            if key in self._index:
                return True
        if self._lookups_paused():  # a slow disk: only indexed blocks are looked up for a while
            return False
        size = self._stat_size(self._path(key))  # another engine on the same directory may have written it
        if size is None:
            return False
        self._add(key, size)
        return True

    def _stat_size(self, path: str) -> int | None:
        """The file's size (None: no file), from a stat on this tier's own thread: lookups run on the scheduler's
        thread, and a stat on a mount that hangs would stop the engine. The scheduler waits _SLOW_STAT_S at most
        (a miss then), and starts no other stat until that one returns; if the stat itself took longer (not the
        hand-off to the thread, which an overloaded host can delay), lookups of unindexed blocks stay off for
        _STAT_OFF_S more."""
        late = self._stat_running
        if late is not None:
            if not late.done():
                return None  # it still hangs
            self._stat_running = None
            if late.took > _SLOW_STAT_S:  # a slow mount, not a slow hand-off
                self._pause_if_slow(time.monotonic() - late.took, _SLOW_STAT_S, _STAT_OFF_S, f"a stat in {self.dir}")
                return None
        if self._stats is None:
            self._stats = _StatThread()
            weakref.finalize(self, self._stats.stop)  # (the thread holds its queue, not the tier)
        future = self._stats.submit(path)
        try:  # (exception(), not result(): a re-raised error's traceback would hold this frame, and the tier)
            error = future.exception(timeout=_SLOW_STAT_S)
            return None if error is not None else future.result().st_size
        except FutureTimeout:
            self._stat_running = future
            return None

    def get(self, key: bytes) -> torch.Tensor | None:
        t0 = time.perf_counter()
        path = self._path(key)
        try:
            st = os.stat(path)
            # a FIFO or device would block the load thread in read(); a file of another size is not a block
            if not stat.S_ISREG(st.st_mode):
                raise CorruptBlock("not a regular file")
            if st.st_size != self.file_bytes:
                raise CorruptBlock(f"{st.st_size} bytes, a block file has {self.file_bytes}")
            with open(path, "rb") as f:
                data = f.read(self.file_bytes + 1)
            block = decode_block(data, self.fingerprint, key, self.block_shape, self.dtype)
        except FileNotFoundError:  # evicted by us or by another engine, or the directory is gone
            if self._forget(key):  # it was indexed: others may be gone too (a plain miss is not a sign)
                self._revalidate()
            return None
        except CorruptBlock as e:
            self._warn("%s: %s; treating it as a miss and deleting it", path, e)
            self._forget(key)
            _remove(path)
            return None
        except OSError as e:
            self._warn("cannot read %s: %s", path, e)
            return None
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
        self._count_load(block.nbytes, t0)
        return block

    # -- stores -----------------------------------------------------------------------------------------
    def put(self, key: bytes, block: torch.Tensor) -> None:
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
                return
            if self._cap_lowered_at and time.monotonic() - self._cap_lowered_at > _CAP_RETRY_S:
                self.capacity_bytes, self._cap_lowered_at = self.configured_bytes, 0.0  # space may be back
        t0 = time.perf_counter()
        data = encode_block(self.fingerprint, key, block)
        path = self._path(key)
        try:
            self._write_atomic(path, data)
        except OSError as e:
            if e.errno == errno.ENOSPC:
                with self._lock:  # hold no more than the disk could take, for a while
                    self.capacity_bytes = max(0, min(self.capacity_bytes, self._bytes))
                    self._cap_lowered_at = time.monotonic()
                self._trim()
            self._warn("cannot write %s: %s; block dropped", path, e)
            return
        self._add(key, len(data))
        self._count_store(block.nbytes, t0)

    def _write_atomic(self, path: str, data: bytes) -> None:
        d = os.path.dirname(path)
        tmp = os.path.join(d, f".{uuid.uuid4().hex}.tmp")
        for attempt in range(2):
            try:
                with open(tmp, "wb") as f:
                    f.write(data)
                os.replace(tmp, path)
                return
            except FileNotFoundError:  # the directory was deleted under us: make it again, once
                if attempt:
                    raise
                os.makedirs(d, exist_ok=True)
            except OSError:
                _unlink(tmp)
                raise

    # -- the index --------------------------------------------------------------------------------------
    def _add(self, key: bytes, size: int) -> None:
        with self._lock:
            if key in self._index:
                return
            self._index[key] = size
            self._bytes += size
            if self._added_while_revalidating is not None:
                self._added_while_revalidating.add(key)
        self._trim()

    def _forget(self, key: bytes) -> bool:
        """Drop `key` from the index; whether it was there."""
        with self._lock:
            size = self._index.pop(key, None)
            if size is not None:
                self._bytes -= size
        return size is not None

    def _revalidate(self) -> None:
        """Drop the index's entries whose files are gone (a deleted directory, another engine's eviction), at
        most every _REVALIDATE_S: they would otherwise be found missing one load at a time, and stores of
        those blocks skipped as already there."""
        now = time.monotonic()
        with self._lock:
            if now - self._revalidated_at < _REVALIDATE_S or self._added_while_revalidating is not None:
                return
            self._revalidated_at = now
            self._added_while_revalidating = set()
            keys = list(self._index)
        gone = [k for k in keys if not os.path.exists(self._path(k))]  # (off the lock: stats can be slow)
        with self._lock:
            # a key evicted and stored again while we looked has a new file that our stat may have missed
            fresh, self._added_while_revalidating = self._added_while_revalidating, None
            for k in gone:
                if k not in fresh:
                    self._bytes -= self._index.pop(k, 0)

    def _trim(self) -> None:
        victims = []
        with self._lock:
            while self._bytes > self.capacity_bytes and self._index:
                key, size = self._index.popitem(last=False)
                self._bytes -= size
                victims.append(key)
        for key in victims:
            _unlink(self._path(key))

    def check_invariants(self) -> None:
        """The index's byte count is exact and within the cap. (Files themselves may change under us:
        another engine, a deleted directory, damage; reads catch that.)"""
        with self._lock:
            assert self._bytes == sum(self._index.values()), "disk tier byte count drifted"
            assert self._bytes <= self.capacity_bytes, "disk tier over its cap"

    def occupancy(self) -> tuple[int, int]:
        with self._lock:
            return len(self._index), self._bytes


class _StatThread:
    """A daemon thread that runs stats in turn (daemon: one hung on a dead mount must not hold up the exit)."""

    def __init__(self):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, daemon=True, name="tokenmill-disk-stat")
        self.thread.start()

    def submit(self, path: str) -> Future:
        future: Future = Future()
        self._queue.put((path, future))
        return future

    def stop(self) -> None:
        """The thread ends once the stats queued before have run (one that hangs keeps it, as a daemon)."""
        self._queue.put(None)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            path, future = item
            t0 = time.monotonic()
            try:
                st = os.stat(path)
            except OSError as e:
                future.took = time.monotonic() - t0  # (set before the result: a waiter may read it at once)
                future.set_exception(e)
            else:
                future.took = time.monotonic() - t0
                future.set_result(st)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _remove(path: str) -> None:
    """A corrupt entry, whether a file or something else (a directory) where a block file should be."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        _unlink(path)
