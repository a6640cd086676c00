"""Per-layer GEMM time by row count for every CPU kernel a linear method can choose, to set the
crossovers (quantization/int8.py GEMV_MAX_ROWS): Qwen2.5-0.5B's MLP up-projection shape
(4864 x 896), 24 different weights per call so they stream from memory as in a real step.

    python benchmarks/bench_qkernels.py --out benchmarks/results/qkernels.json [--rows 1,2,3,4,6,8,16,32]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import machine, read_bandwidth_gbs, write_json  # noqa: E402

import tokenmill  # noqa: F401,E402
from tokenmill.layers.linear import linear_in, matmul_dtype, onednn_linear, onednn_linear_available  # noqa: E402
from tokenmill.ops import cpu_gemv, cpu_qgemm_amx, cpu_qgemv, cpu_w8a8  # noqa: E402
from tokenmill.quantization.awq_format import quantize_w4, quantize_w8, unpack_int4  # noqa: E402
from tokenmill.quantization.int8 import quantize_rows  # noqa: E402


nan = float("nan")


def timed(fn, layers: int, reps: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best / layers * 1e6


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,2,3,4,6,8,16,32")
    ap.add_argument("--n", type=int, default=4864)
    ap.add_argument("--k", type=int, default=896)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kernel-max-rows", type=int, default=32, help="time the multi-row kernels (chunks of 8) up to here")
    ap.add_argument("--out", default="benchmarks/results/qkernels.json")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    n, k, L, g = a.n, a.k, a.layers, 128
    w = [torch.randn(n, k) * 0.02 for _ in range(L)]
    onednn_bf16 = onednn_linear_available(torch.bfloat16)  # AVX-512 or AVX-NE-CONVERT
    packed = [torch.ops.mkldnn._reorder_linear_weight(x.bfloat16(), 1) for x in w] if onednn_bf16 else []
    gemv = [cpu_gemv.pack(x.bfloat16()) for x in w]
    q8 = [quantize_w8(x) for x in w]
    s8 = [(cpu_qgemv.pack_int8(q), s.float()) for q, s in q8]
    u4 = []
    for x in w:
        qw, qz, s = quantize_w4(x, g)
        u4.append(cpu_qgemv.pack_int4(unpack_int4(qw).t(), s, unpack_int4(qz), g))
    t8 = [(q, s.bfloat16()) for q, s in q8]
    t4 = [torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.randint(0, 16, (n, k), dtype=torch.int32), 2)
          for _ in range(L)]
    sz = torch.rand(k // g, n, 2, dtype=torch.bfloat16)
    ql = [torch.ops.onednn.qlinear_prepack(q, [32, k]) for q, _ in q8]
    zp = torch.zeros(n, dtype=torch.int64)
    amx = [(cpu_w8a8.pack_amx(q), s.float()) for q, s in q8] if cpu_w8a8.amx_available() else []
    amx_bf16 = cpu_qgemm_amx.available()

    def w8a8_amx(x, p, s):  # the whole linear: quantize the rows, multiply, both scales, bf16 out
        xq, t = cpu_w8a8.quantize_rows_u8(x, cpu_w8a8.amx_rows(x.shape[0]), 127, 0)
        return cpu_w8a8.w8a8_amx(xq.view(torch.int8), t, p, s, None, x.dtype)

    def per_row(fn, x):
        return [fn(r) for r in x.split(1)]

    res = {"machine": machine(), "shape": [n, k], "bandwidth_gbs": read_bandwidth_gbs(a.threads), "rows": {}}
    for m in [int(r) for r in a.rows.split(",")]:
        x = torch.randn(m, k).bfloat16()
        r = {
            "bf16 oneDNN": timed(lambda: [onednn_linear(x, p, None) for p in packed], L) if onednn_bf16 else nan,
            "int8 GEMV per row": timed(lambda: [per_row(lambda v: cpu_qgemv.gemv_int8(v, p, s), x) for p, s in s8], L),
            "int8 multi-row kernel": timed(lambda: [cpu_qgemv.gemv_int8(x, p, s) for p, s in s8], L)
            if m <= a.kernel_max_rows else nan,  # above 8 rows in chunks of at most 8
            "int8 AMX-BF16 GEMM": timed(lambda: [cpu_qgemm_amx.gemm_int8(x, p, s) for p, s in s8], L)
            if amx_bf16 else nan,
            "int8 dequant + GEMM": timed(lambda: [linear_in(x, cpu_qgemv.dequant_int8(p, s, matmul_dtype(x)), None)
                                                  for p, s in s8], L),
            "int8 torch int8pack": timed(lambda: [torch._weight_int8pack_mm(x, q, s) for q, s in t8], L),
            "int4 GEMV per row": timed(lambda: [per_row(lambda v: cpu_qgemv.gemv_int4(v, *p, g), x) for p in u4], L),
            "int4 multi-row kernel": timed(lambda: [cpu_qgemv.gemv_int4(x, *p, g) for p in u4], L)
            if m <= a.kernel_max_rows else nan,
            "int4 AMX-BF16 GEMM": timed(lambda: [cpu_qgemm_amx.gemm_int4(x, *p, g) for p in u4], L)
            if amx_bf16 else nan,
            "int4 dequant + GEMM": timed(lambda: [linear_in(x, cpu_qgemv.dequant_int4(*p, g, matmul_dtype(x)), None)
                                                  for p in u4], L),
            "int4 torch int4pack": timed(lambda: [torch.ops.aten._weight_int4pack_mm_for_cpu(x, p, g, sz) for p in t4], L),
            "w8a8 oneDNN qlinear": timed(lambda: [torch.ops.onednn.qlinear_pointwise(
                quantize_rows(x)[0].view(torch.uint8).bitwise_xor_(128), 1.0, 128, p, s.float(), zp, None, 1.0, 0,
                torch.float32, "none", [None], "") for p, (_, s) in zip(ql, q8)], L),
            "w8a8 torch _int_mm": timed(lambda: [torch._int_mm(quantize_rows(x)[0], q.t()) for q, _ in q8], L),
            "w8a8 AMX kernel": timed(lambda: [w8a8_amx(x, p, s) for p, s in amx], L) if amx else nan,
        }
        if m == 1:
            r["bf16 GEMV"] = timed(lambda: [cpu_gemv.gemv(x, p, None) for p in gemv], L)
        elif m <= cpu_gemv.MAX_ROWS:
            r["bf16 multi-row kernel"] = timed(lambda: [cpu_gemv.gemm_rows(x, p, None) for p in gemv], L)
        res["rows"][m] = r
        print(m, {key: round(v) for key, v in r.items() if v == v}, flush=True)
    write_json(res, a.out)


if __name__ == "__main__":
    main()
