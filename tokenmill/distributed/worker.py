"""One rank's process: join the group, build its shard of the model, then run every step the driver sends.

    python -m tokenmill.distributed.worker    (started by the driver or a node agent; stdin carries the
                                               pickled WorkerArgs and then stays open: EOF = parent died)

Every rank of a step runs the same `ModelRunner.execute`: TP ranks compute their heads and meet in the
all-reduces, pipeline stages pass hidden states on, and the last stage samples (identically on each of its
TP ranks, from all-gathered logits and the same seeded generators). Its TP rank 0 sends the result back.
"""
from __future__ import annotations

import logging
import os
import pickle
import sys
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from tokenmill.child_process import read_payload
from tokenmill.distributed.layout import ParallelLayout

logger = logging.getLogger("tokenmill")


@dataclass
class WorkerArgs:
    config: object  # EngineConfig
    layout: ParallelLayout
    rendezvous: object  # rendezvous.Rendezvous
    num_threads: int
    log_level: int = logging.INFO


def run_worker(args: WorkerArgs) -> None:
    from tokenmill import cpu_threads  # noqa: F401  (OpenMP settings before torch loads)
    import torch

    from tokenmill.config import ModelConfig
    from tokenmill.distributed import control
    from tokenmill.distributed.rendezvous import agree_min, init_rank, shm_slot_bytes
    from tokenmill.models.loader import load_hf_config
    from tokenmill.worker.build import build_runner

    cfg, layout = args.config, args.layout
    conn = control.connect(args.rendezvous.control_address, args.rendezvous.timeout_s)
    conn.send(control.Hello(layout.rank, control.versions()))
    try:
        torch.set_num_threads(args.num_threads)
        torch.manual_seed(cfg.seed)
        mc = ModelConfig.from_hf(load_hf_config(cfg.model))
        shard, link, _ = init_rank(layout, args.rendezvous, mc.num_layers,
                                   shm_slot_bytes(cfg, mc, cfg.torch_dtype(mc)))
        runner = build_runner(cfg, mc, cfg.torch_dtype(mc), shard, link, agree=agree_min)
        reports = layout.rank == layout.result_rank and layout.pp_size > 1
        deferred = None  # async scheduling: the step before's output, its tokens still on the device
        precompiling = None  # structured outputs: the thread that compiles grammars ahead of their steps
        while True:
            msg = pickle.loads(conn.recv_bytes())
            if isinstance(msg, control.Step):
                runner.defer_tokens = msg.defer_tokens
                out = runner.execute(msg.sched)
                if deferred is not None:  # its tokens replace their placeholders in this rank's states
                    runner.collect(deferred.deferred, deferred)
                deferred = out if out is not None and out.deferred is not None else None
                if reports:
                    conn.send(out)
            elif isinstance(msg, control.Release):
                runner.release_requests(msg.request_ids, msg.preempted_ids)
            elif isinstance(msg, control.Precompile) and layout.is_last_stage:
                if precompiling is None:
                    precompiling = ThreadPoolExecutor(1, thread_name_prefix="tokenmill-grammar")
                precompiling.submit(_precompile, runner.grammars, msg.spec, layout.rank)
            elif isinstance(msg, control.Shutdown):
                break
    except EOFError:
        logger.warning("worker rank %d: the driver is gone; exiting", layout.rank)
        os._exit(1)
    except BaseException as e:
        logger.error("worker rank %d failed:\n%s", layout.rank, traceback.format_exc())
        try:
            conn.send(control.WorkerError(layout.rank, f"{type(e).__name__}: {e}"))
        except OSError:
            pass
        os._exit(1)  # no torch.distributed teardown: the peers may be gone
    conn.close()
    os._exit(0)


def _precompile(grammars, spec, rank: int) -> None:
    """The grammar into this rank's compiler cache (its failure is the engine's to report: rank 0 compiles it
    too, and refuses the request)."""
    t0 = time.perf_counter()
    try:
        grammars.compile(spec)
    except Exception as e:
        logger.debug("rank %d: a grammar failed to compile ahead: %s", rank, e)
        return
    logger.debug("rank %d: grammar compiled ahead of its request's steps in %.0f ms", rank,
                 (time.perf_counter() - t0) * 1e3)


def _exit_when_parent_dies(stdin) -> None:
    while stdin.read(65536):
        pass
    os._exit(1)


def main() -> None:
    args: WorkerArgs = read_payload()
    logging.basicConfig(level=args.log_level, format=f"%(asctime)s %(levelname)s [rank {args.layout.rank}] %(message)s")
    threading.Thread(target=_exit_when_parent_dies, args=(sys.stdin.buffer,), daemon=True).start()
    run_worker(args)


if __name__ == "__main__":
    main()
