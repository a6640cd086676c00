"""What splitting a model costs: gloo's collectives, serving latency with TP=2 / PP=2 against one process,
and the same across a simulated link between two nodes (delay_line.py), plus the fit of an analytic model.

    python benchmarks/bench_parallel.py comm      bench comm, 2 ranks on this machine (loopback)
    python benchmarks/bench_parallel.py serving   single, TP=2, PP=2 at one Poisson load, in one run
    python benchmarks/bench_parallel.py link      TP=2 and PP=2 split over two namespaces, one-way delay
                                                  0 / 1 / 5 ms at 10 Gbit/s, with bench comm over each link
    python benchmarks/bench_parallel.py probe     unloaded TTFT (one request at a time) over the same links
    python benchmarks/bench_parallel.py fit       alpha + bytes / beta per transfer, fitted to the link runs

Model: Qwen2.5-0.5B's layers (dummy weights) with the shipped tokenizer. Results: benchmarks/results/.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from common import machine, qwen_shape_with_shipped_tokenizer, write_json  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
PY = sys.executable
SPLITS = {"single": [], "tp2": ["--tensor-parallel-size", "2"],
          "tp2-gloo": ["--tensor-parallel-size", "2", "--cpu-allreduce", "gloo"],
          "pp2": ["--pipeline-parallel-size", "2"]}
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
NODE_ENV = {"tm0": "tmt0", "tm1": "tmt1"}  # namespace -> the interface gloo must bind (GLOO_SOCKET_IFNAME)


def ns_cmd(ns: str | None, cmd: list[str]) -> list[str]:
    return ["ip", "netns", "exec", ns, *cmd] if ns else cmd


def ns_env(ns: str | None) -> dict:
    return {**ENV, "GLOO_SOCKET_IFNAME": NODE_ENV[ns]} if ns else ENV


def serve_args(model: str, max_len: int) -> list[str]:
    return ["--model", model, "--load-format", "dummy", "--dtype", "bfloat16", "--max-model-len", str(max_len),
            "--max-num-seqs", "16", "--served-model-name", "bench", "--disable-log-requests",
            "--disable-uvicorn-access-log", "--uvicorn-log-level", "warning"]


def wait_ready(ns: str | None, port: int, proc: subprocess.Popen, timeout: float = 600) -> None:
    probe = ("import httpx, sys\ntry:\n    sys.exit(0 if httpx.get('http://127.0.0.1:%d/health', timeout=2)"
             ".status_code == 200 else 1)\nexcept Exception:\n    sys.exit(1)" % port)
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        if subprocess.run(ns_cmd(ns, [PY, "-c", probe]), env=ENV).returncode == 0:
            return
        time.sleep(1)
    raise TimeoutError("server not ready")


def run_serving(name: str, extra: list[str], load: dict, ns: str | None = None, remote: str | None = None,
                log_dir: Path | None = None) -> dict:
    """One server (with node 1's ranks in namespace `remote` when split across the link) under the load."""
    model = qwen_shape_with_shipped_tokenizer()
    args = serve_args(model, load["input_len"] + load["output_len"] + 16) + extra
    port = 18000 + (os.getpid() % 1000)
    node = []
    if remote:
        node = ["--nnodes", "2", "--master-addr", "10.77.0.1", "--master-port", "29700"]
    logs = log_dir or Path(tempfile.mkdtemp())
    server = subprocess.Popen(ns_cmd(ns, [PY, "-m", "tokenmill", "serve", *args, "--port", str(port), *node]),
                              env=ns_env(ns), stdout=open(logs / f"{name}.log", "wb"), stderr=subprocess.STDOUT)
    agent = None
    if remote:
        agent = subprocess.Popen(ns_cmd(remote, [PY, "-m", "tokenmill", "serve", *args, *node, "--node-rank", "1"]),
                                 env=ns_env(remote), stdout=open(logs / f"{name}.node1.log", "wb"),
                                 stderr=subprocess.STDOUT)
    try:
        wait_ready(ns, port, server)
        out = logs / f"{name}.json"
        bench = [PY, "-m", "tokenmill", "bench", "serve", "--base-url", f"http://127.0.0.1:{port}", "--model", "bench",
                 "--tokenizer", model, "--dataset-name", "random", "--random-input-len", str(load["input_len"]),
                 "--random-output-len", str(load["output_len"]), "--num-prompts", str(load["num_prompts"]),
                 "--request-rate", str(load["request_rate"]), "--seed", "0", "--ignore-eos", "--num-warmups", "2",
                 *(["--max-concurrency", str(load["max_concurrency"])] if load.get("max_concurrency") else []),
                 "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
                 "--result-file", str(out), "--disable-tqdm", "--label", name]
        subprocess.run(ns_cmd(ns, bench), env=ENV, check=True, stdout=subprocess.DEVNULL)
        r = json.loads(out.read_text())
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
        if agent is not None:
            try:
                agent.wait(30)
            except subprocess.TimeoutExpired:
                agent.kill()
    keys = ("p50_ttft_ms", "p99_ttft_ms", "p50_itl_ms", "p99_itl_ms", "p99_tpot_ms", "p99_e2el_ms",
            "output_throughput", "completed")
    return {"name": name, **{k: r[k] for k in keys}}


def with_ratios(rows: list[dict], base: dict) -> list[dict]:
    for r in rows:
        r["p99_ttft_x"] = r["p99_ttft_ms"] / base["p99_ttft_ms"]
        r["p99_itl_x"] = r["p99_itl_ms"] / base["p99_itl_ms"]
        r["p99_ttft_added_ms"] = r["p99_ttft_ms"] - base["p99_ttft_ms"]
        r["throughput_x"] = r["output_throughput"] / base["output_throughput"]
    return rows


def cmd_comm(args) -> None:
    out = RESULTS / "parallel_comm.json"
    subprocess.run([PY, "-m", "tokenmill", "bench", "comm", "--world-size", "2", "--sizes", "8B..16MiB",
                    "--ops", "all_reduce,all_gather,send_recv,shm_all_reduce,shm_all_gather",
                    "--iters", str(args.iters), "--result-file", str(out)], env=ENV, check=True)
    res = json.loads(out.read_text())
    res["machine"] = machine()
    write_json(res, str(out))


def cmd_serving(args) -> None:
    load = dict(input_len=args.input_len, output_len=args.output_len, num_prompts=args.num_prompts,
                request_rate=args.request_rate)
    rows = [run_serving(name, extra, load) for name, extra in SPLITS.items()]
    for r in rows:
        print(r, flush=True)
    write_json({"machine": machine(), "load": load, "rows": with_ratios(rows, rows[0])},
               str(RESULTS / "parallel_serving.json"))


def link_comm(delay_ms: float) -> list[dict]:
    """bench comm between the namespaces over the current link."""
    out = Path(tempfile.mkdtemp()) / "comm.json"
    common = ["bench", "comm", "--world-size", "2", "--nnodes", "2", "--master-addr", "10.77.0.1",
              "--master-port", "29710", "--sizes", "8B..4MiB", "--iters", "10", "--ops", "all_reduce,send_recv"]
    peer = subprocess.Popen(ns_cmd("tm1", [PY, "-m", "tokenmill", *common, "--node-rank", "1"]), env=ns_env("tm1"),
                            stdout=subprocess.DEVNULL)
    subprocess.run(ns_cmd("tm0", [PY, "-m", "tokenmill", *common, "--node-rank", "0", "--result-file", str(out)]),
                   env=ns_env("tm0"), check=True, stdout=subprocess.DEVNULL)
    peer.wait(60)
    return [dict(r, delay_ms=delay_ms) for r in json.loads(out.read_text())["rows"]]


def each_link(args, fn) -> None:
    """fn(delay_ms) with the delay line up at each delay."""
    line = [PY, str(ROOT / "benchmarks" / "delay_line.py")]
    for delay in args.delays:
        link = subprocess.Popen([*line, "up", "--delay-ms", str(delay), "--rate-gbit", str(args.rate_gbit)],
                                stdout=subprocess.PIPE, text=True)
        try:
            assert link.stdout.readline().strip() == "link up"
            fn(delay)
        finally:
            link.send_signal(signal.SIGTERM)
            link.wait(30)


def cmd_link(args) -> None:
    load = dict(input_len=args.input_len, output_len=args.output_len, num_prompts=args.num_prompts,
                request_rate=args.request_rate)
    rows, comm = [], []

    def runs(delay):
        nonlocal comm
        if not rows:  # the one-process baseline, in the same namespace and load, once
            rows.append(dict(run_serving("single", [], load, ns="tm0"), delay_ms=None))
        comm += link_comm(delay)
        for name in args.splits:
            r = run_serving(f"{name}-{delay:g}ms", SPLITS[name], load, ns="tm0", remote="tm1")
            rows.append(dict(r, split=name, delay_ms=delay))
            print(rows[-1], flush=True)

    each_link(args, runs)
    write_json({"machine": machine(), "load": load, "rate_gbit": args.rate_gbit, "rows": with_ratios(rows, rows[0]),
                "comm": comm}, str(RESULTS / "parallel_link.json"))


def cmd_probe(args) -> None:
    """Unloaded TTFT: one request at a time, so the link's cost is not hidden in queueing noise."""
    load = dict(input_len=args.input_len, output_len=2, num_prompts=args.num_prompts, request_rate="inf",
                max_concurrency=1)
    rows = []

    def runs(delay):
        for name in args.splits:
            r = run_serving(f"probe-{name}-{delay:g}ms", SPLITS[name], load, ns="tm0", remote="tm1")
            rows.append(dict(r, split=name, delay_ms=delay))
            print(rows[-1], flush=True)

    each_link(args, runs)
    for r in rows:
        base = next(b for b in rows if b["split"] == r["split"] and b["delay_ms"] == 0)
        r["p50_ttft_added_ms"] = r["p50_ttft_ms"] - base["p50_ttft_ms"]
        r["p99_ttft_added_ms"] = r["p99_ttft_ms"] - base["p99_ttft_ms"]
    write_json({"machine": machine(), "load": load, "rate_gbit": args.rate_gbit, "rows": rows},
               str(RESULTS / "parallel_probe.json"))


QWEN_05B = dict(layers=24, hidden=896, bytes=2)   # the benchmark's model (bf16)
LLAMA_70B = dict(layers=80, hidden=8192, bytes=2)  # the playbook's model class
# (alpha us, beta GB/s) per link; NVLink and NIC figures are assumptions from public nccl-tests results
# (H100/H200 8-GPU NVLink: ~10 us small all-reduce, ~400 GB/s bus bandwidth), not measured here.
LINKS = {"NVLink (8 GPUs, one node)": (10.0, 400.0), "400 Gbit/s RDMA": (10.0, 50.0),
         "100 Gbit/s RDMA": (15.0, 12.5), "100 Gbit/s TCP": (50.0, 12.5)}


def fit_line(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least squares of time = alpha + bytes / beta; returns (alpha s, beta bytes/s)."""
    import numpy as np

    x, y = np.array([p[0] for p in points], float), np.array([p[1] for p in points])
    slope, alpha = np.polyfit(x, y, 1)
    return float(alpha), float(1 / slope) if slope > 0 else float("inf")


def step_cost(model: dict, tokens: int, alpha: float, beta: float, split: str, ranks: int = 2) -> float:
    """Seconds of communication one step adds: TP runs 2 all-reduces per layer, one for the embedding and
    a logits gather (counted as one more all-reduce of the hidden size: the same order); a 2-stage
    pipeline sends hidden + residual once and the result back once (latency only)."""
    msg = tokens * model["hidden"] * model["bytes"]
    if split == "tp":
        ring = 2 * (ranks - 1) / ranks  # bytes each rank moves per byte of message
        return (2 * model["layers"] + 2) * (alpha + ring * msg / beta)
    return 2 * alpha + 2 * msg / beta


def cmd_fit(args) -> None:
    res = json.loads((RESULTS / "parallel_link.json").read_text())
    fits = {}
    for delay in sorted({r["delay_ms"] for r in res["comm"]}):
        for op in ("all_reduce", "send_recv"):
            pts = [(r["bytes"], r["time_us"] * 1e-6) for r in res["comm"] if r["delay_ms"] == delay and r["op"] == op]
            alpha, beta = fit_line(pts)
            fits[f"{op}@{delay:g}ms"] = {"alpha_us": alpha * 1e6, "beta_GBps": beta / 1e9}
    # the model against the serving runs: predicted vs measured added P50 ITL (decode steps) per link
    base_itl = {r["split"]: r["p50_itl_ms"] for r in res["rows"] if r.get("delay_ms") == 0}
    batch = 4  # a few decodes per step; their messages (KiB) are latency-bound, so the count hardly matters
    checks = []
    for r in res["rows"]:
        if not r.get("split") or r["delay_ms"] == 0:
            continue
        d = r["delay_ms"]
        op = "all_reduce" if r["split"].startswith("tp") else "send_recv"
        f0, f1 = fits[f"{op}@0ms"], fits[f"{op}@{d:g}ms"]
        extra_alpha = (f1["alpha_us"] - f0["alpha_us"]) * 1e-6
        predicted = step_cost(QWEN_05B, batch, extra_alpha, float("inf"), r["split"][:2]) * 1e3
        checks.append({"split": r["split"], "delay_ms": d, "predicted_added_itl_ms": predicted,
                       "measured_added_p50_itl_ms": r["p50_itl_ms"] - base_itl[r["split"]]})
    projections = []
    for name, (a_us, b_gbps) in LINKS.items():
        for split in ("tp", "pp"):
            for phase, tokens in (("decode, 32 sequences", 32), ("prefill, 8K tokens", 8192)):
                ranks = 8 if name.startswith("NVLink") and split == "tp" else 2
                cost = step_cost(LLAMA_70B, tokens, a_us * 1e-6, b_gbps * 1e9, split, ranks)
                projections.append({"link": name, "split": f"{split}{ranks}", "phase": phase, "ms_per_step": cost * 1e3})
    res.update(fit=fits, model_check=checks, projections=projections)
    for k, v in fits.items():
        print(k, v)
    for c in checks + projections:
        print(c)
    write_json(res, str(RESULTS / "parallel_link.json"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=("comm", "serving", "link", "probe", "fit"))
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--num-prompts", type=int, default=24)
    ap.add_argument("--request-rate", type=float, default=0.5)
    ap.add_argument("--delays", type=float, nargs="+", default=[0.0, 1.0, 5.0], help="one-way link delay, ms")
    ap.add_argument("--rate-gbit", type=float, default=10.0)
    ap.add_argument("--splits", nargs="+", default=["pp2", "tp2"], choices=tuple(SPLITS)[1:])
    args = ap.parse_args()
    {"comm": cmd_comm, "serving": cmd_serving, "link": cmd_link, "probe": cmd_probe, "fit": cmd_fit}[args.mode](args)


if __name__ == "__main__":
    main()
