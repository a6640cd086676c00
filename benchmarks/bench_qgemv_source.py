"""The quantized CPU kernels of this tree (ops/cpu_qgemv.c) against another commit's, in one process, alternating
within each round so that both meet the same minute of a noisy machine; outputs checked bit for bit.

Qwen2.5-0.5B's four linear shapes (qkv 1152 x 896, o 896 x 896, gate/up 9728 x 896, down 896 x 4864), int8 and
AWQ int4 (g128), bfloat16 rows. "cache": one weight per shape, called over and over (compute-bound); "stream": 24
weights per shape, a whole decoder's worth, so that they come from memory as in a real step. Microseconds per
layer (the four shapes), medians over the rounds, and the per-round ratio old / new.

    python benchmarks/bench_qgemv_source.py --compare-commit 7b5a3dd --out benchmarks/results/qgemv_source.json
"""
from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_qkernels import timed  # noqa: E402
from common import load_kernels_like, machine, read_bandwidth_gbs, write_json  # noqa: E402

import tokenmill  # noqa: F401,E402
from tokenmill.ops import cpu_qgemv  # noqa: E402
from tokenmill.quantization.awq_format import quantize_w4, quantize_w8, unpack_int4  # noqa: E402

SHAPES = [(1152, 896), (896, 896), (9728, 896), (896, 4864)]
COPIES = {"cache": 1, "stream": 24}  # weights per shape
ROOT = Path(__file__).resolve().parent.parent


def build_from_commit(rev: str, like: ctypes.CDLL) -> ctypes.CDLL:
    """cpu_qgemv.c as of `rev`, built with this tree's headers and flags, its functions typed as in `like`."""
    src = subprocess.run(["git", "show", f"{rev}:tokenmill/ops/cpu_qgemv.c"], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "cpu_qgemv.c"
        path.write_text(src)
        return load_kernels_like(path, like)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--compare-commit", required=True, help="the commit whose cpu_qgemv.c is the baseline")
    ap.add_argument("--rows", default="1,8,128")
    ap.add_argument("--formats", default="int8,int4")
    ap.add_argument("--modes", default="cache,stream")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results/qgemv_source.json")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    new = cpu_qgemv._library()
    old = build_from_commit(a.compare_commit, new)
    if old.tm_qgemv_s8_layout() != new.tm_qgemv_s8_layout() or old.tm_qgemv_u4_layout() != new.tm_qgemv_u4_layout():
        sys.exit("the two sources pack their panels differently; compare kernels of the same layout")
    g = torch.Generator().manual_seed(0)
    weights = {}  # (format, mode) -> [(packed args, k)] over the shapes
    for mode in a.modes.split(","):
        for fmt in a.formats.split(","):
            weights[(fmt, mode)] = []
            for n, k in SHAPES:
                for _ in range(COPIES[mode]):
                    w = torch.randn(n, k, generator=g) * 0.02
                    if fmt == "int8":
                        q, s = quantize_w8(w)
                        weights[(fmt, mode)].append(((cpu_qgemv.pack_int8(q), s.float()), k))
                    else:
                        qw, qz, sc = quantize_w4(w, 128)
                        weights[(fmt, mode)].append((cpu_qgemv.pack_int4(unpack_int4(qw).t(), sc, unpack_int4(qz), 128), k))
    rows = [int(r) for r in a.rows.split(",")]
    xs = {(m, k): torch.randn(m, k, generator=g).bfloat16() for m in rows for k in (896, 4864)}

    def call(fmt, args, x):
        return cpu_qgemv.gemv_int8(x, *args) if fmt == "int8" else cpu_qgemv.gemv_int4(x, *args, 128)

    def run(lib, fmt, mode, m):
        cpu_qgemv._library = lambda: lib
        try:
            return [call(fmt, args, xs[(m, k)]) for args, k in weights[(fmt, mode)]]
        finally:
            cpu_qgemv._library = lambda: new

    configs = [(fmt, mode, m) for fmt in a.formats.split(",") for mode in a.modes.split(",") for m in rows]
    identical = {}
    for fmt, mode, m in configs:
        if mode == "cache":
            identical[f"{fmt} {m}"] = all(torch.equal(p, q) for p, q in zip(run(old, fmt, mode, m), run(new, fmt, mode, m)))
    print("bit-identical:", identical, flush=True)
    rounds = []
    for r in range(a.rounds):
        row = {"probe_gbs": read_bandwidth_gbs(2, repeats=3)}
        for fmt, mode, m in configs:
            passes = max(2, 2000 // m) if mode == "cache" else 1  # passes over the weights per timed call
            for name, lib in (("old", old), ("new", new)) if r % 2 == 0 else (("new", new), ("old", old)):
                # microseconds per layer (the four shapes once): a pass covers COPIES[mode] layers
                us = timed(lambda: [run(lib, fmt, mode, m) for _ in range(passes)], passes * COPIES[mode], reps=3)
                row[f"{fmt} {mode} {m} {name} us"] = us
        rounds.append(row)
        print(f"round {r}: probe {row['probe_gbs']:.1f} GB/s | " + " | ".join(
            f"{fmt} {mode} {m}: {row[f'{fmt} {mode} {m} old us']:.0f} / {row[f'{fmt} {mode} {m} new us']:.0f}"
            for fmt, mode, m in configs), flush=True)
    summary = {}
    for fmt, mode, m in configs:
        key = f"{fmt} {mode} {m}"
        ratios = [x[f"{key} old us"] / x[f"{key} new us"] for x in rounds]
        summary[key] = {"old_us_median": statistics.median(x[f"{key} old us"] for x in rounds),
                        "new_us_median": statistics.median(x[f"{key} new us"] for x in rounds),
                        "old_over_new": [round(v, 3) for v in ratios], "old_over_new_median": statistics.median(ratios)}
        print(key, summary[key], flush=True)
    write_json({"machine": machine(), "command": " ".join(sys.argv), "compare_commit": a.compare_commit,
                "bit_identical": identical, "rounds": rounds, "summary": summary}, a.out)


if __name__ == "__main__":
    main()
