"""One trial: a real `tokenmill serve` process with the trial's settings, loaded with the workload the way
`tokenmill bench serve` does it. The workload runs in two halves, so a hopeless trial can stop after the
first (`keep_going` sees the first half's result)."""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass

from tokenmill.bench.metrics import compute_metrics, results_from_json
from tokenmill.bench.serve_client import run_benchmark
from tokenmill.entrypoints.server_process import free_port, stop, wait_until_up
from tokenmill.tune.space import to_flags


@dataclass
class Workload:
    requests: list  # SampleRequest
    request_rate: float
    max_concurrency: int | None
    goodput_slos_ms: dict
    percentiles: tuple = (50, 90, 99)
    ignore_eos: bool = True
    seed: int = 0


def run_trial(settings: dict, base_flags: list[str], load: Workload, keep_going=lambda first: True,
              startup_timeout_s: float = 600) -> dict:
    """The trial's bench result (with `pruned` / `failed` set when it stopped early)."""
    port = free_port()
    log = tempfile.NamedTemporaryFile(prefix="tokenmill-tune-", suffix=".log", delete=False)
    cmd = [sys.executable, "-m", "tokenmill", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--served-model-name", "tune", "--disable-log-requests", "--disable-uvicorn-access-log",
           "--uvicorn-log-level", "warning", *base_flags, *to_flags(settings)]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    try:
        try:
            wait_until_up(proc, f"http://127.0.0.1:{port}/health", startup_timeout_s, lambda: _tail(log.name))
        except (RuntimeError, TimeoutError) as e:
            return {"failed": str(e)}
        half = max(1, len(load.requests) // 2)
        first = _bench(port, load.requests[:half], load, warmups=1)
        if not keep_going(first) or half == len(load.requests):
            return dict(first, pruned=half < len(load.requests))
        second = _bench(port, load.requests[half:], load, warmups=0)
        return _merge(first, second, load)
    finally:
        stop(proc)
        log.close()
        os.unlink(log.name)


def _tail(path: str) -> str:
    with open(path, errors="replace") as f:
        return f.read()[-600:].strip()


def _bench(port: int, requests: list, load: Workload, warmups: int) -> dict:
    return asyncio.run(run_benchmark(
        requests, f"http://127.0.0.1:{port}", "tune", request_rate=load.request_rate,
        max_concurrency=load.max_concurrency, seed=load.seed, ignore_eos=load.ignore_eos, num_warmups=warmups,
        percentiles=load.percentiles, goodput_slos_ms=load.goodput_slos_ms or None, disable_tqdm=True))


def _merge(a: dict, b: dict, load: Workload) -> dict:
    """Both halves' requests as one run (their durations add)."""
    results = results_from_json(a) + results_from_json(b)
    out = compute_metrics(results, a["duration"] + b["duration"], list(load.percentiles),
                          load.goodput_slos_ms or None)
    out["pruned"] = False
    return out
