"""`tokenmill bench ladder`: one workload through a sequence of engine configurations, each adding one
optimization, starting from a faithful unoptimized server inside tokenmill itself.

Each rung runs in a fresh process, so peak memory and warm caches do not leak between rungs.
The KV budget is the same for every rung: the contiguous baseline reserves max_model_len per
request in it, so it fits fewer sequences than the paged layout (that is what paging buys).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from datetime import datetime

from tokenmill.bench.report import LADDER_KIND, ladder_rung

BASELINE = dict(batching="static", kv_layout="contiguous", attention_impl="eager", cpu_linear_kernel="torch",
                enable_prefix_caching=False)

# (name, what it changes relative to the rung before, engine kwargs it sets); applied cumulatively.
RUNGS = [
    ("baseline", "static batching (a batch fills, runs to completion, then the next starts); contiguous KV "
     "preallocated to max_model_len per request; unfused eager attention; plain F.linear GEMMs", {}),
    ("+ fused attention", "fused attention: SDPA for prefill, grouped-query matmuls for decode, no repeated "
     "KV heads or per-sequence score materialization", dict(attention_impl="fused")),
    ("+ packed GEMM weights", "CPU: weights repacked once into oneDNN's blocked layout "
     "(on GPU this rung is the Triton/cuBLAS kernels)", dict(cpu_linear_kernel="auto")),
    ("+ continuous batching", "iteration-level scheduling: requests join and leave every step, chunked prefill "
     "shares steps with decodes", dict(batching="continuous")),
    ("+ paged KV + prefix caching", "paged KV blocks allocated on demand (no max_model_len reservation), shared "
     "prompt prefixes computed once", dict(kv_layout="paged", enable_prefix_caching=True)),
    ("+ int8 weights", "weight-only INT8 (W8A16, per output channel, made at load time): half the bytes of bf16 per "
     "decode step; AWQ checkpoints from `tokenmill quantize` run the same way with --model",
     dict(quantization="int8")),
    ("+ tiered KV cache", "prefix blocks evicted from the KV pool go to a host-RAM tier and load back on a hit "
     "instead of being recomputed (docs/kv_tiers.md); it pays when the shared prefixes outgrow the pool, e.g. "
     "--num-prefixes 48 --prefix-len 448", dict(kv_host_cache_gb=1.0)),
    ("+ speculative decoding", "prompt-lookup (n-gram) drafts, up to 4 per step, verified in one pass; k adapts to "
     "measured acceptance and step cost and drops to 0 where drafts do not pay (docs/speculative_decoding.md)",
     dict(speculative_config='{"method": "ngram", "num_speculative_tokens": 4}')),
]
PENDING: list[tuple[str, str]] = []


def ladder_configs(base: dict) -> list[tuple[str, str, dict]]:
    cfg = {**base, **BASELINE}
    out = []
    for name, changes, delta in RUNGS:
        cfg = {**cfg, **delta}
        out.append((name, changes, dict(cfg)))
    return out


def _run_rung(name: str, engine_kwargs: dict, workload: dict, out_path: str) -> dict:
    """Run one rung in a child process (this module's --rung-worker entry) and read its result."""
    job = {"name": name, "engine_kwargs": engine_kwargs, "workload": workload, "out": out_path}
    subprocess.run([sys.executable, "-m", "tokenmill.bench.ladder", "--rung-worker", json.dumps(job)], check=True)
    with open(out_path) as f:
        return json.load(f)


def _rung_worker(job: dict) -> None:
    from tokenmill.bench.datasets import PrefixRepetitionDataset, get_tokenizer, sample_requests
    from tokenmill.bench.offline import run_offline

    w = job["workload"]
    tok = get_tokenizer(job["engine_kwargs"]["model"])
    ds = PrefixRepetitionDataset(w["prefix_len"], w["suffix_len"], w["num_prefixes"], w["output_len"])
    reqs = sample_requests(ds, w["num_prompts"], tok, seed=w["seed"])
    res = run_offline(reqs, job["engine_kwargs"], request_rate=w["request_rate"], seed=w["seed"], ignore_eos=True,
                      disable_tqdm=True)
    res["label"] = job["name"]
    with open(job["out"], "w") as f:
        json.dump(res, f)


def run_ladder(model: str, out: str, num_prompts: int = 64, request_rate: float = 8.0, prefix_len: int = 192,
               suffix_len: int = 32, num_prefixes: int = 4, output_len: int = 64, max_model_len: int = 512,
               max_num_seqs: int = 16, kv_blocks: int | None = None, dtype: str = "float32", seed: int = 0,
               extra_engine_kwargs: dict | None = None) -> dict:
    # KV for max_num_seqs sequences at max_model_len: the contiguous baseline fits exactly that batch
    kv_blocks = kv_blocks or max_num_seqs * math.ceil(max_model_len / 16)
    base = dict(model=model, dtype=dtype, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                num_kv_blocks=kv_blocks, seed=seed, **(extra_engine_kwargs or {}))
    workload = dict(dataset="prefix-repetition", num_prompts=num_prompts, request_rate=request_rate,
                    prefix_len=prefix_len, suffix_len=suffix_len, num_prefixes=num_prefixes, output_len=output_len,
                    seed=seed)
    rungs = []
    outdir = os.path.dirname(os.path.abspath(out))
    os.makedirs(outdir, exist_ok=True)
    stem = os.path.splitext(os.path.basename(out))[0]
    for i, (name, changes, cfg) in enumerate(ladder_configs(base)):
        path = os.path.join(outdir, f"{stem}.rung{i}.json")
        print(f"[ladder] rung {i}: {name}", flush=True)
        res = _run_rung(name, cfg, workload, path)
        rung = ladder_rung(name, changes, res, config=cfg, result_file=os.path.basename(path))
        rung["failed_requests"] = res.get("failed")
        rungs.append(rung)
        print(f"[ladder]   {rung['output_throughput']:.1f} tok/s, P50/P99 TTFT {rung['p50_ttft_ms']:.0f}/"
              f"{rung['p99_ttft_ms']:.0f} ms, P50 TPOT {rung['p50_tpot_ms']:.1f} ms", flush=True)
    ladder = {"kind": LADDER_KIND, "version": 1, "model": model, "device": _device(),
              "date": datetime.now().isoformat(timespec="seconds"), "workload": workload,
              "engine": {k: v for k, v in base.items() if k != "model"}, "rungs": rungs,
              "pending": [{"name": n, "why": w} for n, w in PENDING]}
    with open(out, "w") as f:
        json.dump(ladder, f, indent=2)
    print(f"[ladder] wrote {out}")
    return ladder


def _device() -> str:
    import platform

    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def add_ladder_parser(sub) -> None:
    from tokenmill.engine.arg_utils import add_engine_args

    p = sub.add_parser("ladder", help="the optimization ladder: one workload, one optimization added per rung")
    w = p.add_argument_group("workload")
    w.add_argument("--num-prompts", type=int, default=64)
    w.add_argument("--request-rate", type=float, default=8.0, help="Poisson arrivals per second")
    w.add_argument("--prefix-len", type=int, default=192)
    w.add_argument("--suffix-len", type=int, default=32)
    w.add_argument("--num-prefixes", type=int, default=4)
    w.add_argument("--output-len", type=int, default=64)
    w.add_argument("--result-file", default="ladder.json")
    # The rungs set the baseline-mode flags (batching, kv_layout, attention_impl, cpu_linear_kernel, prefix
    # caching) themselves; every other engine flag applies to all rungs. The KV budget defaults to
    # max_num_seqs sequences of max_model_len, what the contiguous baseline needs for a full batch.
    add_engine_args(p, dtype="float32", max_model_len=512, max_num_seqs=16)
    p.set_defaults(func=cmd_ladder)


_RUN_LADDER_ARGS = {"model", "dtype", "max_model_len", "max_num_seqs", "num_kv_blocks", "seed"}
_SET_BY_RUNGS = {"batching", "kv_layout", "attention_impl", "cpu_linear_kernel", "enable_prefix_caching", "quantization",
                 "kv_host_cache_gb", "speculative_config"}


def cmd_ladder(args) -> int:
    from tokenmill.engine.arg_utils import engine_kwargs

    extra = {k: v for k, v in engine_kwargs(args).items() if k not in _SET_BY_RUNGS and k not in _RUN_LADDER_ARGS}
    run_ladder(args.model, args.result_file, args.num_prompts, args.request_rate, args.prefix_len, args.suffix_len,
               args.num_prefixes, args.output_len, args.max_model_len, args.max_num_seqs, args.num_kv_blocks,
               args.dtype, args.seed, extra)
    return 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--rung-worker", required=True)
    _rung_worker(json.loads(ap.parse_args().rung_worker))
