"""Stall probe: does a large request the server must refuse (or a heavy tokenizer job) stall everyone else?

While a stream runs and /health is polled every few milliseconds, the probe sends, one scenario at a time,
a body just under the 8 MiB limit that cannot fit the context (a completion prompt, a chat message, a
/tokenize prompt) and a /detokenize of a million ids. It records the longest gap between /health answers
and between the stream's events while each request is in flight, the same gaps just before (the baseline),
and the API process's RSS. Goal: no gap over 100 ms.

    python benchmarks/bench_stall_probe.py [--mib 7.5] [--repeats 3] [--out benchmarks/results/stall_probe.json]

The gaps are timing figures: run it on a quiet machine."""
from __future__ import annotations

import argparse
import asyncio
import json
import socket
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from served import ROOT, Served  # noqa: E402


def scenarios(mib: float) -> dict[str, tuple[str, bytes]]:
    text = "To be, or not to be, that is the question. " * int(mib * 2**20 / 44)
    return {
        "completion_prompt": ("/v1/completions", json.dumps({"model": "bench", "prompt": text}).encode()),
        "chat_message": ("/v1/chat/completions", json.dumps(
            {"model": "bench", "messages": [{"role": "user", "content": text}]}).encode()),
        "tokenize_prompt": ("/tokenize", json.dumps({"prompt": text}).encode()),
        "detokenize_1m_ids": ("/detokenize", json.dumps({"tokens": [10] * 1_000_000}).encode()),
    }


def max_gap(times: list[float], start: float, end: float) -> float | None:
    """The longest interval between consecutive times that overlaps [start, end], in ms."""
    gaps = [b - a for a, b in zip(times, times[1:]) if b >= start and a <= end]
    return round(1e3 * max(gaps), 1) if gaps else None


async def probe_once(server: Served, path: str, body: bytes) -> dict:
    health, events, window = [], [], {}
    stop = asyncio.Event()

    async def poll_health(client: httpx.AsyncClient) -> None:
        while not stop.is_set():
            await client.get("/health")
            health.append(time.perf_counter())
            await asyncio.sleep(0.005)

    async def stream(client: httpx.AsyncClient) -> None:
        req = {"model": "bench", "prompt": "ROMEO:", "max_tokens": 480, "ignore_eos": True, "stream": True}
        async with client.stream("POST", "/v1/completions", json=req) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    events.append(time.perf_counter())
                if stop.is_set():
                    break

    def big_request() -> None:
        # its own thread, on a raw socket whose sendall/recv release the GIL: sending 8 MiB through an HTTP
        # client's Python code would stall the probe's own loop and show up as the server's gap
        head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
        window["start"] = time.perf_counter()
        with socket.create_connection(("127.0.0.1", server.port), timeout=300) as sock:
            sock.sendall(head + body)
            answer = b""
            while chunk := sock.recv(1 << 20):
                answer += chunk
        window["end"], window["status"] = time.perf_counter(), int(answer.split(b" ", 2)[1])

    async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
        tasks = [asyncio.ensure_future(poll_health(client)), asyncio.ensure_future(stream(client))]
        while len(events) < 5:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.5)  # baseline
        rss_before = server.rss()["api_mib"]
        sender = threading.Thread(target=big_request)
        sender.start()
        while sender.is_alive():
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
    start, end = window["start"], window["end"]
    return {"status": window["status"], "request_s": round(end - start, 3),
            "health_max_gap_ms": max_gap(health, start, end), "stream_max_gap_ms": max_gap(events, start, end),
            "baseline_health_max_gap_ms": max_gap(health, start - 0.5, start),
            "baseline_stream_max_gap_ms": max_gap(events, start - 0.5, start),
            "stream_ran_through": bool(events) and events[-1] >= end,
            "api_rss_before_mib": round(rss_before, 1), "api_rss_after_mib": round(server.rss()["api_mib"], 1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=float, default=7.5, help="size of the refused text (the body limit is 8 MiB)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--only", nargs="*", help="scenario names to run (default: all)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "stall_probe.json"))
    args = ap.parse_args()
    runs = {}
    with Served() as server:
        for name, (path, body) in scenarios(args.mib).items():
            if args.only and name not in args.only:
                continue
            runs[name] = [asyncio.run(probe_once(server, path, body)) for _ in range(args.repeats)]
            worst = max((r["health_max_gap_ms"] or 0, r["stream_max_gap_ms"] or 0) for r in runs[name])
            print(f"{name:20s} status {[r['status'] for r in runs[name]]}  worst gap (health, stream) ms {worst}",
                  flush=True)
    worst = max(max(r["health_max_gap_ms"] or 0, r["stream_max_gap_ms"] or 0) for rs in runs.values() for r in rs)
    result = {"benchmark": "stall_probe", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "command": " ".join([Path(sys.executable).name] + sys.argv), "mib": args.mib, "runs": runs,
              "worst_gap_ms": worst, "goal": "no /health or stream gap over 100 ms while a big request is handled",
              "meets_goal": worst <= 100}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"worst gap {worst} ms -> {args.out}")


if __name__ == "__main__":
    main()
