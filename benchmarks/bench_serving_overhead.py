"""Serving overhead at saturation: `tokenmill serve` vs the offline engine (tokenmill.LLM) on one workload.

All requests arrive at once (saturation), greedy, fixed prompt and output lengths (ignore_eos), so both
paths run the same engine steps; the difference is the HTTP + IPC + detokenization cost. Offline and
served runs alternate (the machine's speed drifts), and the ratio per pair is reported.

    python benchmarks/bench_serving_overhead.py [--model DIR] [--num-requests 128] [--output-len 64]

Writes benchmarks/results/serving_overhead.json."""
from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import platform
import resource
import signal
import socket
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from tokenmill.config import DEFAULT_MODEL  # noqa: E402
from common import qwen_shape_with_shipped_tokenizer  # noqa: E402

try:
    from uvloop import run as _run
except ImportError:
    _run = asyncio.run


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_prompts(tok, n: int, input_len: int) -> list[list[int]]:
    base = tok.encode("To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer "
                      "the slings and arrows of outrageous fortune, or to take arms against a sea of troubles")
    # distinct prompts (no prefix-cache sharing beyond the first token) of exactly input_len tokens
    return [[(base[(i + j) % len(base)] + i) % 256 + 3 for j in range(input_len)] for i in range(n)]


def run_offline(llm, prompts, output_len: int) -> dict:
    from tokenmill import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    dt = time.perf_counter() - t
    toks = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"seconds": dt, "output_tokens": toks, "output_tok_per_s": toks / dt}


class _RawResponse(asyncio.Protocol):
    """One request over its own connection (`Connection: close`); the body is only collected while it
    arrives and parsed once at the end, so the load generator spends as little as possible of the CPUs
    it shares with the server under test (aiohttp parsed every SSE event: ~25 us of CPU per chunk)."""

    def __init__(self, request: bytes):
        self.request, self.parts = request, []
        self.done = asyncio.get_running_loop().create_future()

    def connection_made(self, transport) -> None:
        transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        self.parts.append(data)

    def connection_lost(self, exc) -> None:
        if self.done.done():
            return
        if exc is not None:
            self.done.set_exception(exc)
        else:
            self.done.set_result(b"".join(self.parts))


def completion_tokens(raw: bytes, stream: bool) -> int:
    """usage.completion_tokens from a whole HTTP/1.1 response (for a stream: its usage event)."""
    head, _, body = raw.partition(b"\r\n\r\n")
    status = head.split(b" ", 2)[1] if head else b"?"
    if status != b"200":
        raise RuntimeError(f"server answered {status.decode()}: {body[:200]!r}")
    if not stream:
        if b"transfer-encoding: chunked" in head.lower():
            raise RuntimeError("unexpected chunked non-streaming response")
        return json.loads(body)["usage"]["completion_tokens"]
    err = body.find(b'data: {"error"')
    if err >= 0:
        raise RuntimeError(f"the stream reported an error: {body[err:err + 300]!r}")
    i = body.rfind(b'data: {"id"')  # the usage event is the last JSON event, before [DONE]
    if i < 0 or b"data: [DONE]" not in body:
        raise RuntimeError(f"incomplete stream: {body[-200:]!r}")
    usage = json.loads(body[i + 6:body.index(b"\n\n", i)]).get("usage")
    if not usage:
        raise RuntimeError(f"the stream has no usage event: {body[-300:]!r}")
    return usage["completion_tokens"]


async def _serve_once(host: str, port: int, prompts, output_len: int, stream: bool) -> dict:
    loop = asyncio.get_running_loop()

    async def one(p):
        body = {"model": "bench", "prompt": p, "max_tokens": output_len, "temperature": 0, "ignore_eos": True,
                "stream": stream}
        if stream:
            body["stream_options"] = {"include_usage": True}
        data = json.dumps(body).encode()
        req = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n").encode() + data
        _, proto = await loop.create_connection(lambda: _RawResponse(req), host, port)
        return completion_tokens(await proto.done, stream)

    t = time.perf_counter()
    counts = await asyncio.gather(*(one(p) for p in prompts))
    dt = time.perf_counter() - t
    toks = sum(counts)
    return {"seconds": dt, "output_tokens": toks, "output_tok_per_s": toks / dt}


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of one process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pin_process(pid: int, cpus: set[int]) -> None:
    """Every thread of `pid` (and the threads it starts later) onto `cpus`."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        os.sched_setaffinity(int(tid), cpus)


def run_client(port: int, server_pid: int, prompts, output_len: int, stream: bool) -> dict:
    """One saturation run, with the CPU time of the client (it shares the machine with the server), of the
    API server process and of the engine core process."""
    core_pid = int(Path(f"/proc/{server_pid}/task/{server_pid}/children").read_text().split()[0])
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    a0, c0 = process_cpu_s(server_pid), process_cpu_s(core_pid)
    out = _run(_serve_once("127.0.0.1", port, prompts, output_len, stream))
    a1, c1 = process_cpu_s(server_pid), process_cpu_s(core_pid)
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    out["client_cpu_s"] = (r1.ru_utime + r1.ru_stime) - (r0.ru_utime + r0.ru_stime)
    out["api_cpu_s"], out["core_cpu_s"] = a1 - a0, c1 - c0
    out["api_cpu_us_per_token"] = 1e6 * (a1 - a0) / out["output_tokens"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--qwen-shape", action="store_true",
                    help="Qwen2.5-0.5B layers with dummy weights and the shipped tokenizer, instead of --model")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--num-requests", type=int, default=128)
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--stream-interval", type=int, default=1, help="passed to `tokenmill serve`")
    ap.add_argument("--engine-cpu", type=int, default=None,
                    help="give the engine a core of its own, as a GPU server's engine has: the offline engine and "
                         "the served engine core each run one thread pinned to this CPU; the API process and the "
                         "load generator run on the other CPUs")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "serving_overhead.json"))
    args = ap.parse_args()
    engine_cpus = None if args.engine_cpu is None else {args.engine_cpu}
    other_cpus = None if engine_cpus is None else (os.sched_getaffinity(0) - engine_cpus)
    if other_cpus is not None and not other_cpus:
        ap.error("--engine-cpu needs a machine with at least two CPUs")

    from tokenmill import LLM

    load_format = "auto"
    if args.qwen_shape:
        args.model, load_format = qwen_shape_with_shipped_tokenizer(), "dummy"
    eng = dict(dtype=args.dtype, max_model_len=args.input_len + args.output_len + 16, max_num_seqs=args.max_num_seqs,
               seed=0, load_format=load_format)
    if engine_cpus:
        os.sched_setaffinity(0, engine_cpus)
    llm = LLM(model=args.model, num_threads=1 if engine_cpus else None, **eng)
    gc.collect()  # as `tokenmill serve` does in both its processes: full collections skip the startup heap
    gc.freeze()
    prompts = make_prompts(llm.get_tokenizer(), args.num_requests, args.input_len)

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "tokenmill", "serve", "--model", args.model, "--port", str(port),
           "--served-model-name", "bench", "--dtype", args.dtype, "--load-format", load_format,
           "--max-model-len", str(eng["max_model_len"]),
           "--max-num-seqs", str(args.max_num_seqs), "--disable-log-requests", "--disable-uvicorn-access-log",
           "--uvicorn-log-level", "warning", "--stream-interval", str(args.stream_interval)]
    env = dict(os.environ, OMP_NUM_THREADS="1") if engine_cpus else None
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, env=env)
    try:
        for _ in range(600):
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        if engine_cpus:
            pin_process(server.pid, other_cpus)
            pin_process(int(Path(f"/proc/{server.pid}/task/{server.pid}/children").read_text().split()[0]),
                        engine_cpus)

        def offline(n, length):
            if engine_cpus:
                os.sched_setaffinity(0, engine_cpus)
            return run_offline(llm, prompts[:n], length)

        def served(n, length, stream):
            if engine_cpus:
                os.sched_setaffinity(0, other_cpus)  # the load generator stays off the engine's core
            return run_client(port, server.pid, prompts[:n], length, stream)

        # warm-up both paths
        offline(8, 8)
        served(8, 8, True)
        rows = []
        for r in range(args.repeats):
            off = offline(len(prompts), args.output_len)
            st = served(len(prompts), args.output_len, True)
            ns = served(len(prompts), args.output_len, False)
            rows.append({"offline": off, "serve_stream": st, "serve_nonstream": ns,
                         "ratio_stream": st["output_tok_per_s"] / off["output_tok_per_s"],
                         "ratio_nonstream": ns["output_tok_per_s"] / off["output_tok_per_s"]})
            print(f"repeat {r}: offline {off['output_tok_per_s']:.0f} tok/s | serve (stream) "
                  f"{st['output_tok_per_s']:.0f} tok/s ({rows[-1]['ratio_stream']:.3f}x) | serve (non-stream) "
                  f"{ns['output_tok_per_s']:.0f} tok/s ({rows[-1]['ratio_nonstream']:.3f}x) | API CPU us/token stream "
                  f"{st['api_cpu_us_per_token']:.1f}, non-stream {ns['api_cpu_us_per_token']:.1f} | client CPU s "
                  f"{st['client_cpu_s']:.2f} / {ns['client_cpu_s']:.2f}", flush=True)
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(60)

    med_s = statistics.median(r["ratio_stream"] for r in rows)
    med_n = statistics.median(r["ratio_nonstream"] for r in rows)
    result = {
        "benchmark": "serving_overhead", "qwen_shape": args.qwen_shape, "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                    "cpus": os.cpu_count(), "python": platform.python_version()},
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "workload": {"model": args.model, "dtype": args.dtype, "num_requests": args.num_requests,
                     "input_len": args.input_len, "output_len": args.output_len, "max_num_seqs": args.max_num_seqs,
                     "stream_interval": args.stream_interval,
                     "engine_cpu": args.engine_cpu,
                     "arrival": "all at once (saturation)", "sampling": "greedy, ignore_eos"},
        "runs": rows,
        "median_ratio_stream": med_s, "median_ratio_nonstream": med_n,
        "overhead_stream_pct": 100 * (1 - med_s), "overhead_nonstream_pct": 100 * (1 - med_n),
        "note": ("the load generator shares the machine's CPUs with the server and the engine core"
                 if args.engine_cpu is None else
                 f"engine (offline, and the served engine core) on CPU {args.engine_cpu} with one thread; "
                 f"API process and load generator on CPUs {sorted(other_cpus)}"),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"serving overhead (median of {len(rows)}): streaming {result['overhead_stream_pct']:.1f} %, "
          f"non-streaming {result['overhead_nonstream_pct']:.1f} % -> {args.out}")


if __name__ == "__main__":
    main()
