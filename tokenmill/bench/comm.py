"""`tokenmill bench comm`: latency and bandwidth of the collectives tokenmill runs, over the backend the
engine would use (gloo on CPU, NCCL on CUDA), across message sizes, as nccl-tests reports them.

    all_reduce   time per op; algbw = size / time; busbw = algbw * 2 (n - 1) / n   (TP: one per layer half)
    all_gather   size is each rank's part; algbw = n * size / time; busbw = algbw * (n - 1) / n  (TP logits)
    send_recv    one-way time, half a ping-pong round trip between ranks 0 and 1; busbw = algbw (PP)
    shm_all_reduce, shm_all_gather   the same through shared memory (distributed/shm_comm.py: what CPU TP
                 ranks of one node use for messages up to its slot size), single node only

Each figure is the slowest rank's mean over --iters ops after --warmup. Ranks start as local processes, or
one node's share of them with --nnodes/--node-rank/--master-addr/--master-port (or under torchrun).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

from tokenmill.entrypoints.openai.cli_args import positive_int

UNITS = {"B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20, "MB": 1 << 20, "MIB": 1 << 20,
         "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30}
OPS = ("all_reduce", "all_gather", "send_recv", "shm_all_reduce", "shm_all_gather")


def parse_size(s: str) -> int:
    s = s.strip().upper()
    num = s.rstrip("BKMGI")
    unit = s[len(num):] or "B"
    if not num or unit not in UNITS:
        raise argparse.ArgumentTypeError(f"bad size {s!r}; use e.g. 8B, 64KiB, 4MiB")
    return int(float(num) * UNITS[unit])


def parse_sizes(s: str) -> list[int]:
    """'8B..64MiB' (powers of 4 from the first to the last) or a comma list."""
    if ".." in s:
        lo, hi = (parse_size(x) for x in s.split(".."))
        if lo < 1:
            raise ValueError(f"--sizes: a range must start at 1 byte or more, got {s!r}")
        out = []
        while lo <= hi:
            out.append(lo)
            lo *= 4
        return out
    return [parse_size(x) for x in s.split(",") if x.strip()]


def measure(op: str, size: int, iters: int, warmup: int, device: str, shm=None) -> float:
    """Mean seconds per op on this rank."""
    import torch
    import torch.distributed as dist

    n, rank = dist.get_world_size(), dist.get_rank()
    x = torch.ones(max(1, size // 4), dtype=torch.float32, device=device)
    parts = [torch.empty_like(x) for _ in range(n)]

    def once():
        if op == "shm_all_reduce":
            shm.all_reduce(x)
        elif op == "shm_all_gather":
            shm.all_gather(x)
        elif op == "all_reduce":
            dist.all_reduce(x)
        elif op == "all_gather":
            dist.all_gather(parts, x)
        elif rank == 0:  # send_recv ping-pong
            dist.send(x, 1)
            dist.recv(x, 1)
        elif rank == 1:
            dist.recv(x, 0)
            dist.send(x, 0)

    for _ in range(warmup):
        once()
    sync(device)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        once()
    sync(device)
    dt = (time.perf_counter() - t0) / iters
    return dt / 2 if op == "send_recv" else dt


def sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def run_rank(args, rank: int, world: int) -> list[dict] | None:
    import torch
    import torch.distributed as dist

    device = "cuda" if args.backend == "nccl" else "cpu"
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank % max(1, torch.cuda.device_count()))))
    torch.set_num_threads(1)
    init = "env://" if "RANK" in os.environ else f"tcp://{args.master_addr}:{args.master_port}"
    dist.init_process_group(args.backend, init_method=init, rank=rank, world_size=world,
                            timeout=timedelta(seconds=args.timeout))
    shm = None
    if any(op.startswith("shm_") for op in args.ops):
        from tokenmill.distributed.layout import ParallelLayout
        from tokenmill.distributed.rendezvous import _shm_group

        shm = _shm_group(ParallelLayout(world, 1, rank), None, max(args.sizes), args.timeout)
    rows = []
    for op in args.ops:
        for size in args.sizes:
            t = torch.tensor([measure(op, size, args.iters, args.warmup, device, shm)], device=device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            rows.append(_row(op, size, float(t.item()), world))
    dist.destroy_process_group()
    return rows if rank == 0 else None


def _row(op: str, size: int, seconds: float, n: int) -> dict:
    moved = n * size if op.endswith("all_gather") else size
    algbw = moved / seconds / 1e9
    factor = {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n, "send_recv": 1.0}[op.removeprefix("shm_")]
    return {"op": op, "bytes": size, "time_us": seconds * 1e6, "algbw_GBps": algbw, "busbw_GBps": algbw * factor}


def format_rows(rows: list[dict]) -> str:
    lines = [f"{'op':<15} {'bytes':>11} {'time (us)':>11} {'algbw GB/s':>11} {'busbw GB/s':>11}"]
    for r in rows:
        lines.append(f"{r['op']:<15} {r['bytes']:>11} {r['time_us']:>11.1f} {r['algbw_GBps']:>11.3f} "
                     f"{r['busbw_GBps']:>11.3f}")
    return "\n".join(lines)


def cmd_comm(args) -> int:
    from tokenmill.distributed.rendezvous import free_port

    if args.world_size < 2:
        raise ValueError("bench comm needs --world-size >= 2")
    if "RANK" in os.environ:  # torchrun: this process is one rank
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        return _report(args, run_rank(args, rank, world))
    if args.world_size % args.nnodes:
        raise ValueError(f"--nnodes {args.nnodes} does not divide --world-size {args.world_size}")
    if not 0 <= args.node_rank < args.nnodes:  # else its ranks lie past the world: a hang, then a traceback
        raise ValueError(f"--node-rank must be in [0, {args.nnodes - 1}] with --nnodes {args.nnodes}, "
                         f"got {args.node_rank}")
    if args.nnodes > 1 and not args.master_port:
        raise ValueError("a multi-node run needs --master-port (and --master-addr) on every node")
    args.master_port = args.master_port or free_port(args.master_addr)
    per_node = args.world_size // args.nnodes
    ranks = range(args.node_rank * per_node, (args.node_rank + 1) * per_node)
    children = [subprocess.Popen([sys.executable, "-m", "tokenmill.bench.comm", *_child_argv(args, r)])
                for r in ranks[1:]]
    try:
        rows = run_rank(args, ranks[0], args.world_size)
    finally:
        codes = [_wait_or_kill(p, args.timeout) for p in children]
    if any(codes):
        raise RuntimeError(f"bench comm ranks exited with {codes}")
    return _report(args, rows)


def _wait_or_kill(p: subprocess.Popen, timeout: float) -> int:
    """A child rank's exit code; one still running after `timeout` (its peer failed) is killed, not left."""
    try:
        return p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        return p.wait()


def _report(args, rows) -> int:
    if rows is None:
        return 0
    print(format_rows(rows))
    if args.result_file:
        result = {"backend": args.backend, "world_size": args.world_size, "nnodes": args.nnodes,
                  "iters": args.iters, "date": time.strftime("%Y-%m-%d"), "rows": rows, "label": args.label}
        Path(args.result_file).parent.mkdir(parents=True, exist_ok=True)
        Path(args.result_file).write_text(json.dumps(result, indent=1))
        print(f"result written to {args.result_file}")
    return 0


def _child_argv(args, rank: int) -> list[str]:
    return ["--rank", str(rank), "--world-size", str(args.world_size), "--backend", args.backend,
            "--master-addr", args.master_addr, "--master-port", str(args.master_port),
            "--sizes", ",".join(map(str, args.sizes)), "--ops", ",".join(args.ops), "--iters", str(args.iters),
            "--warmup", str(args.warmup), "--timeout", str(args.timeout)]


def add_comm_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--world-size", type=positive_int, default=2, help="ranks in all")
    p.add_argument("--backend", choices=("gloo", "nccl"), default=None, help="default: nccl with CUDA, else gloo")
    p.add_argument("--sizes", type=parse_sizes, default="8B..64MiB", help="'8B..64MiB' (x4 steps) or a list")
    p.add_argument("--ops", type=lambda s: [o for o in s.split(",") if o], default=",".join(OPS[:3]),
                   help=f"any of {', '.join(OPS)}")
    p.add_argument("--iters", type=positive_int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--nnodes", type=positive_int, default=1)
    p.add_argument("--node-rank", type=int, default=0)
    p.add_argument("--master-addr", default="127.0.0.1")
    p.add_argument("--master-port", type=int, default=0)
    p.add_argument("--timeout", type=float, default=120.0, help="seconds before a rank gives up")
    p.add_argument("--result-file", default=None, help="write the JSON result here")
    p.add_argument("--label", default=None)


def resolve_backend(args) -> None:
    if args.backend is None:
        import torch

        args.backend = "nccl" if torch.cuda.is_available() else "gloo"
    bad = [o for o in args.ops if o not in OPS]
    if bad:
        raise ValueError(f"unknown op(s) {bad}; choose from {list(OPS)}")
    if args.nnodes > 1 and any(o.startswith("shm_") for o in args.ops):
        raise ValueError("shared-memory ops need every rank on one node")


def main() -> None:
    """A child rank: `python -m tokenmill.bench.comm --rank R ...`."""
    p = argparse.ArgumentParser()
    add_comm_args(p)
    p.add_argument("--rank", type=int, required=True)
    args = p.parse_args()
    run_rank(args, args.rank, args.world_size)


if __name__ == "__main__":
    main()
