"""Prefill time by format and prompt length, and what the AMX weight-only GEMM (ops/cpu_qgemm_amx.c) buys.

Qwen2.5-0.5B shape (bench_quant.py's checkpoints), one prompt at a time, max_tokens=1, so the time is one
prompt's prefill (one step up to --chunk tokens) plus one LM-head row. Each (format, kernel) runs in its own
process; quantized formats run twice, with the AMX GEMM and with TOKENMILL_DISABLE_CPU_QGEMM_AMX=1 (the
dequantize-per-call path), interleaved in each round.

    python benchmarks/bench_prefill.py --out benchmarks/results/prefill_amx.json [--lens 128,512,2048]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from bench_quant import ENGINE, awq_checkpoint, random_checkpoint  # noqa: E402
from common import machine, write_json  # noqa: E402


def worker(fmt: str, model: str, lens: list[int], threads: int, reps: int) -> dict:
    import random

    import torch

    import tokenmill  # noqa: F401
    from tokenmill import LLM, SamplingParams

    torch.set_num_threads(threads)
    llm = LLM(model=model, dtype="bfloat16", max_model_len=max(lens) + 16, max_num_seqs=1,
              max_num_batched_tokens=max(lens), adaptive_cpu_threads=False, skip_tokenizer_init=True, **ENGINE[fmt])
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    out = {}
    for n in lens:
        times = []
        for _ in range(reps + 1):  # the first pays the shape's first-call costs
            prompt = [{"prompt_token_ids": [rng.randrange(1000, 100000) for _ in range(n)]}]
            t = time.perf_counter()
            llm.generate(prompt, params, use_tqdm=False)
            times.append(time.perf_counter() - t)
        out[str(n)] = {"ms_min": min(times[1:]) * 1e3, "ms_median": sorted(times[1:])[len(times[1:]) // 2] * 1e3}
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--formats", default="bf16,int8+head,awq+head")
    ap.add_argument("--lens", default="128,512,2048")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results/prefill_amx.json")
    ap.add_argument("--worker")
    ap.add_argument("--model")
    a = ap.parse_args()
    lens = [int(n) for n in a.lens.split(",")]
    if a.worker:
        print(json.dumps(worker(a.worker, a.model, lens, a.threads, a.reps)))
        return
    src = random_checkpoint()
    runs = []
    for f in a.formats.split(","):
        model = awq_checkpoint(src) if f.startswith("awq") else src
        runs.append((f, model, {}))
        if f != "bf16":
            runs.append((f + " (dequantize per call)", model, {"TOKENMILL_DISABLE_CPU_QGEMM_AMX": "1"}))
    result = {"machine": machine(), "workload": "one prompt, max_tokens=1, bf16", "rounds": []}
    for r in range(a.rounds):
        rnd = {}
        for label, model, env in runs:
            fmt = label.split(" ")[0]
            out = subprocess.run([sys.executable, __file__, "--worker", fmt, "--model", model, "--lens", a.lens,
                                  "--threads", str(a.threads), "--reps", str(a.reps)],
                                 capture_output=True, text=True, check=True, env={**os.environ, **env})
            rnd[label] = json.loads(out.stdout.strip().splitlines()[-1])
            print(f"round {r} {label}: {rnd[label]}", flush=True)
        result["rounds"].append(rnd)
    write_json(result, a.out)


if __name__ == "__main__":
    main()
