"""The sampler's top-k / top-p on a CPU: each row's W largest logits (topk) against sorting the whole vocabulary,
measured in the same run (tokenmill/sample/sampler.py `filter_logits`; the sort is what runs when the rows'
settings are not given, and the oracle). Times one `Sampler.sample` call of temperature 0.8 and the filters,
over random float32 logits shaped like a real model's vocabulary, per batch size.

    python benchmarks/bench_sampler.py --out benchmarks/results/sampler.json
    python benchmarks/bench_sampler.py --seeded --out benchmarks/results/sampler_seeded.json
    python benchmarks/bench_sampler.py --engine --out benchmarks/results/sampler_engine.json

Reports per (vocabulary, filters, batch): median ms with the heads, median ms with the sort, and the ratio.
`--seeded`: every row has a generator of its own (a seeded request); run it from each tree for an A/B.
`--engine`: instead, whole engine runs on a Qwen2.5-0.5B-shaped dummy model (its 151,936-token vocabulary,
bf16): output tok/s of 8 and 32 requests x 64 tokens, greedy and sampled (temperature 0.8, top_k 50, top_p
0.95; seeded, and unseeded), best of `--reps` (at most 3); run it from each tree (PYTHONPATH) for an A/B.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

FILTERS = {"top_p 0.95": dict(top_p=0.95), "top_k 50 + top_p 0.95": dict(top_k=50, top_p=0.95),
           "top_k 50": dict(top_k=50)}


def time_sample(sampler_mod, logits, rows, sort: bool, reps: int) -> float:
    from tokenmill.sample.sampler import Sampler

    real = sampler_mod.filter_logits
    if sort:
        sampler_mod.filter_logits = lambda *a, ks=None, ps=None: real(*a)
    try:
        sampler = Sampler(seed=0)
        sampler.sample(logits, rows)  # warm-up
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            sampler.sample(logits, rows)
            times.append(time.perf_counter() - t)
    finally:
        sampler_mod.filter_logits = real
    return statistics.median(times) * 1e3


def engine_runs(reps: int) -> dict:
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from common import dummy_model_dir

    from tokenmill import LLM, SamplingParams

    llm = LLM(dummy_model_dir(), load_format="dummy", max_model_len=512, dtype="bfloat16")
    out = {}
    for batch in (8, 32):
        prompts = [{"prompt_token_ids": [(7 * i + j) % 5000 + 100 for j in range(32)]} for i in range(batch)]
        sampled = dict(temperature=0.8, top_k=50, top_p=0.95)
        for name, kw, seeded in (("greedy", dict(temperature=0), True), ("sampled", sampled, True),
                                 ("sampled_unseeded", sampled, False)):
            params = [SamplingParams(max_tokens=64, ignore_eos=True, seed=i if seeded else None, **kw)
                      for i in range(batch)]
            llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
            best = 0.0
            for _ in range(reps):
                t = time.perf_counter()
                llm.generate(prompts, params, use_tqdm=False)
                best = max(best, batch * 64 / (time.perf_counter() - t))
            out[f"{name}_b{batch}_tok_s"] = round(best, 1)
            print(name, batch, out[f"{name}_b{batch}_tok_s"], flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", action="store_true", help="whole engine runs (see the docstring)")
    ap.add_argument("--vocabs", default="32000,151936")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--seeded", action="store_true", help="rows with generators of their own")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    from tokenmill import SamplingParams
    from tokenmill.sample import sampler as sampler_mod
    from tokenmill.sample.sampler import SampleRow

    if args.engine:
        import tokenmill

        res = {"tree": os.path.dirname(tokenmill.__file__), **engine_runs(min(args.reps, 3))}
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
        return
    g = torch.Generator().manual_seed(0)
    res = {"torch_threads": torch.get_num_threads(), "seeded": args.seeded, "rows": []}
    for vocab in map(int, args.vocabs.split(",")):
        for name, kw in FILTERS.items():
            for batch in map(int, args.batches.split(",")):
                # an LM's logits are peaked: a few hundred tokens hold nearly all the mass
                logits = torch.randn(batch, vocab, generator=g) * 4
                rows = [SampleRow(SamplingParams(temperature=0.8, **kw), [], [],
                                  torch.Generator().manual_seed(i) if args.seeded else None) for i in range(batch)]
                heads = time_sample(sampler_mod, logits, rows, False, args.reps)
                sort = time_sample(sampler_mod, logits, rows, True, args.reps)
                row = {"vocab": vocab, "filters": name, "batch": batch, "heads_ms": round(heads, 3),
                       "sort_ms": round(sort, 3), "speedup": round(sort / heads, 2)}
                res["rows"].append(row)
                print(json.dumps(row), flush=True)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
