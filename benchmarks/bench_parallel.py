"""What splitting a model costs: gloo's collectives, serving latency with TP=2 / PP=2 against one process,
and the same across a simulated link between two nodes (delay_line.py), plus the fit of an analytic model.

    python benchmarks/bench_parallel.py comm      bench comm, 2 ranks on this machine (loopback)
    python benchmarks/bench_parallel.py serving   single, TP=2, PP=2 at one Poisson load, in one run
    python benchmarks/bench_parallel.py link      TP=2 and PP=2 split over two namespaces, one-way delay
                                                  0 / 1 / 5 ms at 10 Gbit/s, with bench comm over each link
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
SPLITS = {"single": [], "tp2": ["--tensor-parallel-size", "2"], "pp2": ["--pipeline-parallel-size", "2"]}
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
    subprocess.run([PY, "-m", "tokenmill", "bench", "comm", "--world-size", "2", "--sizes", "8B..64MiB",
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


def cmd_link(args) -> None:
    load = dict(input_len=args.input_len, output_len=args.output_len, num_prompts=args.num_prompts,
                request_rate=args.request_rate)
    rows, comm = [], []
    line = [PY, str(ROOT / "benchmarks" / "delay_line.py")]
    for delay in args.delays:
        link = subprocess.Popen([*line, "up", "--delay-ms", str(delay), "--rate-gbit", str(args.rate_gbit)],
                                stdout=subprocess.PIPE, text=True)
        try:
            assert link.stdout.readline().strip() == "link up"
            if not rows:  # the one-process baseline, in the same namespace and load, once
                rows.append(dict(run_serving("single", [], load, ns="tm0"), delay_ms=None))
            comm += link_comm(delay)
            for name in args.splits:
                r = run_serving(f"{name}-{delay:g}ms", SPLITS[name], load, ns="tm0", remote="tm1")
                rows.append(dict(r, split=name, delay_ms=delay))
                print(rows[-1], flush=True)
        finally:
            link.send_signal(signal.SIGTERM)
            link.wait(30)
    write_json({"machine": machine(), "load": load, "rate_gbit": args.rate_gbit, "rows": with_ratios(rows, rows[0]),
                "comm": comm}, str(RESULTS / "parallel_link.json"))


def cmd_fit(args) -> None:
    """Least squares of time = alpha + bytes / beta per op and link delay, from the link runs' bench comm."""
    import numpy as np

    res = json.loads((RESULTS / "parallel_link.json").read_text())
    fits = []
    for delay in sorted({r["delay_ms"] for r in res["comm"]}):
        for op in ("all_reduce", "send_recv"):
            pts = [(r["bytes"], r["time_us"] * 1e-6) for r in res["comm"] if r["delay_ms"] == delay and r["op"] == op]
            x, y = np.array([p[0] for p in pts], float), np.array([p[1] for p in pts])
            slope, alpha = np.polyfit(x, y, 1)
            fits.append({"delay_ms": delay, "op": op, "alpha_us": alpha * 1e6, "beta_GBps": 1 / slope / 1e9})
    res["fit"] = fits
    for f in fits:
        print(f)
    write_json(res, str(RESULTS / "parallel_link.json"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=("comm", "serving", "link", "fit"))
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--num-prompts", type=int, default=24)
    ap.add_argument("--request-rate", type=float, default=0.5)
    ap.add_argument("--delays", type=float, nargs="+", default=[0.0, 1.0, 5.0], help="one-way link delay, ms")
    ap.add_argument("--rate-gbit", type=float, default=10.0)
    ap.add_argument("--splits", nargs="+", default=["pp2", "tp2"], choices=("tp2", "pp2"))
    args = ap.parse_args()
    {"comm": cmd_comm, "serving": cmd_serving, "link": cmd_link, "fit": cmd_fit}[args.mode](args)


if __name__ == "__main__":
    main()
