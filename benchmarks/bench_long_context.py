"""Long-context serving, this source tree against another (e.g. the previous commit's), in the same run.

The workload is bench_spec_decode.py's quoting workload at batch 1: 4 documents of ~7K tokens of held-out
plays, 3 quotes each, 256 new tokens per quote, greedy, the shipped model. The first quote of a document
prefills all ~7K tokens (P99 TTFT); the other two hit its blocks in the prefix cache and prefill only their
cue, after the cached prefix (median TTFT); decoding runs at ~7K tokens of context (TPOT). Each configuration
(speculation off, n-gram at k = 8 adaptive) runs in its own process per tree, trees alternating within each
round; ratios are this tree over the baseline tree of the same round (times: < 1 is faster).

Because the quotes queue behind each other at batch 1, their TTFT is mostly waiting. The `prefill` part
times prefill alone, one prompt at a time (max_tokens = 1): each document's whole prompt with the prefix
cache off (chunked at the default 2048-token budget), and a quote's cue after its document's cached blocks.

    git worktree add /tmp/base HEAD~1
    python benchmarks/bench_long_context.py --baseline-tree /tmp/base [--repeats 3] [--out FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_spec_decode import MODEL, _requests  # noqa: E402
from bench_spec_decode import _worker as serve_worker  # noqa: E402
from common import machine, run_job, serve_job, write_json  # noqa: E402

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NGRAM = {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
RATIOS = ("output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms")


def prefill_worker(job: dict) -> dict:
    """Seconds of each document's whole prefill (prefix cache off), then of each cue after its document's
    cached blocks (a second engine, prefix cache on)."""
    import time

    import tokenmill  # noqa: F401
    from tokenmill import LLM, SamplingParams

    one = SamplingParams(max_tokens=1, temperature=0.0)
    prompts = [r["prompt"] for r in job["requests"]]

    def timed(llm, prompt):
        t = time.perf_counter()
        llm.generate([prompt], one, use_tqdm=False)
        return time.perf_counter() - t

    cold = LLM(model=MODEL, max_model_len=8192, enable_prefix_caching=False)
    timed(cold, "ROMEO:")
    whole = [timed(cold, p) for p in prompts[::3]]  # one per document
    del cold
    warm = LLM(model=MODEL, max_model_len=8192, enable_prefix_caching=True)
    cue = []
    for i in range(0, len(prompts), 3):
        timed(warm, prompts[i])  # the document's blocks enter the cache
        cue += [timed(warm, p) for p in prompts[i + 1:i + 3]]
    return {"whole_prompt_s": sum(whole) / len(whole), "cue_after_cached_prefix_s": sum(cue) / len(cue)}


def worker(job: dict) -> dict:
    return prefill_worker(job) if job["kind"] == "prefill" else serve_worker(job)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", help="(internal) run one job file")
    ap.add_argument("--baseline-tree", help="another checkout of tokenmill to compare against")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--configs", default="prefill,off,ngram")
    ap.add_argument("--out", default="benchmarks/results/long_context.json")
    args = ap.parse_args()
    if args.worker:
        serve_job(args.worker, worker)
        return
    requests = _requests("quote", 4, 256)
    base = dict(model=MODEL, max_num_seqs=1, max_model_len=8192)
    configs = {"prefill": {"kind": "prefill"}, "off": {"kind": "serve", "engine": base},
               "ngram": {"kind": "serve", "engine": dict(base, speculative_config=NGRAM)}}
    configs = {k: v for k, v in configs.items() if k in args.configs.split(",")}
    trees = {"this": HERE, "baseline": args.baseline_tree}
    runs = {c: {t: [] for t in trees} for c in configs}
    for r in range(args.repeats):
        for c, job in configs.items():
            for t, tree in (trees.items() if r % 2 == 0 else reversed(trees.items())):
                res = run_job(__file__, dict(job, requests=requests, warmups=1), tree)
                runs[c][t].append(res)
                print(f"round {r} {c:<7} {t:<9} " + "  ".join(f"{k} {v:.4g}" for k, v in res.items()
                                                            if isinstance(v, float)), flush=True)
    keys = {"prefill": ("whole_prompt_s", "cue_after_cached_prefix_s")}
    ratios = {c: {k: [a[k] / b[k] for a, b in zip(runs[c]["this"], runs[c]["baseline"])]
                  for k in keys.get(c, RATIOS)} for c in configs}
    print(json.dumps(ratios, indent=1))
    write_json({"machine": machine(), "args": vars(args), "ratios_this_over_baseline": ratios, "runs": runs}, args.out)


if __name__ == "__main__":
    main()
