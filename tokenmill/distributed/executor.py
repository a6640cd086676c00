"""The driver's side of a multi-rank engine (rank 0, inside EngineCore): start the other ranks, send each
step to all of them, run its own share, and collect the result.

    EngineCore --Step--> every worker's control connection       (control.py)
        rank 0 runs its shard too: TP all-reduces / PP sends meet the workers in torch.distributed
        tensor parallel only:  rank 0 samples like every TP rank; its own result is the step's
        pipeline parallel:     rank 0 is stage 0 and returns as soon as its sends are queued; the last
                               stage's TP rank 0 sends the ModelRunnerOutput back, collected later, so
                               up to pp steps are in flight (engine/core.py)

Failure: a local worker that exits, a control connection at EOF, or a collective that raises (gloo notices
a dead peer's closed socket at once; distributed_timeout_s bounds the rest) becomes WorkerFailure, and
every worker is stopped. The engine-core process treats it as fatal, so the server exits with the reason.
"""
from __future__ import annotations

import logging
import os
import pickle
import subprocess
import threading
import time
from multiprocessing.connection import Connection, Listener, wait

from tokenmill.child_process import spawn_child
from tokenmill.config import EngineConfig, ModelConfig
from tokenmill.distributed import control
from tokenmill.distributed.layout import ParallelLayout, threads_per_rank
from tokenmill.distributed.rendezvous import (Rendezvous, agree_min, check_group_free, init_rank, release_group,
                                             shm_slot_bytes)
from tokenmill.distributed.worker import WorkerArgs
from tokenmill.worker.build import build_runner
from tokenmill.worker.model_runner import ModelRunnerOutput

logger = logging.getLogger("tokenmill")


class WorkerFailure(RuntimeError):
    """A rank died or failed: the engine cannot go on (every rank holds part of every request)."""


def start_local_workers(config: EngineConfig, rdzv: Rendezvous, skip_rank: int | None) -> list[tuple[int, subprocess.Popen]]:
    """Processes for this node's ranks (all but `skip_rank`, which the caller runs itself)."""
    layout = ParallelLayout(config.tensor_parallel_size, config.pipeline_parallel_size)
    ranks = [r for r in rdzv.node_ranks(layout.world_size) if r != skip_rank]
    threads = config.num_threads or threads_per_rank(len(rdzv.node_ranks(layout.world_size)))
    procs = []
    for rank in ranks:
        # the effective level: an unset logger's own level is 0, which made the workers print DEBUG lines
        level = logging.getLogger("tokenmill").getEffectiveLevel()
        args = WorkerArgs(config, layout.for_rank(rank), rdzv, threads, level)
        procs.append((rank, spawn_child("tokenmill.distributed.worker", args)))
    return procs


def run_node_agent(config: EngineConfig) -> int:
    """Node `node_rank > 0` of a multi-node engine: start this node's ranks, wait for them; they connect to
    node 0's driver. Exits with the first failure's code (the others are stopped)."""
    _resolve(config)
    rdzv = Rendezvous.from_config(config)
    procs = start_local_workers(config, rdzv, skip_rank=None)
    logger.info("node %d: started ranks %s; waiting for the driver at %s:%d", rdzv.node_rank,
                [r for r, _ in procs], *rdzv.control_address)
    try:
        while True:
            codes = [p.poll() for _, p in procs]
            failed = [c for c in codes if c]
            if failed or all(c is not None for c in codes):
                return failed[0] if failed else 0
            time.sleep(0.2)
    finally:
        for _, p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()


def run_launched_rank(config: EngineConfig) -> int | None:
    """Under torchrun every rank runs the same command: rank 0 goes on as the driver (returns None), the
    others run the worker loop here and exit."""
    from tokenmill.distributed.rendezvous import torchrun_rank
    from tokenmill.distributed.worker import run_worker

    rank = torchrun_rank()
    if rank is None or rank == 0:
        return None
    _resolve(config)
    rdzv = Rendezvous.from_config(config)
    layout = ParallelLayout(config.tensor_parallel_size, config.pipeline_parallel_size, rank)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", layout.world_size))
    run_worker(WorkerArgs(config, layout, rdzv, config.num_threads or threads_per_rank(local)))
    return 0


def _resolve(config: EngineConfig) -> None:
    """The model-dependent defaults, as the driver resolves them (EngineCore does, for node 0)."""
    from tokenmill.models.loader import load_hf_config

    config.resolve(ModelConfig.from_hf(load_hf_config(config.model)))


class MultiprocExecutor:
    def __init__(self, config: EngineConfig, mc: ModelConfig, dtype):
        import torch

        check_group_free()  # before anything starts: a refused engine's cleanup must leave the running one alone
        self.config = config
        self.layout = ParallelLayout(config.tensor_parallel_size, config.pipeline_parallel_size, rank=0)
        self.rdzv = Rendezvous.from_config(config)
        self.max_in_flight = self.layout.pp_size
        self.failure: str | None = None
        self._joined = False  # this engine reached init_rank: the process group is its to release
        self._exit_codes: dict[int, int] = {}  # worker exit codes, as the watch threads see them
        self.on_failure = None  # set by the engine-core process: wakes its loop when a worker dies while idle
        self._closing = False
        self._lock = threading.Lock()
        self.procs = []
        if config.distributed_executor_backend == "ray":
            self.procs = self._start_ray_ranks()
        self.listener = Listener(self.rdzv.control_address, authkey=control.authkey())
        if config.distributed_executor_backend == "ray":
            for rank, handle in self.procs:
                handle.start(WorkerArgs(config, self.layout.for_rank(rank), self.rdzv, self._threads))
        elif not self.rdzv.launched:
            self.procs = start_local_workers(config, self.rdzv, skip_rank=0)
        try:
            self.conns = self._accept_workers()
            ray = config.distributed_executor_backend == "ray"  # assume the actors packed on this node
            ranks_here = self.layout.world_size if ray else len(self.rdzv.node_ranks(self.layout.world_size))
            self._caller_threads = torch.get_num_threads()  # rank 0 computes in the caller's process
            torch.set_num_threads(config.num_threads or threads_per_rank(ranks_here))
            self._joined = True
            shard, link, self.comm_stats = init_rank(self.layout, self.rdzv, mc.num_layers,
                                                       shm_slot_bytes(config, mc, dtype))
            self.runner = build_runner(config, mc, dtype, shard, link, agree=agree_min)
        except BaseException as e:
            reason = self._worker_reason()
            self.close(graceful=False)
            if reason:
                raise WorkerFailure(reason) from e
            raise
        self.result_conn = self.conns.get(self.layout.result_rank)  # None: rank 0 samples (pp == 1)
        for rank, p in self.procs:
            threading.Thread(target=self._watch, args=(rank, p), daemon=True, name=f"watch-rank-{rank}").start()

    # -- startup -------------------------------------------------------------------------------------
    def _start_ray_ranks(self):
        """Ranks 1 .. n-1 as Ray actors; the rendezvous moves to the driver's address in Ray's network."""
        from dataclasses import replace

        from tokenmill.distributed.ray_launcher import create_ray_ranks, ray_available, ray_driver_address
        from tokenmill.distributed.rendezvous import free_port

        if not ray_available():
            raise ValueError("distributed_executor_backend='ray' needs ray (pip install 'tokenmill[ray]')")
        ip = ray_driver_address()
        self._threads = self.config.num_threads or threads_per_rank(self.layout.world_size)  # packed: local
        handles = create_ray_ranks(list(range(1, self.layout.world_size)), self._threads,
                                   gpus=self.config.device == "cuda")
        # shared memory only when every rank shares the driver's node; else every rank counts as its own node
        nnodes = 1 if all(h.node_ip == ip for _, h in handles) else self.layout.world_size
        self.rdzv = replace(self.rdzv, master_addr=ip, master_port=free_port(ip), nnodes=nnodes, node_rank=0)
        return handles

    def _accept_workers(self) -> dict[int, Connection]:
        """Every other rank's hello, within the rendezvous timeout; versions must match ours."""
        expected = self.layout.world_size - 1
        conns: dict[int, Connection] = {}
        ours = control.versions()
        sock = self.listener._listener._socket  # accept() has no timeout of its own
        sock.settimeout(self.rdzv.timeout_s)
        while len(conns) < expected:
            try:
                conn = self.listener.accept()
            except TimeoutError:
                raise TimeoutError(f"rendezvous timed out after {self.rdzv.timeout_s:.0f} s: {len(conns)} of "
                                   f"{expected} worker ranks connected (missing: "
                                   f"{sorted(set(range(1, expected + 1)) - set(conns))})") from None
            hello = conn.recv()
            control.check_versions(ours, hello.versions, hello.rank)
            conns[hello.rank] = conn
        return conns

    # -- steps ---------------------------------------------------------------------------------------
    def execute(self, sched) -> ModelRunnerOutput:
        self.submit(sched)
        return self.collect() if self.result_conn is not None else self._last

    def submit(self, sched) -> None:
        """Send the step to every worker and run rank 0's share (its sends queued, for pipeline stage 0)."""
        self._check()
        self._broadcast(control.Step(sched, self.runner.defer_tokens))
        try:
            self._last = self.runner.execute(sched)
        except Exception as e:
            raise self._fail(e) from e

    def collect(self) -> ModelRunnerOutput:
        """The oldest submitted step's result, from the last stage (pipeline parallelism). A stage that hangs
        (no exit, no error) fails the engine after distributed_timeout_s, as a collective would."""
        timeout = self.config.distributed_timeout_s
        try:
            if not self.result_conn.poll(timeout):
                raise TimeoutError(f"no result from the last pipeline stage in {timeout:.0f} s "
                                   "(distributed_timeout_s): a worker hangs")
            msg = self.result_conn.recv()
        except (EOFError, OSError) as e:  # TimeoutError is an OSError
            raise self._fail(e) from e
        if isinstance(msg, control.WorkerError):
            raise self._fail(None, f"worker rank {msg.rank} failed: {msg.message}")
        return msg

    def precompile(self, spec) -> None:
        """A structured-output request's grammar, compiled ahead by every other rank that samples."""
        self._broadcast(control.Precompile(spec))

    def release_requests(self, request_ids, preempted_ids=()) -> None:
        self.runner.release_requests(request_ids, preempted_ids)
        if request_ids or preempted_ids:
            self._broadcast(control.Release(list(request_ids), list(preempted_ids)))

    def _broadcast(self, msg) -> None:
        blob = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            for conn in self.conns.values():
                conn.send_bytes(blob)
        except OSError as e:
            raise self._fail(e) from e

    # -- failure -------------------------------------------------------------------------------------
    def _check(self) -> None:
        if self.failure is not None:
            self._restore_threads()  # the watchdog's close could not (it is not the caller's thread)
            raise WorkerFailure(self.failure)

    def _fail(self, cause: BaseException | None, reason: str | None = None) -> WorkerFailure:
        reason = reason or self._worker_reason(wait_s=2.0) or f"a distributed step failed: {cause!r}"
        self.failure = self.failure or reason
        self.close(graceful=False)
        self._restore_threads()
        return WorkerFailure(self.failure)

    def _worker_reason(self, wait_s: float = 0.5) -> str | None:
        """Why a worker went away: its WorkerError message if it sent one, else its exit code."""
        conns = list(getattr(self, "conns", {}).items())
        ready = wait([c for _, c in conns], timeout=wait_s) if conns else []
        for rank, conn in conns:
            if conn in ready:
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    continue
                if isinstance(msg, control.WorkerError):
                    return f"worker rank {msg.rank} failed: {msg.message}"
        # a dead worker's connection may report before its exit code is known (a reset mid-step): wait a moment
        deadline = time.monotonic() + (wait_s if ready else 0.0)
        while True:
            for rank, p in self.procs:
                # the watch thread may hold the process in wait(), where poll() answers None: its code, once known
                code = self._exit_codes.get(rank, p.poll())
                if code is not None and code != 0:
                    return f"worker rank {rank} exited with code {code}"
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.01)

    def _watch(self, rank: int, proc: subprocess.Popen) -> None:
        code = self._exit_codes[rank] = proc.wait()
        if self._closing:
            return
        self.failure = self.failure or f"worker rank {rank} exited with code {code}"
        logger.error("%s; stopping the engine", self.failure)
        self.close(graceful=False)  # the other ranks may wait on the dead one in a collective
        if self.on_failure is not None:
            self.on_failure(self.failure)

    # -- shutdown ------------------------------------------------------------------------------------
    def close(self, graceful: bool = True) -> None:
        """Stop every worker: a Shutdown and a short wait when all is well, a kill after a failure (a rank
        may be blocked in a collective with a dead peer)."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
        shm = getattr(getattr(self, "runner", None), "model", None)
        shm = shm.shard.tp.shm if shm is not None else None
        if shm is not None and not graceful:
            shm.cancelled = True  # rank 0 may be waiting in shared memory for a peer that is gone
        for conn in getattr(self, "conns", {}).values():
            try:
                if graceful:
                    conn.send_bytes(pickle.dumps(control.Shutdown()))
            except OSError:
                pass
        for _, p in self.procs:
            try:
                p.wait(timeout=5 if graceful else 0.5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            if p.stdin:
                p.stdin.close()
        self.listener.close()
        on_main = threading.current_thread() is threading.main_thread()
        if self._joined:
            release_group(destroy=on_main)
        if on_main:
            self._restore_threads()

    def _restore_threads(self) -> None:
        """Give the caller's process its torch threads back (set from the thread that steps: OpenMP's
        thread count is per thread)."""
        threads = getattr(self, "_caller_threads", None)
        if threads is not None:
            import torch

            torch.set_num_threads(threads)
            self._caller_threads = None
