"""Batch-1 weight streams with and without software prefetch (ops/stream.h), in one process: the GEMV kernels
built both ways (TOKENMILL_STREAM_PREFETCH=1 / 0, two cached libraries), run over a whole Qwen2.5-0.5B
decoder's linears (24 x qkv 1152 x 896, o 896 x 896, gate/up 9728 x 896, down 896 x 4864; bf16 also the 151936 x
896 head), alternating within each round, with the read-bandwidth probe beside them. GB/s of weight bytes.

    python benchmarks/bench_weight_stream.py [--rounds 6] [--out benchmarks/results/weight_stream.json]
"""
from __future__ import annotations

import argparse
import ctypes
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_qkernels import timed  # noqa: E402
from common import load_kernels_like, machine, read_bandwidth_gbs, write_json  # noqa: E402

import tokenmill  # noqa: F401,E402
from tokenmill.ops import cpu_gemv, cpu_qgemv, native  # noqa: E402
from tokenmill.quantization.awq_format import quantize_w4, quantize_w8, unpack_int4  # noqa: E402

OPS = Path(native.__file__).parent
LAYER = [(1152, 896), (896, 896), (9728, 896), (896, 4864)]


def build(source: str, prefetch: bool, like: ctypes.CDLL | None = None) -> ctypes.CDLL:
    """`source` built with or without the stream prefetch, its functions typed as in `like` (if given)."""
    before = os.environ.get("TOKENMILL_STREAM_PREFETCH")
    os.environ["TOKENMILL_STREAM_PREFETCH"] = "1" if prefetch else "0"
    try:
        return load_kernels_like(OPS / source, like)
    finally:
        if before is None:
            del os.environ["TOKENMILL_STREAM_PREFETCH"]
        else:
            os.environ["TOKENMILL_STREAM_PREFETCH"] = before


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--out", default="benchmarks/results/weight_stream.json")
    args = ap.parse_args()
    torch.set_num_threads(2)
    shapes = LAYER * 24
    xs = {k: torch.randn(1, k).bfloat16() for k in (896, 4864)}
    bf16 = [(cpu_gemv.pack((torch.randn(n, k) * 0.02).bfloat16()), n, k) for n, k in shapes + [(151936, 896)]]
    s8, u4 = [], []
    for n, k in shapes:
        w = torch.randn(n, k) * 0.02
        q, s = quantize_w8(w)
        s8.append((cpu_qgemv.pack_int8(q), s.float(), k))
        qw, qz, sc = quantize_w4(w, 128)
        u4.append((cpu_qgemv.pack_int4(unpack_int4(qw).t(), sc, unpack_int4(qz), 128), k))
    nbytes = {"bf16": sum(2 * n * k for _, n, k in bf16), "int8": sum(n * k for n, k in shapes),
              "int4": sum(n * k // 2 for n, k in shapes)}
    qgemv_lib = cpu_qgemv._library()
    variants = {("prefetch" if prefetch else "none"): (build("cpu_gemv.c", prefetch), build("cpu_qgemv.c", prefetch, qgemv_lib))
                for prefetch in (True, False)}

    def runs(gemv_fn):
        return {
            "bf16": lambda: [gemv_fn(p.data_ptr(), xs[k].data_ptr(), None, out.data_ptr(), n, k, 2)
                             for p, n, k in bf16],
            "int8": lambda: [cpu_qgemv.gemv_int8(xs[k], p, s) for p, s, k in s8],
            "int4": lambda: [cpu_qgemv.gemv_int4(xs[k], *p, 128) for p, k in u4],
        }

    out = torch.empty(1, 151936, dtype=torch.bfloat16)
    rounds = []
    real_qgemv = cpu_qgemv._library
    try:
        for r in range(args.rounds):
            row = {"probe_gbs": read_bandwidth_gbs(2, repeats=3)}
            for name, (g, q) in variants.items():
                cpu_qgemv._library = lambda q=q: q
                fn = g.tm_gemv_bf16_vnni
                fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64, ctypes.c_int64, ctypes.c_int]
                for fmt, run in runs(fn).items():
                    row[f"{name} {fmt} GB/s"] = nbytes[fmt] / timed(run, 1, reps=4) / 1e3  # timed: microseconds
            rounds.append(row)
            print(" | ".join(f"{k} {v:.1f}" for k, v in row.items()), flush=True)
    finally:
        cpu_qgemv._library = real_qgemv
    ratios = {fmt: [x[f"none {fmt} GB/s"] / x[f"prefetch {fmt} GB/s"] for x in rounds] for fmt in nbytes}
    print({fmt: [round(v, 3) for v in r] for fmt, r in ratios.items()})
    write_json({"machine": machine(), "cpu_vendor": native.cpu_vendor(), "command": " ".join(sys.argv),
                "rounds": rounds, "none_over_prefetch": ratios}, args.out)


if __name__ == "__main__":
    main()
