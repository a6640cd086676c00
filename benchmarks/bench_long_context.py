"""Long-context serving, this source tree against another (e.g. the previous commit's), in the same run.

The workload is bench_spec_decode.py's quoting workload at batch 1: 4 documents of ~7K tokens of held-out
plays, 3 quotes each, 256 new tokens per quote, greedy, the shipped model. The first quote of a document
prefills all ~7K tokens (P99 TTFT); the other two hit its blocks in the prefix cache and prefill only their
cue, after the cached prefix (median TTFT); decoding runs at ~7K tokens of context (TPOT). Each configuration
(speculation off, n-gram at k = 8 adaptive) runs in its own process per tree, trees alternating within each
round; ratios are this tree over the baseline tree of the same round (times: < 1 is faster).

    git worktree add /tmp/base HEAD~1
    python benchmarks/bench_long_context.py --baseline-tree /tmp/base [--repeats 3] [--out FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_spec_decode import MODEL, _requests  # noqa: E402
from common import machine, write_json  # noqa: E402

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPEC_SCRIPT = os.path.join(HERE, "benchmarks", "bench_spec_decode.py")
NGRAM = {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
RATIOS = ("output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms")


def run_tree(tree: str, engine: dict, requests: list[dict]) -> dict:
    """bench_spec_decode's worker in a fresh process that imports tokenmill from `tree`."""
    env = dict(os.environ, PYTHONPATH=os.path.abspath(tree))
    with tempfile.NamedTemporaryFile("w", suffix=".json") as j, tempfile.NamedTemporaryFile("r", suffix=".json") as f:
        json.dump({"engine": engine, "requests": requests, "warmups": 1, "result": f.name}, j)
        j.flush()
        subprocess.run([sys.executable, SPEC_SCRIPT, "--worker", j.name], check=True, env=env, cwd=tree)
        return json.load(open(f.name))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline-tree", required=True, help="another checkout of tokenmill to compare against")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--configs", default="off,ngram")
    ap.add_argument("--out", default="benchmarks/results/long_context.json")
    args = ap.parse_args()
    requests = _requests("quote", 4, 256)
    base = dict(model=MODEL, max_num_seqs=1, max_model_len=8192)
    configs = {"off": base, "ngram": dict(base, speculative_config=NGRAM)}
    configs = {k: v for k, v in configs.items() if k in args.configs.split(",")}
    trees = {"this": HERE, "baseline": args.baseline_tree}
    runs = {c: {t: [] for t in trees} for c in configs}
    for r in range(args.repeats):
        for c, engine in configs.items():
            for t, tree in (trees.items() if r % 2 == 0 else reversed(trees.items())):
                res = run_tree(tree, engine, requests)
                runs[c][t].append(res)
                print(f"round {r} {c:<6} {t:<9} {res['output_throughput']:7.1f} tok/s  TTFT median "
                      f"{res['median_ttft_ms']:7.1f} p99 {res['p99_ttft_ms']:7.1f} ms  TPOT {res['median_tpot_ms']:.2f} ms",
                      flush=True)
    ratios = {c: {k: [a[k] / b[k] for a, b in zip(runs[c]["this"], runs[c]["baseline"])] for k in RATIOS}
              for c in configs}
    print(json.dumps(ratios, indent=1))
    write_json({"machine": machine(), "args": vars(args), "ratios_this_over_baseline": ratios, "runs": runs}, args.out)


if __name__ == "__main__":
    main()
