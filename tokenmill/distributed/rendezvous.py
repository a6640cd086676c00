"""torch.distributed's init for one rank, from the engine's options or a torchrun environment.

    backend   gloo on CPU, NCCL on CUDA (tensors); the control channel is separate (control.py)
    address   tcp://master_addr:master_port (torch's TCPStore rendezvous); master_port 0 picks a free one;
              under torchrun (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set) env://, its own store
    timeout   distributed_timeout_s: a rendezvous or a collective waiting longer raises, never hangs
    groups    one TP group per pipeline stage (layout.py); pipeline sends use global ranks

Settings tokenmill makes before init (each only when the user has not set it):
    GLOO_SOCKET_IFNAME=lo on a single node: gloo otherwise binds the address the hostname resolves to,
        which in containers and namespaces is often not reachable by the other ranks
    TORCH_NCCL_ASYNC_ERROR_HANDLING=1: a failed NCCL collective aborts the rank instead of hanging it
"""
from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from tokenmill.distributed.comm import CommStats, ModelShard, PipelineLink, TensorParallel
from tokenmill.distributed.layout import ParallelLayout

logger = logging.getLogger("tokenmill")

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class Rendezvous:
    master_addr: str
    master_port: int
    nnodes: int
    node_rank: int
    timeout_s: float
    device: str
    launched: bool = False  # every rank was started by torchrun (or a like launcher): nobody spawns workers

    @classmethod
    def from_config(cls, config) -> "Rendezvous":
        env = os.environ
        if torchrun_rank() is not None:
            world, local = int(env["WORLD_SIZE"]), int(env.get("LOCAL_WORLD_SIZE", env["WORLD_SIZE"]))
            if world != config.world_size:
                raise ValueError(f"the launcher started {world} ranks but tensor_parallel_size x "
                                 f"pipeline_parallel_size is {config.world_size}")
            return cls(env["MASTER_ADDR"], int(env["MASTER_PORT"]), world // local, int(env.get("GROUP_RANK", 0)),
                       config.distributed_timeout_s, config.device, launched=True)
        port = config.master_port or free_port(config.master_addr)
        return cls(config.master_addr, port, config.nnodes, config.node_rank, config.distributed_timeout_s,
                   config.device)

    @property
    def control_address(self) -> tuple[str, int]:
        return self.master_addr, self.master_port + 1

    def node_ranks(self, world_size: int) -> range:
        per_node = world_size // self.nnodes
        return range(self.node_rank * per_node, (self.node_rank + 1) * per_node)


def torchrun_rank() -> int | None:
    """This process's rank when torchrun (or another launcher) set the usual variables, else None."""
    if all(v in os.environ for v in TORCHRUN_VARS):
        return int(os.environ["RANK"])
    return None


def free_port(addr: str) -> int:
    """A port free now on `addr`, with the next one free too (the control channel's)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind((addr, 0))
            port = s.getsockname()[1]
        try:
            with socket.socket() as s:
                s.bind((addr, port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError(f"no two free neighbouring ports on {addr}")


def init_rank(layout: ParallelLayout, rdzv: Rendezvous, num_layers: int,
              shm_slot_bytes: int = 0) -> tuple[ModelShard, PipelineLink, CommStats]:
    """Join the process group as `layout.rank`; returns its model shard, pipeline link and comm counters.
    `shm_slot_bytes` > 0: TP collectives up to that size go through shared memory (shm_comm.py) when the
    group's ranks share this node."""
    if rdzv.nnodes == 1 and rdzv.master_addr.startswith("127."):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    check_group_free()
    if dist.is_initialized():
        destroy_group()
    backend = "nccl" if rdzv.device == "cuda" else "gloo"
    if rdzv.device == "cuda":  # one GPU per rank of a node (NCCL refuses two ranks on one device)
        local = int(os.environ.get("LOCAL_RANK", layout.rank))  # torchrun's, else the engine's own numbering
        torch.cuda.set_device(local % max(torch.cuda.device_count(), 1))
    init = "env://" if rdzv.launched else f"tcp://{rdzv.master_addr}:{rdzv.master_port}"
    dist.init_process_group(backend, init_method=init,
                            rank=layout.rank, world_size=layout.world_size, timeout=timedelta(seconds=rdzv.timeout_s))
    stats = CommStats()
    group = None
    for stage in range(layout.pp_size):  # every rank creates every group, in the same order
        g = dist.new_group(layout.stage_ranks(stage))
        if stage == layout.pp_rank:
            group = g
    shm = None
    if shm_slot_bytes and layout.tp_size > 1 and tp_group_on_one_node(layout, rdzv):
        shm = _shm_group(layout, group, shm_slot_bytes, rdzv.timeout_s)
    tp = TensorParallel(layout.tp_rank, layout.tp_size, group, stats, shm)
    link = PipelineLink(None if layout.is_first_stage else layout.rank - layout.tp_size,
                        None if layout.is_last_stage else layout.rank + layout.tp_size, stats)
    return ModelShard(tp, **layout.shard_spec(num_layers)), link, stats


def tp_group_on_one_node(layout: ParallelLayout, rdzv: Rendezvous) -> bool:
    """Whether this rank's TP group lies within one node (nodes hold consecutive ranks)."""
    per_node = layout.world_size // rdzv.nnodes
    ranks = layout.stage_ranks(layout.pp_rank)
    return ranks[0] // per_node == ranks[-1] // per_node and rdzv.device == "cpu"


def shm_slot_bytes(config, mc, dtype) -> int:
    """Room for the largest TP message a step sends (a full batch of hidden states), within 1 .. 64 MiB;
    larger ones (big logit gathers) go through gloo."""
    if config.cpu_allreduce == "gloo" or config.device != "cpu":
        return 0
    from tokenmill.distributed.shm_comm import shm_supported

    if not shm_supported():
        if config.cpu_allreduce == "shm":
            raise ValueError("cpu_allreduce='shm' needs an x86-64 Linux machine with /dev/shm")
        return 0
    need = config.max_num_batched_tokens * mc.hidden_size * max(4, dtype.itemsize)
    return min(max(need, 1 << 20), 64 << 20)


def _shm_group(layout: ParallelLayout, group, slot_bytes: int, timeout_s: float):
    """The TP group's shared-memory segment, or None (gloo carries every collective) where /dev/shm cannot hold
    even 1 MiB slots; with too little room for `slot_bytes` it takes smaller ones (larger messages go through
    gloo)."""
    import uuid

    from tokenmill.distributed.shm_comm import ShmGroup

    first = layout.stage_ranks(layout.pp_rank)[0]
    if layout.rank != first:
        name = [None, 0]
        dist.broadcast_object_list(name, src=first, group=group)
        if name[0] is None:
            return None
        shm = ShmGroup(name[0], layout.tp_rank, layout.tp_size, name[1], timeout_s, create=False)
        dist.barrier(group=group)
        return shm
    path, shm, error = f"/dev/shm/tokenmill-tp-{uuid.uuid4().hex}", None, None
    try:
        while shm is None and slot_bytes >= 1 << 20:
            try:
                shm = ShmGroup(path, layout.tp_rank, layout.tp_size, slot_bytes, timeout_s, create=True)
            except OSError as e:  # ENOSPC: /dev/shm is smaller than the segment (Docker's default is 64 MiB)
                error, slot_bytes = e, slot_bytes // 2
        if shm is None:
            logger.warning("/dev/shm has no room for the TP ranks' shared-memory all-reduce (%s); gloo carries "
                           "every collective (slower). Give the container more: docker run --shm-size 1g, or "
                           "--ipc=host", error)
        elif error is not None:
            logger.warning("/dev/shm is small (%s): the TP ranks' shared-memory slots are %d MiB; larger "
                           "messages go through gloo (docker run --shm-size 1g gives it room)", error,
                           slot_bytes >> 20)
        dist.broadcast_object_list([path if shm is not None else None, slot_bytes], src=first, group=group)
        if shm is not None:
            dist.barrier(group=group)  # everyone has it mapped
    finally:
        if os.path.exists(path):
            os.unlink(path)  # the mappings stay; nothing is left in /dev/shm, whatever happens
    return shm


_released = [False]  # the group's engine has closed (or failed), so a new engine may replace the group


def check_group_free() -> None:
    """Refuse a second multi-rank engine in this process (torch.distributed has one default group per process)
    before it starts anything: its cleanup must not tear down the running engine's group."""
    if dist.is_initialized() and not _released[0]:
        raise RuntimeError("this process already runs a multi-rank engine (torch.distributed has one default "
                           "group per process); close it first")


def release_group(destroy: bool) -> None:
    """The engine is done with the group. `destroy=False` after a failure on a thread other than the one
    that steps (a collective may still be unwinding there): the next init_rank destroys it."""
    _released[0] = True
    if destroy:
        destroy_group()


def destroy_group() -> None:
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # peers already gone
            pass
    _released[0] = False


def agree_min(n: int) -> int:
    """The smallest `n` over all ranks (the KV block count every rank can hold)."""
    import torch

    t = torch.tensor([n], dtype=torch.int64, device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())
