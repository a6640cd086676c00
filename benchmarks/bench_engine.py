"""tokenmill vs transformers on a Qwen2.5-0.5B-shaped dummy model, side by side in one run.

Workloads (issue 2):
  a) batch-1 decode: 128 prompt tokens, 128 new tokens
  b) 64 prompts x 128 tokens, 128 new tokens each
  c) 64 sequences, input and output lengths uniform in 64..512 (nano-vllm's workload, scaled down)
transformers runs (b) and (c) as padded static batches (one generate call, to the longest output).

    python benchmarks/bench_engine.py --dtypes bfloat16 float32 --out benchmarks/results/engine.json
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import QWEN25_05B, dummy_model_dir, machine, read_bandwidth_gbs, write_json  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def workloads(n_c: int, seed: int = 0):
    rng = random.Random(seed)
    vocab = QWEN25_05B["vocab_size"]
    rand = lambda n: [rng.randrange(vocab) for _ in range(n)]  # noqa: E731
    return {
        "a_batch1_decode": [(rand(128), 128)],
        "b_64x128": [(rand(128), 128) for _ in range(64)],
        "c_random_64_512": [(rand(rng.randint(64, 512)), rng.randint(64, 512)) for _ in range(n_c)],
    }


def run_tokenmill(llm, reqs):
    from tokenmill import SamplingParams

    prompts = [{"prompt_token_ids": p} for p, _ in reqs]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in reqs]
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    assert n_out == sum(n for _, n in reqs)
    ttft = [o.metrics.first_token_time - o.metrics.arrival_time for o in outs]
    return {"seconds": dt, "output_tokens": n_out, "output_tok_s": n_out / dt,
            "mean_ttft_s": sum(ttft) / len(ttft)}


def run_hf(model, reqs):
    """One padded static batch: left-pad prompts, generate to the longest requested output."""
    max_in = max(len(p) for p, _ in reqs)
    max_out = max(n for _, n in reqs)
    ids = torch.zeros(len(reqs), max_in, dtype=torch.long)
    mask = torch.zeros(len(reqs), max_in, dtype=torch.long)
    for i, (p, _) in enumerate(reqs):
        ids[i, max_in - len(p):] = torch.tensor(p)
        mask[i, max_in - len(p):] = 1
    t = time.perf_counter()
    with torch.inference_mode():
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_out, min_new_tokens=max_out,
                       do_sample=False, pad_token_id=0)
    dt = time.perf_counter() - t
    useful = sum(n for _, n in reqs)  # tokens past a request's own max_tokens are waste, not output
    return {"seconds": dt, "output_tokens": useful, "output_tok_s": useful / dt}


def useful_gflop(reqs, cfg: dict = QWEN25_05B) -> float:
    """Linear-layer work a perfect engine must do: every prompt and output token passes through the decoder
    layers once (the last output token is never fed back), and each output token needs one LM-head row.
    Attention is left out (under 2 % here). Padding, which transformers' static batches add, is not useful."""
    h, i, L = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    kv = h // cfg["num_attention_heads"] * cfg["num_key_value_heads"]
    per_layer = h * (h + 2 * kv) + h * h + 3 * h * i  # qkv, o, gate/up, down
    passes = sum(len(p) + n - 1 for p, n in reqs)
    outputs = sum(n for _, n in reqs)
    return 2 * (passes * L * per_layer + outputs * h * cfg["vocab_size"]) / 1e9


def gemm_peak_gflops(dtype: torch.dtype) -> float:
    """Best GFLOP/s of oneDNN's packed GEMM on a prefill-sized problem (2048 x 896 x 9728), the ceiling
    any engine's linear layers can reach on this machine at the current thread count."""
    w = torch.randn(9728, 896, dtype=dtype)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, 1)
    x = torch.randn(2048, 896, dtype=dtype)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        best = min(best, time.perf_counter() - t)
    return 2 * 2048 * 896 * 9728 / best / 1e9


def weight_bytes(path: str, dtype: torch.dtype) -> int:
    """Bytes read per decoded token: every weight once (a tied embedding once, as the LM head).
    Counted on a meta-device copy of the architecture, so nothing is allocated."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    return sum(p.numel() for p in m.parameters()) * dtype.itemsize


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--workloads", nargs="+", default=None)
    ap.add_argument("--n-c", type=int, default=64, help="sequences in workload c")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results/engine.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import AutoConfig, AutoModelForCausalLM

    from tokenmill import LLM

    path = dummy_model_dir()
    wl = workloads(args.n_c)
    names = args.workloads or list(wl)
    result = {"machine": machine(), "model": "Qwen2.5-0.5B shape, dummy weights", "runs": {}}
    result["read_bandwidth_gbs_before"] = read_bandwidth_gbs(args.threads)
    for dname in args.dtypes:
        dtype = DTYPES[dname]
        llm = LLM(path, dtype=dname, load_format="dummy", skip_tokenizer_init=True, max_model_len=1024,
                  max_num_seqs=64, max_num_batched_tokens=2048, kv_cache_memory_gb=6)
        wbytes = weight_bytes(path, dtype)
        run_tokenmill(llm, [(wl["a_batch1_decode"][0][0][:16], 4)])  # warm-up
        hf = None
        if not args.skip_hf:
            hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=dtype).eval()
            run_hf(hf, [(wl["a_batch1_decode"][0][0][:16], 4)])
        peak = result.setdefault("gemm_peak_gflops", {})[dname] = gemm_peak_gflops(dtype)
        for name in names:
            reqs = wl[name]
            entry = {"tokenmill": run_tokenmill(llm, reqs), "useful_gflop": useful_gflop(reqs)}
            print(dname, name, "tokenmill", f"{entry['tokenmill']['output_tok_s']:.1f} tok/s", flush=True)
            if hf is not None:
                entry["transformers"] = run_hf(hf, reqs)
                entry["speedup"] = entry["tokenmill"]["output_tok_s"] / entry["transformers"]["output_tok_s"]
                print(dname, name, "transformers", f"{entry['transformers']['output_tok_s']:.1f} tok/s",
                      f"speedup {entry['speedup']:.2f}x", flush=True)
            if name == "a_batch1_decode":
                bw = read_bandwidth_gbs(args.threads)
                # decode-only rate: the prefill of 128 tokens is removed using the measured TTFT
                tm = entry["tokenmill"]
                decode_tok_s = (tm["output_tokens"] - 1) / (tm["seconds"] - tm["mean_ttft_s"])
                entry["tokenmill"]["decode_tok_s"] = decode_tok_s
                entry["weight_bytes"] = wbytes
                entry["read_bandwidth_gbs"] = bw
                entry["roofline_tok_s"] = bw * 1e9 / wbytes
                entry["fraction_of_roofline"] = decode_tok_s / entry["roofline_tok_s"]
                print(f"  decode {decode_tok_s:.1f} tok/s = {entry['fraction_of_roofline']:.0%} of the "
                      f"{entry['roofline_tok_s']:.1f} tok/s roofline ({bw:.1f} GB/s)", flush=True)
            for side in ("tokenmill", "transformers"):
                if side in entry:
                    entry[side]["useful_gflops"] = entry["useful_gflop"] / entry[side]["seconds"]
                    entry[side]["fraction_of_gemm_peak"] = entry[side]["useful_gflops"] / peak
            if "transformers" in entry:  # what 3x transformers would need, against the GEMM ceiling
                entry["gflops_needed_for_3x"] = 3 * entry["transformers"]["useful_gflops"]
                print(f"  useful GFLOP/s: tokenmill {entry['tokenmill']['useful_gflops']:.0f}, transformers "
                      f"{entry['transformers']['useful_gflops']:.0f}; 3x would need "
                      f"{entry['gflops_needed_for_3x']:.0f}; GEMM peak {peak:.0f}", flush=True)
            result["runs"][f"{dname}/{name}"] = entry
        del llm, hf
    result["read_bandwidth_gbs_after"] = read_bandwidth_gbs(args.threads)
    write_json(result, args.out)


if __name__ == "__main__":
    main()
