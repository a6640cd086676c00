"""Batch-1 (and small-batch) CPU decoding against llama.cpp on the shipped model, in one run (issue 15's CPU
goal: >= 1.2x llama.cpp at batch 1, where per-step host overhead dominates a 5.5M-parameter model).

B sequences x (128 prompt + 128 new tokens), greedy, 2 threads, output tokens/s end to end (prefill
included), as llama-batched-bench's e2e figure. tokenmill runs each configuration in its own process,
`--rounds` times alternating, and llama.cpp (bf16, q8_0, through ../shared/anchors/llamacpp.py) in the same
rounds; best and median of the rounds, and both as ratios against llama.cpp bf16. A
configuration is a dtype, with ":eager" for enforce_eager (no one-call C decode step: the per-op path), or
":steps=N" for num_scheduler_steps=N (bursts of N greedy decode steps per engine step; 1: none, 0 or no
":steps": the offline LLM's default, bursts as long as fit in 4 ms), and "@DIR" to run
it from another source tree (a git worktree of an earlier commit: before / after in the same rounds).

    python benchmarks/bench_cpu_vs_llamacpp.py --out benchmarks/results/cpu_vs_llamacpp.json

llama.cpp's converter needs sentencepiece for the shipped tokenizer: `pip install -e '.[bench]'`.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
ANCHOR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared", "anchors", "llamacpp.py")


LLAMACPP_TYPES = ("bf16", "q8_0")


def llamacpp(kind: str, batches: str, npp: int, ntg: int) -> dict:
    """e2e output tok/s per batch size from one llama-batched-bench run (retried: it now and then returns no
    rows)."""
    from tokenmill.config import DEFAULT_MODEL

    for _ in range(3):
        proc = subprocess.run([sys.executable, ANCHOR, "bench", DEFAULT_MODEL, "--types", kind, "--batches", batches,
                               "--npp", str(npp), "--ntg", str(ntg)], capture_output=True, text=True)
        lines = proc.stdout.strip().splitlines()
        if proc.returncode or not lines:  # a failed build or conversion (e.g. a converter import missing)
            raise RuntimeError(f"llama.cpp anchor failed ({proc.returncode}): {proc.stderr.strip()[-800:]}")
        got = json.loads(lines[-1]).get(kind)
        if got:
            return {b: row["e2e_out_tok_s"] for b, row in got.items()}
    return {}


def worker(conf: str, batches: list[int], npp: int, ntg: int) -> dict:
    import tokenmill  # noqa: F401  (before torch: tokenmill sets OpenMP's spin policy)
    import torch
    from tokenmill import LLM, SamplingParams
    from tokenmill.config import DEFAULT_MODEL

    dtype, _, mode = conf.partition(":")
    steps = int(mode.removeprefix("steps=")) if mode.startswith("steps=") else None  # None: LLM's default (0)
    llm = LLM(DEFAULT_MODEL, dtype=dtype, max_model_len=512, num_threads=2, enforce_eager=mode == "eager",
              num_scheduler_steps=steps)
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

    runs: dict[str, list[dict]] = {d: [] for d in args.configs.split(",")}
    if not args.no_llamacpp:
        runs.update({f"llama.cpp {kind}": [] for kind in LLAMACPP_TYPES})
    for _ in range(args.rounds):  # every configuration once per round, llama.cpp's too: drift hits all alike
        for conf in runs:
            if conf.startswith("llama.cpp"):
                runs[conf].append(llamacpp(conf.split()[1], args.batches, args.npp, args.ntg))
                continue
            conf_only, _, tree = conf.partition("@")
            env = dict(os.environ, PYTHONPATH=tree) if tree else None
            proc = subprocess.run([sys.executable, __file__, "--worker", conf_only, "--batches", args.batches,
                                   "--npp", str(args.npp), "--ntg", str(args.ntg)], capture_output=True, text=True,
                                  env=env)
            line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                sys.exit(f"worker {conf} failed:\n{proc.stderr[-3000:]}")
            runs[conf].append(json.loads(line.removeprefix("RESULT ")))

    def summary(pick) -> dict:
        return {c: {b: pick([r[str(b)] for r in rs if str(b) in r]) for b in batches} for c, rs in runs.items()}

    res = {"machine": machine(), "workload": f"B x ({args.npp} + {args.ntg}) tokens, greedy, 2 threads",
           "runs": runs, "best": summary(max), "median": summary(statistics.median)}
    if not args.no_llamacpp:
        for pick in ("best", "median"):
            base = res[pick]["llama.cpp bf16"]
            res[f"{pick}_vs_llamacpp_bf16"] = {c: {b: round(v / base[b], 2) for b, v in by.items()}
                                               for c, by in res[pick].items()}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps({k: res[k] for k in ("best_vs_llamacpp_bf16", "median_vs_llamacpp_bf16") if k in res},
                     indent=1))


if __name__ == "__main__":
    main()
