"""Tiered KV cache: TTFT of an 8K-token shared document when its KV comes from each tier, against
recomputing it, plus a mixed workload with tiers on and off.

Qwen2.5-0.5B shape with dummy weights (TTFT does not depend on the weights), bf16. The KV pool holds one
8K sequence, so a second document evicts the first between rounds. Each scenario is a fresh process:

    no tiers         D0+q1 (cold), D1+q1 (cold), D1+q2 (a pool hit: the floor for any tier hit)
    host+disk+redis  D0+q1 (cold), D1+q1 (cold, evicts D0 into every tier), D0+q2 (host hit)
    disk, restart    a new process on the same directory: D0+q3 (disk hit), then, page cache dropped where
                     the machine allows it, D1+q3 (disk hit, cold page cache)
    disk only        a fresh directory: D0+q1, D1+q1, D0+q2 (disk hit in the same process)
    redis only       a new process on the same server: D0+q4 (Redis hit)

    python benchmarks/bench_kv_tiers.py [--doc-len 8192] [--out benchmarks/results/kv_tiers.json]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import QWEN25_05B, dummy_model_dir, machine, run_job, serve_job, write_json  # noqa: E402


def _tokens(n: int, seed: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(100, 150000) for _ in range(n)]


# -- one scenario, in its own process ------------------------------------------------------------------------
def _worker(job: dict) -> dict:
    import tokenmill  # noqa: F401  (before torch: OpenMP settings)
    from tokenmill import SamplingParams
    from tokenmill.config import EngineConfig
    from tokenmill.engine.llm_engine import LLMEngine

    if job.get("drop_page_cache_before"):
        job["page_cache_dropped"] = _drop_page_cache()
    engine = LLMEngine(EngineConfig(**job["engine"]))
    sp = SamplingParams(temperature=0, max_tokens=job["output_len"], ignore_eos=True)
    out = []
    for i, (name, prompt) in enumerate(job["prompts"]):
        if name == "drop-page-cache":
            job["page_cache_dropped"] = _drop_page_cache()
            continue
        before = engine.get_stats()
        t0 = time.perf_counter()
        rid = engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, sp)
        ttft, tokens = None, []
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.request_id == rid and o.outputs[0].token_ids and ttft is None:
                    ttft = time.perf_counter() - t0
                if o.finished:
                    tokens = o.outputs[0].token_ids
        after = engine.get_stats()
        hits = {t: after.kv_tiers[t]["hit_tokens"] - before.kv_tiers[t]["hit_tokens"] for t in after.kv_tiers}
        out.append({"name": name, "ttft_s": ttft, "prompt_tokens": len(prompt), "tokens": tokens,
                    "pool_hit_tokens": after.prefix_cache_hits - before.prefix_cache_hits, "tier_hit_tokens": hits})
        print(f"  {name:<28} TTFT {ttft * 1000:9.1f} ms  pool hit {out[-1]['pool_hit_tokens']:5d}  tiers {hits}",
              flush=True)
    stats = engine.get_stats()
    engine.core.close()  # flushes the pool's cached blocks to the lower tiers
    return {"requests": out, "tiers": stats.kv_tiers, "page_cache_dropped": job.get("page_cache_dropped")}


def _drop_page_cache() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def _run(name: str, job: dict) -> dict:
    print(f"[kv tiers] {name}", flush=True)
    res = run_job(__file__, job)
    res["scenario"] = name
    return res


# -- the mixed workload ----------------------------------------------------------------------------------------
def _mixed(model: str, base: dict, tiers: dict, num_kv_blocks: int, args) -> dict:
    """Requests that share one of a few long prefixes, all at once (token-id prompts: the dummy model has
    no tokenizer)."""
    import random

    from tokenmill.bench.datasets import SampleRequest
    from tokenmill.bench.offline import run_offline

    prefixes = [_tokens(args.mixed_prefix_len, 100 + i) for i in range(args.mixed_prefixes)]
    order = list(range(args.mixed_prompts))
    random.Random(0).shuffle(order)
    reqs = [SampleRequest({"prompt_token_ids": prefixes[i % len(prefixes)] + _tokens(32, 1000 + i)},
                          args.mixed_prefix_len + 32, args.mixed_output_len) for i in order]
    kw = dict(base, num_kv_blocks=num_kv_blocks, max_model_len=2048, **tiers)
    res = run_offline(reqs, kw, request_rate=float("inf"), seed=0, ignore_eos=True, disable_tqdm=True)
    keep = ("output_throughput", "total_token_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms",
            "p99_tpot_ms", "median_itl_ms", "duration", "kv_cache")
    return {k: res.get(k) for k in keep}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", help="(internal) run one scenario from this job file")
    ap.add_argument("--doc-len", type=int, default=8192)
    ap.add_argument("--question-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--redis-port", type=int, default=0, help="0: start a redis-server here on a free port")
    ap.add_argument("--mixed-prompts", type=int, default=24)
    ap.add_argument("--mixed-prefix-len", type=int, default=768)
    ap.add_argument("--mixed-prefixes", type=int, default=6)
    ap.add_argument("--mixed-output-len", type=int, default=32)
    ap.add_argument("--mixed-repeats", type=int, default=1, help="A/B pairs per pool size, alternating off/on")
    ap.add_argument("--skip-mixed", action="store_true")
    ap.add_argument("--only-mixed", action="store_true", help="skip the TTFT scenarios")
    ap.add_argument("--out", default="benchmarks/results/kv_tiers.json")
    args = ap.parse_args()
    if args.worker:
        serve_job(args.worker, _worker)
        return

    model = dummy_model_dir(QWEN25_05B)
    bs, out_len = 16, args.output_len
    max_len = args.doc_len + args.question_len + out_len + bs
    base = dict(model=model, load_format="dummy", dtype="bfloat16", max_model_len=max_len,
                num_kv_blocks=-(-max_len // bs))  # the pool holds one document: the next one evicts it
    d0, d1 = _tokens(args.doc_len, 1), _tokens(args.doc_len, 2)
    q = [_tokens(args.question_len, 10 + i) for i in range(5)]
    work = tempfile.mkdtemp(prefix="tokenmill-kv-bench-")
    disk_x, disk_y = os.path.join(work, "x"), os.path.join(work, "y")
    redis_proc, port = None, args.redis_port
    results, mixed = {}, {}
    try:
        if not args.only_mixed:
            if not port:
                redis_proc, port = _start_redis()
            results = _scenarios(base, out_len, d0, d1, q, disk_x, disk_y, f"redis://127.0.0.1:{port}/0")
            host = results["host"]["tiers"]["host"]
            block_bytes = host["bytes_stored"] / max(1, host["blocks_stored"])
            disk_files = [os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(disk_x) for f in fs]
        if not args.skip_mixed:
            mixed = _mixed_ab(model, args)
    finally:
        if redis_proc is not None:
            redis_proc.kill()
        shutil.rmtree(work, ignore_errors=True)
    summary = _summary(results, mixed, block_bytes, disk_files, bs) if results else _summary_mixed(mixed)
    print(json.dumps(summary, indent=2))
    write_json({"machine": machine(), "args": vars(args), "summary": summary, "scenarios": results, "mixed": mixed},
               args.out)


def _scenarios(base, out_len, d0, d1, q, disk_x, disk_y, url) -> dict:
    job = lambda engine, prompts: dict(engine={**base, **engine}, prompts=prompts, output_len=out_len)  # noqa: E731
    cold = [("cold D0+q1", d0 + q[1]), ("cold D1+q1", d1 + q[1])]
    results = {"no_tiers": _run("no tiers", job({}, cold + [("pool hit D1+q2", d1 + q[2])]))}
    results["host"] = _run("host+disk+redis", job(
        dict(kv_host_cache_gb=1.0, kv_disk_cache_dir=disk_x, kv_remote_cache_url=url),
        cold + [("host hit D0+q2", d0 + q[2])]))
    results["restart"] = _run("disk after restart", job(
        dict(kv_disk_cache_dir=disk_x),
        [("disk hit (restart) D0+q3", d0 + q[3]), ("drop-page-cache", []),
         ("disk hit (restart, cold page cache) D1+q3", d1 + q[3])]))
    results["disk"] = _run("disk only", job(dict(kv_disk_cache_dir=disk_y), cold + [("disk hit D0+q2", d0 + q[2])]))
    results["redis"] = _run("redis only", job(dict(kv_remote_cache_url=url), [("redis hit D0+q4", d0 + q[4])]))
    return results


def _mixed_ab(model: str, args) -> dict:
    """Tiers off and on, alternating, for a pool that holds every prefix and one that holds three."""
    bs, mb = 16, dict(model=model, load_format="dummy", dtype="bfloat16")
    per_prefix = -(-(args.mixed_prefix_len + 32 + args.mixed_output_len) // bs)
    mixed: dict[str, list] = {}
    for pool_name, blocks in (("large pool", per_prefix * (args.mixed_prefixes + 4) * 2),
                              ("small pool", max(per_prefix * 3, -(-2048 // bs)))):
        for _ in range(args.mixed_repeats):
            for tier_name, tiers in (("off", {}), ("host", dict(kv_host_cache_gb=1.0))):
                print(f"[kv tiers] mixed workload, {pool_name}, tiers {tier_name}", flush=True)
                mixed.setdefault(f"{pool_name}, tiers {tier_name}", []).append(_mixed(model, mb, tiers, blocks, args))
    return mixed


def _summary_mixed(mixed: dict) -> dict:
    out = {}
    for pool in ("large pool", "small pool"):
        if f"{pool}, tiers off" not in mixed:
            continue
        off, on = mixed[f"{pool}, tiers off"], mixed[f"{pool}, tiers host"]
        for key, label in (("output_throughput", "output tok/s"), ("median_tpot_ms", "median TPOT"),
                           ("p99_tpot_ms", "P99 TPOT"), ("p99_ttft_ms", "P99 TTFT")):
            ratios = [b[key] / a[key] for a, b in zip(off, on)]
            out[f"mixed {pool}: {label} on/off"] = sum(ratios) / len(ratios)
            out[f"mixed {pool}: {label} on/off, per pair"] = ratios
    return out


def _summary(results, mixed, block_bytes, disk_files, bs) -> dict:
    def ttft(scenario, name):
        return next(r["ttft_s"] for r in results[scenario]["requests"] if r["name"].startswith(name))

    cold_s = min(ttft("no_tiers", "cold D0"), ttft("no_tiers", "cold D1"))
    hits = {"pool hit": ttft("no_tiers", "pool hit"), "host hit": ttft("host", "host hit"), "disk hit": ttft("disk", "disk hit"),
            "disk hit after restart": ttft("restart", "disk hit (restart) D0"),
            "disk hit after restart, cold page cache": ttft("restart", "disk hit (restart, cold"),
            "redis hit": ttft("redis", "redis hit")}
    summary = {"cold_ttft_s": cold_s, **{f"{k} ttft_s": v for k, v in hits.items()},
               **{f"{k} / cold": v / cold_s for k, v in hits.items()},
               "bytes_per_token_in_ram": block_bytes / bs,
               "bytes_per_token_on_disk": (sum(disk_files) / len(disk_files) / bs) if disk_files else None,
               "page_cache_dropped": results["restart"].get("page_cache_dropped")}
    same = {r["name"]: r["tokens"] for s in results.values() for r in s["requests"]}
    # the same prompt through different tiers (and D1 with tiers on and off) gives the same greedy tokens
    summary["greedy_tokens_identical"] = (same["host hit D0+q2"] == same["disk hit D0+q2"] and
                                          results["no_tiers"]["requests"][1]["tokens"] ==
                                          results["host"]["requests"][1]["tokens"])
    summary.update(_summary_mixed(mixed))
    return summary


def _start_redis():
    import socket

    exe = shutil.which("redis-server")
    if exe is None:
        raise SystemExit("redis-server is not installed (apt-get install -y redis-server), or pass --redis-port")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--maxmemory", "2gb", "--maxmemory-policy", "allkeys-lru"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(0.5)
    return proc, port


if __name__ == "__main__":
    main()
