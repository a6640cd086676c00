"""Quantized formats side by side with llama.cpp, in one run (issue 14's speed table).

Qwen2.5-0.5B shape, random weights saved as a real bf16 checkpoint (so llama.cpp converts the same
tensors), B sequences x (128 prompt + 128 new tokens), greedy, 2 threads, output tokens/s end to end.
tokenmill formats: bf16, int8 (W8A16), awq (4-bit g128, round-to-nearest packed as AutoAWQ GEMM), w8a8;
"+head": the LM head in int8 too, "+head4": in int4 (then llama.cpp also runs q4_0 with a q4_0 head).
Each format runs in its own process, which also reports its resident memory and, at batch 1, its decode
alone (the run less a 128-token prefill) as weight GB/s against the read probe taken around it (the
roofline). llama.cpp: bf16, q8_0, q4_0 through ../shared/anchors/llamacpp.py.

    python benchmarks/bench_quant.py --out benchmarks/results/quant.json [--formats bf16,int8,awq,w8a8] [--interleave]
        [--batches 1,32] [--rounds 2] [--no-llamacpp]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from common import QWEN25_05B, machine, read_bandwidth_gbs, write_json  # noqa: E402

ROOT = os.path.join("/tmp", "tokenmill-bench")
ANCHOR = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "anchors", "llamacpp.py")
LLAMACPP_TYPE = {"bf16": "bf16", "int8": "q8_0", "awq": "q4_0"}  # the llama.cpp type of each format's size
ENGINE = {"bf16": {}, "int8": {"quantization": "int8"}, "awq": {}, "w8a8": {"quantization": "w8a8"},
          "int8+head": {"quantization": "int8", "quantize_lm_head": True}, "awq+head": {"quantize_lm_head": True},
          "w8a8+head": {"quantization": "w8a8", "quantize_lm_head": True},
          "awq+head4": {"quantize_lm_head": "int4"}}
# llama.cpp's q4_0 with its head in q4_0 as well: the default q4_0 file of this shape carries a q8_0 head (896
# is not a multiple of 256, so its q6_K head falls back to q8_0), the bytes of our int8 head, not of our int4 one
Q4_0_HEAD4 = "q4_0+q4_0-head"


def llamacpp_types(fmt: str) -> list[str]:
    """llama.cpp types of this format's size: bf16 -> bf16, int8* -> q8_0, awq* -> q4_0 (+ the q4_0-head file)."""
    t = LLAMACPP_TYPE.get(fmt.split("+")[0])
    return ([t] if t else []) + ([Q4_0_HEAD4] if fmt.endswith("+head4") else [])


def random_checkpoint() -> str:
    """A bf16 Qwen2.5-0.5B-shaped checkpoint with random weights (transformers' init, seed 0)."""
    path = os.path.join(ROOT, "qwen2.5-0.5b-random")
    if not os.path.isfile(os.path.join(path, "model.safetensors")):
        import torch
        from transformers import AutoModelForCausalLM, Qwen2Config

        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(Qwen2Config(**QWEN25_05B), dtype=torch.bfloat16)
        model.save_pretrained(path)
    return path


def awq_checkpoint(src: str, group: int = 128) -> str:
    """Round-to-nearest 4-bit of `src`'s decoder linears in AutoAWQ GEMM format."""
    dst = src + f"-awq-g{group}"
    if os.path.isfile(os.path.join(dst, "model.safetensors")):
        return dst
    import shutil

    from safetensors.torch import load_file, save_file

    from tokenmill.quantization.awq_format import quantize_w4

    sd = load_file(os.path.join(src, "model.safetensors"))
    out = {}
    for name, t in sd.items():
        if name.endswith("_proj.weight"):
            base = name[: -len(".weight")]
            out[base + ".qweight"], out[base + ".qzeros"], out[base + ".scales"] = quantize_w4(t, group)
        else:
            out[name] = t
    os.makedirs(dst, exist_ok=True)
    save_file(out, os.path.join(dst, "model.safetensors"))
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
                                  "version": "gemm"}
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    for extra in ("generation_config.json",):
        if os.path.isfile(os.path.join(src, extra)):
            shutil.copy(os.path.join(src, extra), dst)
    return dst


def rss_mib(field: str = "VmRSS") -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return 0.0


def weight_bytes_per_token(fmt: str, shape: dict = QWEN25_05B) -> float:
    """Bytes of weights one decode step reads: the decoder's linears and the LM head, each in its format's
    layout (int8: a byte and a float32 scale per row; int4: half a byte, and per group of G a float16 scale
    and a byte of zero point per row). Norms, the one embedding row and the KV cache are left out."""
    h, inter, layers = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    kv = h // shape["num_attention_heads"] * shape["num_key_value_heads"]
    rows_by_k = {h: h + 2 * kv + h + 2 * inter, inter: h}  # input size -> output rows of the linears reading it
    head = shape["vocab_size"]

    def nbytes(kind: tuple, rows: int, k: int) -> int:
        if kind[0] == "bf16":
            return 2 * rows * k
        if kind[0] == "int8":
            return rows * k + 4 * rows
        return rows * k // 2 + 3 * rows * (k // kind[1])  # ("int4", group)

    base, _, head_opt = fmt.partition("+")
    body = {"bf16": ("bf16",), "int8": ("int8",), "w8a8": ("int8",), "awq": ("int4", 128)}[base]
    head_kind = {"head": ("int8",), "head4": ("int4", 64)}.get(head_opt, ("bf16",))
    return layers * sum(nbytes(body, rows, k) for k, rows in rows_by_k.items()) + nbytes(head_kind, head, h)


def worker(fmt: str, model: str, batches: list[int], threads: int) -> dict:
    import random

    import torch

    import tokenmill  # noqa: F401  (OpenMP defaults before torch spins up threads)
    from tokenmill import LLM, SamplingParams

    torch.set_num_threads(threads)
    llm = LLM(model=model, dtype="bfloat16", max_model_len=512, max_num_seqs=max(batches),
              adaptive_cpu_threads=False, skip_tokenizer_init=True, **ENGINE[fmt])
    res = {"rss_after_load_mib": rss_mib()}
    rng = random.Random(0)
    for b in batches:
        prompts, warm = ([{"prompt_token_ids": [rng.randrange(1000, 100000) for _ in range(128)]} for _ in range(b)]
                         for _ in range(2))
        params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
        # The first batch of each shape pays oneDNN's kernel compilation (seconds, once per process); steady
        # serving does not. Other prompts than the timed ones, so the prefix cache gives nothing away.
        t = time.perf_counter()
        llm.generate(warm, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
        warmup = time.perf_counter() - t
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        dt = time.perf_counter() - t
        n = sum(len(o.outputs[0].token_ids) for o in outs)
        res[str(b)] = {"seconds": dt, "output_tok_s": n / dt, "warmup_seconds": warmup}
        if b == 1:  # the decode alone: the same run less a prefill of another 128-token prompt
            fresh = [{"prompt_token_ids": [rng.randrange(1000, 100000) for _ in range(128)]}]
            t = time.perf_counter()
            llm.generate(fresh, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
            prefill = time.perf_counter() - t
            decode_s, gb = (dt - prefill) / (n - 1), weight_bytes_per_token(fmt) / 1e9
            res["1"].update(prefill_seconds=prefill, decode_ms_per_token=decode_s * 1e3, weight_gb_per_token=gb,
                            decode_weight_gbs=gb / decode_s)
    res["peak_rss_mib"] = rss_mib("VmHWM")
    return res


def run_worker(fmt, model, batches, threads):
    out = subprocess.run([sys.executable, __file__, "--worker", fmt, "--model", model, "--batches",
                          ",".join(map(str, batches)), "--threads", str(threads)],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--formats", default="bf16,int8,awq,w8a8")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--no-llamacpp", action="store_true")
    ap.add_argument("--llamacpp-types", default="bf16,q8_0,q4_0")
    ap.add_argument("--interleave", action="store_true",
                    help="run llama.cpp's matching type right after each tokenmill format (bf16 -> bf16, int8* -> "
                         "q8_0, awq* -> q4_0), so the two meet the same minute of a noisy machine; medians per format")
    ap.add_argument("--out", default="benchmarks/results/quant.json")
    ap.add_argument("--worker")
    ap.add_argument("--model")
    a = ap.parse_args()
    batches = [int(b) for b in a.batches.split(",")]
    if a.worker:
        print(json.dumps(worker(a.worker, a.model, batches, a.threads)))
        return
    src = random_checkpoint()
    models = {f: (awq_checkpoint(src) if f.startswith("awq") else src) for f in a.formats.split(",")}
    result = {"machine": machine(), "workload": "B x (128 prompt + 128 new), greedy", "rounds": []}
    for r in range(a.rounds):
        rnd = {"bandwidth_gbs_before": read_bandwidth_gbs(a.threads), "tokenmill": {}}
        for f, m in models.items():
            before = read_bandwidth_gbs(a.threads)
            rnd["tokenmill"][f] = res = run_worker(f, m, batches, a.threads)
            res["probe_gbs"] = [before, read_bandwidth_gbs(a.threads)]  # around the worker's runs
            if "decode_weight_gbs" in res.get("1", {}):  # the roofline: weight bytes per token x decode rate
                res["1"]["fraction_of_probe"] = res["1"]["decode_weight_gbs"] / (sum(res["probe_gbs"]) / 2)
            print(f"round {r} tokenmill {f}: {rnd['tokenmill'][f]}", flush=True)
            if a.interleave and not a.no_llamacpp:
                for t in llamacpp_types(f):
                    rnd.setdefault("llamacpp", {}).update(run_llamacpp(src, t, a))
        if not a.no_llamacpp and not a.interleave:
            rnd["llamacpp"] = {}
            for t in a.llamacpp_types.split(","):
                rnd["llamacpp"].update(run_llamacpp(src, t, a))
        print(f"round {r} llama.cpp: {rnd.get('llamacpp')}", flush=True)
        rnd["bandwidth_gbs_after"] = read_bandwidth_gbs(a.threads)
        result["rounds"].append(rnd)
    if not a.no_llamacpp:
        sys.path.insert(0, os.path.dirname(ANCHOR))
        import llamacpp

        result["llamacpp_commit"] = llamacpp.commit()
        # LLAMA_ARG_REPACK=0: llama.cpp without its repacked (AMX / AVX-512) quantized kernels, which
        # segfaulted on the AMX machine of 2026-12-02 (BENCHMARKS.md)
        result["llamacpp_env"] = {k: v for k, v in os.environ.items() if k.startswith(("LLAMA_ARG_", "GGML_"))}
        result["ratio_medians"] = ratio_medians(result["rounds"], batches)
        print(json.dumps(result["ratio_medians"], indent=1))
    write_json(result, a.out)


def ratio_medians(rounds: list[dict], batches: list[int]) -> dict:
    """Per tokenmill format and batch: its output tok/s over llama.cpp's matching type, each round, and the median."""
    import statistics

    out = {}
    for f in rounds[0]["tokenmill"]:
        for t, b in ((t, b) for t in llamacpp_types(f) for b in batches):
            r = [rnd["tokenmill"][f][str(b)]["output_tok_s"] / rnd["llamacpp"][t][str(b)]["e2e_out_tok_s"]
                 for rnd in rounds if t in rnd.get("llamacpp", {}) and str(b) in rnd["llamacpp"][t]]
            if r:
                out[f"{f} / llama.cpp {t}, batch {b}"] = {"rounds": r, "median": statistics.median(r)}
    return out


def run_llamacpp(src: str, types: str, a) -> dict:
    if types == Q4_0_HEAD4:
        return {Q4_0_HEAD4: run_q4_0_head4(src, a)}
    out = subprocess.run([sys.executable, ANCHOR, "bench", src, "--types", types, "--batches", a.batches,
                          "--threads", str(a.threads), "--dummy-vocab"], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_q4_0_head4(src: str, a) -> dict:
    """llama.cpp's q4_0 with `--token-embedding-type q4_0` (the tied embedding is its head), made once."""
    sys.path.insert(0, os.path.dirname(ANCHOR))
    import llamacpp

    base = llamacpp.gguf(src, "bf16", dummy_vocab=True)
    path = os.path.join(os.path.dirname(base), "q4_0-head-q4_0.gguf")
    if not os.path.exists(path):
        subprocess.run([os.path.join(llamacpp.ensure_build(), "llama-quantize"), "--token-embedding-type", "q4_0",
                        "--output-tensor-type", "q4_0", base, path + ".tmp", "Q4_0"], check=True,
                       capture_output=True)
        os.replace(path + ".tmp", path)
    batches = tuple(int(b) for b in a.batches.split(","))
    return {str(b): v for b, v in llamacpp.batched_bench(path, batches, threads=a.threads).items()}


if __name__ == "__main__":
    main()
