"""Batch-1 (and small-batch) CPU decoding against llama.cpp on the shipped model, in one run (issue 15's CPU
goal: >= 1.2x llama.cpp at batch 1, where per-step host overhead dominates a 5.5M-parameter model).

B sequences x (128 prompt + 128 new tokens), greedy, 2 threads, output tokens/s end to end (prefill
included), as llama-batched-bench's e2e figure. tokenmill runs each configuration in its own process,
`--rounds` times alternating; then llama.cpp (bf16, q8_0) through ../shared/anchors/llamacpp.py. A
configuration is a dtype, with ":eager" for enforce_eager (no one-call C decode step: the per-op path).

    python benchmarks/bench_cpu_vs_llamacpp.py --out benchmarks/results/cpu_vs_llamacpp.json
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
ANCHOR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared", "anchors", "llamacpp.py")


def worker(conf: str, batches: list[int], npp: int, ntg: int) -> dict:
    import tokenmill  # noqa: F401  (before torch: tokenmill sets OpenMP's spin policy)
    import torch
    from tokenmill import LLM, SamplingParams
    from tokenmill.config import DEFAULT_MODEL

    dtype, _, mode = conf.partition(":")
    llm = LLM(DEFAULT_MODEL, dtype=dtype, max_model_len=512, num_threads=2, enforce_eager=mode == "eager")
    vocab = llm.llm_engine.core.model_config.vocab_size
    g = torch.Generator().manual_seed(0)
    sp = SamplingParams(temperature=0, max_tokens=ntg, ignore_eos=True)
    llm.generate([{"prompt_token_ids": [5] * 8}], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    out = {}
    for b in batches:
        prompts = [{"prompt_token_ids": torch.randint(3, vocab, (npp,), generator=g).tolist()} for _ in range(b)]
        t = time.perf_counter()
        res = llm.generate(prompts, sp, use_tqdm=False)
        out[b] = sum(len(r.outputs[0].token_ids) for r in res) / (time.perf_counter() - t)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default="float32,bfloat16,float32:eager,bfloat16:eager")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--npp", type=int, default=128)
    ap.add_argument("--ntg", type=int, default=128)
    ap.add_argument("--no-llamacpp", action="store_true")
    ap.add_argument("--worker")
    ap.add_argument("--out", default="benchmarks/results/cpu_vs_llamacpp.json")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    if args.worker:
        print("RESULT " + json.dumps(worker(args.worker, batches, args.npp, args.ntg)))
        return
    from common import machine
    from tokenmill.config import DEFAULT_MODEL

    runs: dict[str, list[dict]] = {d: [] for d in args.configs.split(",")}
    for _ in range(args.rounds):
        for dtype in runs:
            proc = subprocess.run([sys.executable, __file__, "--worker", dtype, "--batches", args.batches,
                                   "--npp", str(args.npp), "--ntg", str(args.ntg)], capture_output=True, text=True)
            line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                sys.exit(f"worker {dtype} failed:\n{proc.stderr[-3000:]}")
            runs[dtype].append(json.loads(line.removeprefix("RESULT ")))
    res = {"machine": machine(), "workload": f"B x ({args.npp} + {args.ntg}) tokens, greedy, 2 threads",
           "tokenmill_runs": runs,
           "tokenmill_best": {d: {b: max(r[str(b)] for r in rs) for b in batches} for d, rs in runs.items()}}
    if not args.no_llamacpp:
        lc = {}
        for kind in ("bf16", "q8_0"):
            for _ in range(3):  # llama-batched-bench now and then returns no rows; run it again
                proc = subprocess.run([sys.executable, ANCHOR, "bench", DEFAULT_MODEL, "--types", kind, "--batches",
                                       args.batches, "--npp", str(args.npp), "--ntg", str(args.ntg)],
                                      capture_output=True, text=True)
                got = json.loads(proc.stdout.strip().splitlines()[-1])
                lc.update(got)
                if got.get(kind):
                    break
        res["llamacpp"] = lc
        res["ratios_vs_llamacpp_bf16"] = {d: {b: round(v / lc["bf16"][str(b)]["e2e_out_tok_s"], 2)
                                              for b, v in best.items()} for d, best in res["tokenmill_best"].items()}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps({k: res[k] for k in ("tokenmill_best", "ratios_vs_llamacpp_bf16") if k in res}, indent=1))


if __name__ == "__main__":
    main()
