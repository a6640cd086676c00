"""All-reduce and all-gather through shared memory, for the TP ranks of one CPU node.

gloo's all-reduce of a few KiB takes ~0.5 ms median (and ~4 ms at P90) between two processes on one
machine (benchmarks/bench_parallel.py comm), and a TP step runs two per layer: on a 24-layer model that
is more than a decode step's compute. The ranks of a node share memory, so they can meet there instead
(vLLM's and SGLang's CPU backends do the same):

    segment (one file in /dev/shm, mapped by every rank of the group):
      flags   [n] int64, one per 64-byte line: the last op number rank r has written its input for
      slots   [2][n][slot_bytes]: op k uses half k % 2; rank r's input goes to slots[k % 2][r]

    op k on rank r:  wait until every flag >= k - 1   (all finished reading op k - 2 from this half)
                     copy the input into slots[k % 2][r]; flags[r] = k
                     wait until every flag >= k
                     out = slot 0 + slot 1 + ... (all-reduce) or [slot 0 | slot 1 | ...] (all-gather)

Every rank sums the slots in the same order, so all ranks get bitwise the same result (the last stage's
TP ranks sample identically from it). x86's store order makes "data, then flag" visible in that order to
the other ranks, so this path is taken on x86-64 only. Messages larger than a slot go through gloo.
"""
from __future__ import annotations

import mmap
import os
import platform
import time

import numpy as np
import torch

LINE = 64


def shm_supported() -> bool:
    return platform.machine() in ("x86_64", "AMD64") and os.path.isdir("/dev/shm")


class ShmGroup:
    def __init__(self, path: str, rank: int, size: int, slot_bytes: int, timeout_s: float, create: bool):
        self.rank, self.size, self.slot_bytes, self.timeout_s = rank, size, slot_bytes, timeout_s
        total = size * LINE + 2 * size * slot_bytes
        fd = os.open(path, os.O_RDWR | (os.O_CREAT if create else 0), 0o600)
        try:
            if create:
                os.ftruncate(fd, total)  # zero-filled: every flag starts at op 0
                # every page reserved now: a sparse file's pages come on first write, and a write past a full
                # /dev/shm is a SIGBUS that kills the rank mid-step (OSError ENOSPC here instead)
                os.posix_fallocate(fd, 0, total)
            self._mm = mmap.mmap(fd, total)
        finally:
            os.close(fd)
        self.flags = np.frombuffer(self._mm, dtype=np.int64, count=size * LINE // 8)[::LINE // 8]
        self.slots = torch.frombuffer(self._mm, dtype=torch.uint8, offset=size * LINE,
                                      count=2 * size * slot_bytes).view(2, size, slot_bytes)
        self.op = 0
        self.cancelled = False  # set when the engine fails: a peer that died never raises its flag

    def fits(self, x: torch.Tensor) -> bool:
        return x.numel() * x.element_size() <= self.slot_bytes and x.device.type == "cpu"

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        parts = self._exchange(x)
        out = x.view(-1)
        out.copy_(parts[0])
        for p in parts[1:]:
            out.add_(p)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's `x` concatenated along the last dim, in rank order."""
        parts = self._exchange(x)
        return torch.cat([p.view(x.shape) for p in parts], dim=-1)

    def _exchange(self, x: torch.Tensor) -> list[torch.Tensor]:
        self.op += 1
        k, half = self.op, self.op % 2
        nbytes = x.numel() * x.element_size()
        self._wait(k - 1)
        self.slots[half, self.rank, :nbytes].view(x.dtype).copy_(x.reshape(-1))
        self.flags[self.rank] = k
        self._wait(k)
        return [self.slots[half, r, :nbytes].view(x.dtype) for r in range(self.size)]

    def _wait(self, k: int) -> None:
        flags, deadline, spins = self.flags, None, 0
        while flags.min() < k:
            spins += 1
            if spins < 64:
                continue
            os.sched_yield()  # ranks may outnumber cores: let the one we wait for run
            if spins % 4096 == 0:
                if self.cancelled:
                    raise RuntimeError("shared-memory collective cancelled: the engine is shutting down")
                deadline = deadline or time.monotonic() + self.timeout_s
                if time.monotonic() > deadline:
                    raise TimeoutError(f"a TP peer did not reach shared-memory collective {k} within "
                                       f"{self.timeout_s:.0f} s")
