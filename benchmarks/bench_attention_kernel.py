"""Paged decode attention, one layer's call, at Qwen2.5-0.5B's head shape (14 query heads over 2 KV heads,
head dim 64): the C kernel (ops/cpu_attention.c) against the torch path it replaces (gather a padded
float32 copy through the block tables, two batched matmuls), timed in the same run. `--compare-source`
also builds and times another version of the C file (e.g. the previous commit's) for a before/after.

    python benchmarks/bench_attention_kernel.py [--compare-source OLD.c] [--out FILE]
    python benchmarks/bench_attention_kernel.py --verify-lens 1024 7000 --heads 4 2 [--k 0 8 16] [--layers 6]
        [--compare-source OLD.c] --out FILE

`--verify-lens` times a speculative verification instead: one sequence's 1 + k rows at lengths L-k .. L over
the same blocks, in one call (the kernel groups them and reads the keys once) against the same rows in 1 + k
single-row calls (each reading the keys) and one row alone.

Each case checks the kernel's output against the torch path before timing it. Writes JSON."""
from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from common import QWEN25_05B, machine, read_bandwidth_gbs, write_json  # noqa: E402

from tokenmill.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from tokenmill.ops import cpu_attention, native  # noqa: E402


def build(source: str):
    """Another version of cpu_attention.c, built as ops/native.py builds the kernels; same C signature."""
    fn = ctypes.CDLL(str(native.build([Path(source).resolve()]))).tm_paged_decode_attention
    fn.argtypes = cpu_attention._kernel().argtypes
    return fn


def case(batch: int, max_len: int, dtype: torch.dtype, bs: int = 16, seed: int = 0):
    """Sequence lengths uniform in [max_len / 2, max_len], blocks scattered over the pool."""
    g = torch.Generator().manual_seed(seed)
    hq = QWEN25_05B["num_attention_heads"]
    hkv = QWEN25_05B["num_key_value_heads"]
    d = QWEN25_05B["hidden_size"] // hq
    lens = torch.randint(max_len // 2, max_len + 1, (batch,), generator=g, dtype=torch.int32)
    per_seq = -(-max_len // bs)
    num_blocks = batch * per_seq
    tables = torch.randperm(num_blocks, generator=g).view(batch, per_seq).to(torch.int32)
    key_cache = torch.randn(num_blocks, bs, hkv, d, generator=g).to(dtype)
    value_cache = torch.randn(num_blocks, bs, hkv, d, generator=g).to(dtype)
    q = torch.randn(batch, hq, d, generator=g).to(dtype)
    batch_desc = SimpleNamespace(block_tables=tables, seq_lens=lens, seq_lens_host=lens.tolist())
    meta = SimpleNamespace(batch=batch_desc, block_tables=tables, seq_lens=lens, decode_mask=None)
    return q, key_cache, value_cache, meta, d ** -0.5


def verify_case(length: int, rows: int, hq: int, hkv: int, d: int, dtype: torch.dtype, bs: int = 16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    num_blocks = -(-length // bs) + 8
    table = torch.randperm(num_blocks, generator=g).to(torch.int32)
    key_cache = torch.randn(num_blocks, bs, hkv, d, generator=g).to(dtype)
    value_cache = torch.randn(num_blocks, bs, hkv, d, generator=g).to(dtype)
    q = torch.randn(rows, hq, d, generator=g).to(dtype)
    lens = torch.arange(length - rows + 1, length + 1, dtype=torch.int32)
    return q, key_cache, value_cache, table.expand(rows, -1).contiguous(), lens, d ** -0.5


def verify_rows(args) -> list[dict]:
    """Per length and k: a verification's 1 + k rows grouped in one call, row by row, and one row alone, each
    over `--layers` layers' caches in turn (one call per layer, as an engine step makes: with several layers
    the KV no longer stays in cache between calls)."""
    hq, hkv = args.heads
    other = build(args.compare_source) if args.compare_source else None
    out = []
    for dname in args.dtypes:
        dtype = getattr(torch, dname)
        for length in args.verify_lens:
            for k in args.k:
                layers = [verify_case(length, 1 + k, hq, hkv, 64, dtype, seed=i) for i in range(args.layers)]
                q, tables, lens, scale = layers[0][0], layers[0][3], layers[0][4], layers[0][5]

                def step(rows=slice(None)):
                    return [cpu_attention.paged_decode_attention(q[rows], kc, vc, tables[rows], lens[rows], scale)
                            for _, kc, vc, *_ in layers]

                def one_by_one():
                    return [step(slice(i, i + 1)) for i in range(len(lens))]

                def times():
                    grouped = step()[0]
                    assert torch.equal(grouped, torch.cat([r[0] for r in one_by_one()]))  # grouping changes no bit
                    return timed(lambda: step(slice(-1, None))), timed(step), timed(one_by_one)

                t_one, t_group, t_rows = times()
                row = {"dtype": dname, "heads": f"{hq}/{hkv}x64", "length": length, "rows": 1 + k,
                       "layers": args.layers, "one_row_us": 1e6 * t_one, "grouped_us": 1e6 * t_group,
                       "row_by_row_us": 1e6 * t_rows, "grouped_vs_one_row": t_group / t_one,
                       "row_by_row_vs_grouped": t_rows / t_group}
                if other is not None:
                    real = cpu_attention._kernel
                    cpu_attention._kernel = lambda: other
                    try:
                        o_one, o_group, _ = times()
                    finally:
                        cpu_attention._kernel = real
                    row.update(compare_one_row_us=1e6 * o_one, compare_grouped_us=1e6 * o_group,
                               one_row_speedup_vs_compare=o_one / t_one, grouped_speedup_vs_compare=o_group / t_group)
                out.append(row)
                print(" | ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()),
                      flush=True)
    return out


def timed(fn, min_seconds: float = 1.0) -> float:
    """Median seconds per call."""
    fn()
    times, start = [], time.perf_counter()
    while time.perf_counter() - start < min_seconds or len(times) < 5:
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--max-lens", type=int, nargs="+", default=[128, 512, 1024])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--compare-source", help="another version of ops/cpu_attention.c to time as well")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "attention_kernel.json"))
    ap.add_argument("--verify-lens", type=int, nargs="+", help="time a verification's rows at these lengths")
    ap.add_argument("--k", type=int, nargs="+", default=[4], help="drafts per verification (--verify-lens)")
    ap.add_argument("--layers", type=int, default=1,
                    help="--verify-lens: layers' caches per timed step (6: the shipped model's, KV out of cache)")
    ap.add_argument("--heads", type=int, nargs=2, default=[4, 2], metavar=("HQ", "HKV"),
                    help="query and KV heads for --verify-lens (default: the shipped model's)")
    args = ap.parse_args()
    if not cpu_attention.available():
        sys.exit("the C attention kernel does not run here (needs x86-64 with AVX2 + FMA, and gcc)")
    torch.set_num_threads(args.threads)
    if args.verify_lens:
        write_json({"benchmark": "paged_decode_attention_verification", "machine": machine(),
                    "command": " ".join(sys.argv), "rows": verify_rows(args)}, args.out)
        return
    other = build(args.compare_source) if args.compare_source else None
    bandwidth = read_bandwidth_gbs(args.threads)
    rows = []
    for dname in args.dtypes:
        dtype = getattr(torch, dname)
        for max_len in args.max_lens:
            q, kc, vc, meta, scale = case(args.batch, max_len, dtype)
            torch_path = TorchAttentionBackend(use_kernel=False)

            def run_torch():
                meta.decode_mask = None  # built once per step, by the first layer: part of the cost
                return torch_path._decode(q, kc, vc, meta, scale)

            def run_kernel():
                return cpu_attention.paged_decode_attention(q, kc, vc, meta.block_tables, meta.seq_lens, scale)

            ref = run_torch()
            tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-2)
            torch.testing.assert_close(run_kernel().float(), ref.float(), **tol)
            t_torch, t_kernel = timed(run_torch), timed(run_kernel)
            kv_bytes = 2 * int(meta.seq_lens.sum()) * kc.shape[2] * kc.shape[3] * kc.element_size()
            row = {"dtype": dname, "batch": args.batch, "max_len": max_len, "mean_len": float(meta.seq_lens.float().mean()),
                   "torch_ms": 1e3 * t_torch, "kernel_ms": 1e3 * t_kernel, "kernel_speedup_vs_torch": t_torch / t_kernel,
                   "kernel_fraction_of_read_bandwidth": kv_bytes / t_kernel / 1e9 / bandwidth}
            if other is not None:
                real = cpu_attention._kernel
                cpu_attention._kernel = lambda: other
                try:
                    torch.testing.assert_close(run_kernel().float(), ref.float(), **tol)
                    t_other = timed(run_kernel)
                finally:
                    cpu_attention._kernel = real
                row.update(compare_ms=1e3 * t_other, kernel_speedup_vs_compare=t_other / t_kernel)
            rows.append(row)
            print(" | ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
    write_json({"benchmark": "paged_decode_attention", "machine": machine(), "command": " ".join(sys.argv),
                "read_bandwidth_gbs": bandwidth, "heads": "14 query / 2 KV, head dim 64 (Qwen2.5-0.5B)",
                "rows": rows}, args.out)


if __name__ == "__main__":
    main()
