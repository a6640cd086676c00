"""The floor under tokenmill's streaming cost: CPU per streamed chunk of a bare ASGI app on the same stack
(uvicorn + uvloop + httptools), with no engine, no FastAPI, no detokenization. Each of N concurrent
requests waits on an asyncio.Event that a ticker sets every `--step-ms` (an "engine step"), then sends
one OpenAI-shaped SSE chunk, `--chunks` times. The same raw-socket client as bench_serving_overhead.py
reads the streams. Compare the result with that script's `api_cpu_us_per_token` (streaming).

    python benchmarks/bench_asgi_floor.py [--requests 128] [--chunks 64]

Writes benchmarks/results/asgi_floor.json."""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))


def serve(port: int, chunks: int, step_s: float) -> None:
    """The bare server (run in a subprocess)."""
    import msgspec
    import uvicorn
    import uvloop

    waiting: list[asyncio.Event] = []

    async def ticker():
        while True:
            await asyncio.sleep(step_s)
            for ev in list(waiting):
                ev.set()

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        if scope["path"] == "/cpu":
            r = resource.getrusage(resource.RUSAGE_SELF)
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": f"{r.ru_utime + r.ru_stime}".encode()})
            return
        await receive()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        ev = asyncio.Event()
        waiting.append(ev)
        for _ in range(chunks):
            await ev.wait()
            ev.clear()
            body = {"id": "cmpl-0123456789abcdef", "object": "text_completion", "created": 0, "model": "bench",
                    "choices": [{"index": 0, "text": " tok", "logprobs": None, "finish_reason": None}]}
            await send({"type": "http.response.body", "body": b"data: " + msgspec.json.encode(body) + b"\n\n",
                        "more_body": True})
        waiting.remove(ev)
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})

    async def main():
        asyncio.get_running_loop().create_task(ticker())
        cfg = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", access_log=False, lifespan="off")
        await uvicorn.Server(cfg).serve()

    uvloop.run(main())


async def _drive(port: int, n: int) -> None:
    from bench_serving_overhead import _RawResponse

    loop = asyncio.get_running_loop()
    req = b"POST /stream HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}"

    async def one():
        _, proto = await loop.create_connection(lambda: _RawResponse(req), "127.0.0.1", port)
        body = await proto.done
        assert body.startswith(b"HTTP/1.1 200") and b"data: [DONE]" in body, body[:200]

    await asyncio.gather(*(one() for _ in range(n)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--chunks", type=int, default=64)
    ap.add_argument("--step-ms", type=float, default=30.0, help="how often the fake engine wakes every stream")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "asgi_floor.json"))
    ap.add_argument("--serve-port", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_port:
        return serve(args.serve_port, args.chunks, args.step_ms / 1e3)

    import httpx
    from bench_serving_overhead import free_port
    from common import machine

    port = free_port()
    server = subprocess.Popen([sys.executable, __file__, "--serve-port", str(port), "--chunks", str(args.chunks),
                               "--step-ms", str(args.step_ms)])
    url = f"http://127.0.0.1:{port}/cpu"
    try:
        for _ in range(100):
            try:
                httpx.get(url)
                break
            except httpx.HTTPError:
                time.sleep(0.1)
        runs = []
        for _ in range(args.repeats):
            c0 = float(httpx.get(url).text)
            asyncio.run(_drive(port, args.requests))
            cpu = float(httpx.get(url).text) - c0
            runs.append(1e6 * cpu / (args.requests * args.chunks))
            print(f"server CPU per streamed chunk: {runs[-1]:.1f} us", flush=True)
    finally:
        server.terminate()
        server.wait(10)
    runs.sort()
    result = {"benchmark": "asgi_floor", "machine": machine(), "command": " ".join(sys.argv),
              "requests": args.requests, "chunks_per_request": args.chunks, "step_ms": args.step_ms,
              "server_cpu_us_per_chunk": runs, "median_us_per_chunk": runs[len(runs) // 2],
              "note": "bare ASGI app on uvicorn + uvloop + httptools: the cost of HTTP streaming alone"}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"median {result['median_us_per_chunk']:.1f} us of server CPU per chunk -> {args.out}")


if __name__ == "__main__":
    main()
