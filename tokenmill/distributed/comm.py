"""Process groups and the collectives the model calls, each timed into CommStats.

The model layers see one `TensorParallel` (their TP rank, size and the group's all-reduce / all-gather);
the runner sees one `PipelineLink` (send to the next stage, receive from the previous). Both count the
seconds and bytes they spend, which the engine reports per step (engine/core.py EngineStats.comm_*).
On CPU (gloo) a collective returns when it is done, so the time is the transfer's. On CUDA (NCCL) it
returns once queued, so the figure is the host's share only.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class CommStats:
    seconds: float = 0.0
    ops: int = 0
    bytes: int = 0

    def add(self, t0: float, tensor: torch.Tensor) -> None:
        self.seconds += time.perf_counter() - t0
        self.ops += 1
        self.bytes += tensor.numel() * tensor.element_size()

    def as_dict(self) -> dict:
        return {"seconds": self.seconds, "ops": self.ops, "bytes": self.bytes}


class TensorParallel:
    """This rank's tensor-parallel group. With size 1 every call is the identity, and nothing imports a
    process group. `shm` (shm_comm.py), when the group's ranks share a CPU node, carries the messages that
    fit its slots; the rest go through torch.distributed."""

    def __init__(self, rank: int = 0, size: int = 1, group=None, stats: CommStats | None = None, shm=None):
        self.rank, self.size, self.group, self.shm = rank, size, group, shm
        self.stats = stats or CommStats()

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        t0 = time.perf_counter()
        if self.shm is not None and self.shm.fits(x):
            self.shm.all_reduce(x)
        else:
            dist.all_reduce(x, group=self.group)
        self.stats.add(t0, x)
        return x

    def all_max(self, x: torch.Tensor) -> torch.Tensor:
        """Element-wise max over the ranks, in place (at load: a row-parallel shard's scales are its whole
        rows')."""
        if self.size > 1:
            dist.all_reduce(x, op=dist.ReduceOp.MAX, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's `x` along the last dim, in rank order (vocab-parallel logits)."""
        if self.size == 1:
            return x
        t0 = time.perf_counter()
        x = x.contiguous()
        if self.shm is not None and self.shm.fits(x):
            out = self.shm.all_gather(x)
        else:
            parts = [torch.empty_like(x) for _ in range(self.size)]
            dist.all_gather(parts, x, group=self.group)
            out = torch.cat(parts, dim=-1)
        self.stats.add(t0, x)
        return out


SINGLE = TensorParallel()


class PipelineLink:
    """Hidden states and residual between neighbouring stages. Sends are asynchronous, so a stage goes on
    to its next micro-batch while the previous one is on the wire; a send's buffers are kept until it is
    done (waited before the next send)."""

    def __init__(self, prev_rank: int | None, next_rank: int | None, stats: CommStats | None = None):
        self.prev_rank, self.next_rank = prev_rank, next_rank
        self.stats = stats or CommStats()
        self._pending: list = []

    def send(self, hidden: torch.Tensor, residual: torch.Tensor) -> None:
        self.wait_sends()
        t0 = time.perf_counter()
        payload = torch.stack([hidden, residual]).contiguous()
        self._pending = [dist.isend(payload, self.next_rank), payload]
        self.stats.add(t0, payload)

    def recv(self, num_tokens: int, hidden_size: int, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
        t0 = time.perf_counter()
        payload = torch.empty(2, num_tokens, hidden_size, dtype=dtype, device=device)
        dist.recv(payload, self.prev_rank)
        self.stats.add(t0, payload)
        return payload[0], payload[1]

    def wait_sends(self) -> None:
        if self._pending:
            self._pending[0].wait()
            self._pending = []


@dataclass(frozen=True)
class ModelShard:
    """What one rank builds of a model: its TP group, and its pipeline stage's layers [start, end)."""

    tp: TensorParallel = SINGLE
    layer_start: int = 0
    layer_end: int | None = None  # None: every layer
    is_first_stage: bool = True
    is_last_stage: bool = True

    def layers(self, num_layers: int) -> range:
        return range(self.layer_start, num_layers if self.layer_end is None else self.layer_end)


WHOLE_MODEL = ModelShard()
