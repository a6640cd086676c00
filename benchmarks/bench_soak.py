"""Memory soak: a long mixed workload against `tokenmill serve`, sampling the RSS of the API process and of
the engine core. The goal is flat memory: growth over the second half within 2 %.

The mix walks every path that keeps per-request state: completions and chat, streamed or not, n = 1-3,
seeded and unseeded sampling, logprobs and echo, stop strings, prompts given as text or token ids (many of
them distinct, so the prefix cache churns), clients that leave mid-stream or mid-request, and requests the
server refuses (400).

    python benchmarks/bench_soak.py [--requests 10000] [--concurrency 8] [--out benchmarks/results/soak.json]

Writes JSON: the RSS samples, and per process the RSS at the middle and at the end and the growth between."""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
from datetime import datetime, timezone
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from served import ROOT, Served  # noqa: E402

WORDS = ("to be or not that is the question whether tis nobler in mind suffer slings and arrows of outrageous "
         "fortune take arms against a sea troubles by opposing end them die sleep no more heart ache thousand "
         "natural shocks flesh heir consummation devoutly wished romeo juliet king crown night day").split()


def make_body(rng: random.Random, i: int) -> tuple[str, dict, str]:
    """(path, body, how the client reads it: 'read' | 'leave' (mid-stream or mid-request) | 'bad')."""
    words = [rng.choice(WORDS) for _ in range(rng.randint(3, 120))]
    words.append(str(i))  # distinct prompts: the prefix cache keeps registering new blocks
    common = {"model": "bench", "max_tokens": rng.randint(1, 24), "n": rng.choice((1, 1, 1, 2, 3)),
              "stream": rng.random() < 0.5, "temperature": rng.choice((0.0, 0.8, 1.0))}
    if rng.random() < 0.3:
        common["seed"] = rng.randint(0, 2**31)
    if rng.random() < 0.2:
        common["stop"] = [rng.choice(WORDS)]
    if rng.random() < 0.1:
        common["ignore_eos"] = True
    kind = "leave" if rng.random() < 0.05 else "bad" if rng.random() < 0.03 else "read"
    if kind == "bad":
        common["temperature"] = 9.0
    if rng.random() < 0.3:
        body = {**common, "messages": [{"role": "user", "content": " ".join(words)}]}
        if rng.random() < 0.3:
            body.update(logprobs=True, top_logprobs=rng.randint(0, 3))
        if body["stream"]:
            body["stream_options"] = {"include_usage": rng.random() < 0.5}
        return "/v1/chat/completions", body, kind
    prompt = " ".join(words)
    if rng.random() < 0.2:
        prompt = [rng.randint(3, 4000) for _ in range(rng.randint(1, 100))]
    elif rng.random() < 0.1:
        prompt = [prompt, " ".join(words[:5])]
    body = {**common, "prompt": prompt}
    if rng.random() < 0.3:
        body["logprobs"] = rng.randint(0, 3)
    if rng.random() < 0.2:
        body["echo"] = True
    return "/v1/completions", body, kind


async def one(client: httpx.AsyncClient, path: str, body: dict, kind: str) -> int:
    if kind == "leave":
        if body["stream"]:
            async with client.stream("POST", path, json=body) as r:
                async for _ in r.aiter_lines():
                    break  # the first event, then hang up
            return r.status_code
        try:
            await client.post(path, json={**body, "max_tokens": 200, "ignore_eos": True}, timeout=0.05)
        except httpx.TimeoutException:
            pass
        return 499
    if body["stream"]:
        async with client.stream("POST", path, json=body) as r:
            async for _ in r.aiter_lines():
                pass
            return r.status_code
    return (await client.post(path, json=body)).status_code


async def soak(server: Served, n: int, concurrency: int, sample_every: int, seed: int) -> tuple[list, dict]:
    rng = random.Random(seed)
    bodies = [make_body(rng, i) for i in range(n)]
    samples, statuses, done = [], {}, 0
    samples.append({"requests": 0, **server.rss()})
    queue = iter(bodies)

    async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
        async def worker() -> None:
            nonlocal done
            for path, body, kind in queue:
                code = await one(client, path, body, kind)
                statuses[code] = statuses.get(code, 0) + 1
                done += 1
                if done % sample_every == 0:
                    samples.append({"requests": done, **server.rss()})
                    last = samples[-1]
                    print(f"{done:6d} requests  api {last['api_mib']:7.1f} MiB  core {last['core_mib']:7.1f} MiB",
                          flush=True)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return samples, statuses


def growth(samples: list, key: str) -> dict:
    """RSS at the middle of the run and at its end (medians of the nearest three samples), and the change."""
    half = len(samples) // 2
    mid = statistics.median(s[key] for s in samples[max(0, half - 1):half + 2])
    end = statistics.median(s[key] for s in samples[-3:])
    return {"mid_mib": round(mid, 1), "end_mib": round(end, 1), "growth_pct": round(100 * (end - mid) / mid, 2)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--sample-every", type=int, default=250, help="requests between RSS samples")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "soak.json"))
    ap.add_argument("serve_args", nargs="*", help="extra `tokenmill serve` flags (after --)")
    args = ap.parse_args()

    with Served(*args.serve_args) as server:
        samples, statuses = asyncio.run(soak(server, args.requests, args.concurrency, args.sample_every, args.seed))
        samples.append({"requests": args.requests, **server.rss()})
        # what the soak left behind: nothing unfinished, nothing pending
        stats = httpx.get(server.url + "/debug/engine_stats", timeout=30).json()
    result = {"benchmark": "soak", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "command": " ".join([Path(sys.executable).name] + sys.argv), "requests": args.requests,
              "concurrency": args.concurrency, "statuses": {str(k): v for k, v in sorted(statuses.items())},
              "api": growth(samples, "api_mib"), "core": growth(samples, "core_mib"),
              "left_behind": {k: stats[k] for k in ("num_unfinished_requests", "num_pending_sequences", "num_running",
                                                    "num_waiting")}, "samples": samples,
              "goal": "growth over the second half within 2 % for both processes"}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"API {result['api']}  core {result['core']}  statuses {result['statuses']} -> {args.out}")


if __name__ == "__main__":
    main()
