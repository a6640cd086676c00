"""Float32 linears by row count: the few-row C kernel (ops/cpu_gemv.c gemm_rows, 8 rows per weight pass)
against oneDNN's GEMM on its packed weight, for the shipped model's shapes and Qwen2.5-0.5B's; this sets
where float32 layers leave the kernel (layers/linear.py kernel_rows, F32_AVX2_KERNEL_ROWS).

    python benchmarks/bench_float_rows.py --out benchmarks/results/float_rows.json [--rows 8,12,16,20,32]

Microseconds per call, best of --reps, one weight in cache (the shipped model fits in L3).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine, write_json  # noqa: E402

import tokenmill  # noqa: F401,E402  (before torch: OpenMP settings)
import torch  # noqa: E402

from tokenmill.layers.linear import onednn_linear  # noqa: E402
from tokenmill.ops import cpu_gemv  # noqa: E402

SHAPES = {"shipped qkv": (512, 256), "shipped o": (256, 256), "shipped gate/up": (1408, 256),
          "shipped down": (256, 704), "shipped head": (4096, 256), "qwen qkv": (1152, 896),
          "qwen gate/up": (9728, 896), "qwen down": (896, 4864)}


def best_us(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="8,12,16,20,32")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results/float_rows.json")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    res = {"machine": machine(), "unit": "us per call", "shapes": {}}
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k)
        packed, onednn = cpu_gemv.pack(w), torch.ops.mkldnn._reorder_linear_weight(w, 1)
        row = {}
        for m in (int(r) for r in a.rows.split(",")):
            x = torch.randn(m, k)
            kernel = best_us(lambda: cpu_gemv.gemm_rows(x, packed, None), a.reps)
            dnn = best_us(lambda: onednn_linear(x, onednn, None), a.reps)
            row[m] = {"kernel": round(kernel, 1), "onednn": round(dnn, 1), "onednn / kernel": round(dnn / kernel, 2)}
        res["shapes"][name] = row
        print(f"{name:16s}", "  ".join(f"{m}: {r['kernel']:.0f}/{r['onednn']:.0f}" for m, r in row.items()), flush=True)
    write_json(res, a.out)


if __name__ == "__main__":
    main()
