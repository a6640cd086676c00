"""Per-step engine overhead, seen through the shipped 5.5M-parameter model, whose steps are so cheap (~1.5 ms)
that scheduler, runner and sampler bookkeeping shows: batch-1 greedy decode of 480 tokens and 32 x 128
tokens, 3 repetitions in one process. For an A/B of two commits, run it from each checkout in turn
(alternating, as the machine drifts) and compare the JSON files:

    PYTHONPATH=/path/to/checkout python benchmarks/bench_step_overhead.py [--stop] [--sampled] --out results/step_a.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--stop", action="store_true",
                    help="give every request a stop string (one that never matches), as chat clients do")
    ap.add_argument("--sampled", action="store_true",
                    help="sample (temperature 0.8, top_p 0.95, top_k 50), as chat traffic does, instead of greedy")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    import tokenmill
    from tokenmill import LLM, SamplingParams

    llm = LLM(dtype="float32", max_model_len=512)
    stop = ["<<no such text>>"] if args.stop else None
    sampling = dict(temperature=0.8, top_p=0.95, top_k=50) if args.sampled else dict(temperature=0)
    one = SamplingParams(max_tokens=480, ignore_eos=True, stop=stop, **sampling)
    many = SamplingParams(max_tokens=128, ignore_eos=True, stop=stop, **sampling)
    llm.generate(["ROMEO:"], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)  # warm-up
    res = {"tree": os.path.dirname(tokenmill.__file__), "stop": args.stop, "sampled": args.sampled, "batch1_tok_s": [], "batch32_tok_s": []}
    for _ in range(args.reps):
        t = time.perf_counter()
        llm.generate(["ROMEO:"], one, use_tqdm=False)
        res["batch1_tok_s"].append(480 / (time.perf_counter() - t))
        t = time.perf_counter()
        llm.generate(["ROMEO:", "JULIET:", "KING:", "LEAR:"] * 8, many, use_tqdm=False)
        res["batch32_tok_s"].append(32 * 128 / (time.perf_counter() - t))
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(res), file=sys.stderr)


if __name__ == "__main__":
    main()
