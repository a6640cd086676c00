"""Small host <-> device copies that never wait for the stream (async scheduling overlaps the host with the
step in flight; a copy from or to pageable memory would wait for it). On a CPU they are no-ops."""
from __future__ import annotations

import torch


def to_device(t: torch.Tensor, device) -> torch.Tensor:
    """A host tensor on `device`. On a GPU through pinned memory, non-blocking: the caching host allocator
    keeps the pinned block until the copy has run, and the stream orders it before the kernels that read it."""
    if device == "cpu":  # the CPU path's common case, per step: no torch.device built
        return t
    device = torch.device(device)
    if device.type == "cpu":
        return t
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def to_pinned_host(t: torch.Tensor) -> torch.Tensor:
    """A device tensor's copy in pinned host memory, started without waiting: it is there once an event
    recorded on the stream after this call has passed."""
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


class PinnedRing:
    """Pinned host buffers taken in turn for per-step copies back from the device (a step's sampled tokens):
    a fresh pinned tensor per step costs the caching host allocator a lock, an event query and, once freed
    after its copy, an event record. `depth` must exceed the copies alive at once (async scheduling keeps
    two: the step in flight and the one being collected). A buffer grows to the largest copy it has taken."""

    def __init__(self, depth: int = 3, pin: bool = True):
        self.buffers: list[torch.Tensor | None] = [None] * depth
        self.next, self.pin = 0, pin

    def copy(self, t: torch.Tensor) -> torch.Tensor:
        """`t`'s copy into the next buffer, started without waiting (see to_pinned_host)."""
        i, n = self.next, t.numel()
        self.next = (i + 1) % len(self.buffers)
        buf = self.buffers[i]
        if buf is None or buf.numel() < n or buf.dtype != t.dtype:
            buf = self.buffers[i] = torch.empty(max(n, 64), dtype=t.dtype, pin_memory=self.pin)
        host = buf[:n].view(t.shape)
        host.copy_(t, non_blocking=True)
        return host


def device_tensor(values: list, dtype: torch.dtype, device) -> torch.Tensor:
    """A small host list on `device`, without waiting for the step in flight."""
    return to_device(torch.tensor(values, dtype=dtype), device)


def take_rows(t: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """t[rows] (rows strictly increasing) without waiting for the device: a slice when they are consecutive
    (decode-only steps; a fifth of a gather's cost on a CPU), else a gather whose index goes over like any
    small host tensor here. `t[list]` on a CUDA tensor copies the list over and synchronizes the stream
    first, which would stall the host behind the step in flight."""
    if rows and rows[-1] - rows[0] == len(rows) - 1:
        return t[rows[0]:rows[-1] + 1]
    return t.index_select(0, device_tensor(rows, torch.int64, t.device))
