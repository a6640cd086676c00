"""The control channel between the driver (rank 0) and each worker: pickled messages over TCP
(multiprocessing.connection, HMAC-authenticated), separate from torch.distributed's tensor traffic, so a
worker idles on a socket read between steps instead of on a collective with a timeout, and a dead peer is
an EOF at once.

    driver -> worker:  Step(SchedulerOutput, defer_tokens) | Release(request ids) | Precompile(grammar) | Shutdown
    worker -> driver:  Hello(rank, versions) once; then, from the rank that samples on the last stage
                       (pipeline parallelism), one ModelRunnerOutput per Step; WorkerError before it exits
"""
from __future__ import annotations

import os
import platform
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Client, Connection

import torch

from tokenmill.sched.output import SchedulerOutput


@dataclass
class Hello:
    rank: int
    versions: dict


@dataclass
class Step:
    sched: SchedulerOutput
    # async scheduling (tensor parallelism): the step leaves its tokens on the device, as rank 0's does; the
    # worker collects them after it has run the next step, as the engine does (engine/core.py)
    defer_tokens: bool = False


@dataclass
class Release:
    request_ids: list[str]
    preempted_ids: list[str] = field(default_factory=list)


@dataclass
class Precompile:
    """A structured-output request arrived: the ranks that sample compile its grammar now, on a thread, as
    rank 0 does (engine/grammar_wait.py), rather than in the request's first step, which would stall it."""
    spec: object  # sampling_params.StructuredOutputsParams


@dataclass
class Shutdown:
    pass


@dataclass
class WorkerError:
    rank: int
    message: str


def versions() -> dict:
    """What must match across nodes for the ranks to compute the same thing."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        ours = version("tokenmill")
    except PackageNotFoundError:  # running from a source tree
        ours = "source"
    return {"tokenmill": ours, "torch": torch.__version__, "python": platform.python_version()}


def check_versions(ours: dict, theirs: dict, rank: int) -> None:
    diff = {k: (ours.get(k), v) for k, v in theirs.items() if ours.get(k) != v}
    if diff:
        raise ValueError(f"rank {rank} runs different versions than rank 0: "
                         + ", ".join(f"{k} {a} here, {b} there" for k, (a, b) in diff.items()))


def authkey() -> bytes:
    """Shared by the driver and workers; set TOKENMILL_DIST_AUTHKEY on every node when the control port is
    reachable by others (it is only a guard: keep the ranks on a trusted network, as torch.distributed
    itself assumes)."""
    return os.environ.get("TOKENMILL_DIST_AUTHKEY", "tokenmill-control").encode()


def connect(address: tuple[str, int], timeout_s: float) -> Connection:
    """Connect to the driver, retrying while it starts (other nodes may come up first)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return Client(address, authkey=authkey())
        except (ConnectionRefusedError, OSError):
            if time.monotonic() > deadline:
                raise TimeoutError(f"no tokenmill driver at {address[0]}:{address[1]} after {timeout_s:.0f} s "
                                   f"(is node 0 up, and are --master-addr/--master-port the same on every node?)")
            time.sleep(0.2)
