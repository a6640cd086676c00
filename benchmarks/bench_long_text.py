"""The long-text ladder (issue 20): short prompts mixed with 8K-token document questions at a Poisson rate,
with chunked prefill (two budgets), prefix caching, the host-RAM KV tier and speculative decoding switched
on in turn; P50/P99 TTFT and E2E by length class and the long/short P99 ratio per rung.

    python benchmarks/bench_long_text.py --shape tiny8k --label tiny8k --request-rate 1.5
    python benchmarks/bench_long_text.py --shape qwen --label qwen --num-prompts 24 --request-rate 0.05

Shapes: `tiny8k` is the shipped model's directory (trained on 8192-token windows) with max_position_embeddings
raised to 8704, so an 8K document, its question and the answer fit (the last 512 positions are past its
training; the compute of every step is the real shape's);
`qwen` is the Qwen2.5-0.5B shape with dummy weights and the shipped tokenizer. Writes
benchmarks/results/long_text/<label>.json (the ladder, plus the machine) and a report with plots.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine, qwen_shape_with_shipped_tokenizer  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def tiny_8k_dir() -> str:
    from tokenmill.config import DEFAULT_MODEL

    path = os.path.join(tempfile.gettempdir(), "tokenmill-bench", "tiny-shakespeare-pos8k")
    os.makedirs(path, exist_ok=True)
    for f in os.listdir(DEFAULT_MODEL):
        if f != "config.json":
            shutil.copy(os.path.join(DEFAULT_MODEL, f), path)
    cfg = json.load(open(os.path.join(DEFAULT_MODEL, "config.json")))
    cfg["max_position_embeddings"] = 8192 + 512
    json.dump(cfg, open(os.path.join(path, "config.json"), "w"), indent=1)
    return path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=("tiny8k", "qwen"), default="tiny8k")
    ap.add_argument("--label", required=True)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--request-rate", type=float, default=1.0)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--chunk-budgets", default="2048,512")
    ap.add_argument("--extra", default="", help="more `bench ladder` flags, e.g. '--long-doc-len 4096'")
    args = ap.parse_args()
    if args.shape == "tiny8k":
        model, dtype, load = tiny_8k_dir(), "float32", []
    else:
        model, dtype, load = qwen_shape_with_shipped_tokenizer(), "bfloat16", ["--load-format", "dummy"]
    out = ROOT / "benchmarks" / "results" / "long_text" / f"{args.label}.json"
    cmd = [sys.executable, "-m", "tokenmill", "bench", "ladder", "--scenario", "long-text", "--model", model,
           "--dtype", dtype, *load, "--num-prompts", str(args.num_prompts), "--request-rate", str(args.request_rate),
           "--max-num-seqs", str(args.max_num_seqs), "--chunk-budgets", args.chunk_budgets,
           "--result-file", str(out), *args.extra.split()]
    print(" ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    ladder = json.loads(out.read_text())
    ladder["machine"], ladder["shape"], ladder["command"] = machine(), args.shape, " ".join(sys.argv)
    out.write_text(json.dumps(ladder, indent=2))
    subprocess.run([sys.executable, "-m", "tokenmill", "bench", "report", str(out), "--out",
                    str(out.parent / f"report_{args.label}")], check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    for r in ladder["rungs"]:
        by = r["by_length_class"]
        print(f"{r['name']:<28} short P99 TTFT {by['short']['p99_ttft_ms']:8.0f} ms  long P99 TTFT "
              f"{by['long']['p99_ttft_ms']:8.0f} ms  ratio {r['long_short_p99_ttft_ratio']:.2f}x  "
              f"same text {r['same_greedy_text_as_baseline']}")


if __name__ == "__main__":
    main()
