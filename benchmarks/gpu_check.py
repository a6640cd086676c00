"""Everything GPU-specific in one run (issue 15): correctness first, then the timings. Budget: <= 8 minutes on
one H200. Writes JSON (and a log) to --out-dir and prints a short table last.

    correctness   Triton kernels against their torch twins on CUDA (paged attention over mixed steps, GQA 1/4/7,
                  block sizes 16/32, split-KV; the KV write with -1 rows; add+RMSNorm, rotary, SiLU-and-mul;
                  the AWQ / int8 dequantize-GEMMs), engine greedy tokens Triton == torch backend, and CUDA-graph
                  replay == eager (enforce_eager) on a tiny random Llama
    ceilings      device-to-device copy bandwidth (bytes read + written), bf16 GEMM TFLOP/s (random data)
    timings       batch-1 decode of a Llama-3-8B-shaped dummy bf16 model as a fraction of the HBM roofline
                  (weight bytes per token / copy bandwidth), prefill TFLOP/s, offline throughput at 128 + 128
                  tokens and high concurrency (goal >= 15,000 tok/s; TensorRT-LLM FP8 on H200: 27,911), and a
                  short GPU ladder: torch backend eager -> Triton eager -> Triton + CUDA graphs

On the lent machine the image has torch, triton and transformers but not msgspec. Fetch its wheel here once
(into .whl/, ignored through .git/info/exclude):

    echo /.whl/ >> .git/info/exclude
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl msgspec

then one device call, with carry=[".whl"]:

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:.;
    PYTHONUNBUFFERED=1 python3 benchmarks/gpu_check.py --out-dir $OUT

Each section is guarded: a failure is recorded (with its traceback) and the script moves on.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

LLAMA3_8B = dict(architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                 num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                 rope_theta=500000.0, rms_norm_eps=1e-5, bos_token_id=128000, eos_token_id=128001,
                 tie_word_embeddings=False)
TINY = dict(architectures=["LlamaForCausalLM"], vocab_size=512, hidden_size=256, intermediate_size=512,
            num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024,
            bos_token_id=0, eos_token_id=1, tie_word_embeddings=False)
RESULTS: dict = {}
T0 = time.time()


def section(name: str):
    def wrap(fn):
        def run(*a, **kw):
            t = time.time()
            try:
                RESULTS[name] = fn(*a, **kw)
            except Exception:
                RESULTS[name] = {"error": traceback.format_exc()[-4000:]}
            RESULTS.setdefault(name, {})
            if isinstance(RESULTS[name], dict):
                RESULTS[name]["seconds"] = round(time.time() - t, 2)
            print(f"[{time.time() - T0:6.1f}s] {name}: {json.dumps(RESULTS[name])[:600]}", flush=True)
        return run
    return wrap


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def median_ms(fn, reps: int = 20, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    return sorted(times)[len(times) // 2]


def model_dir(shape: dict, name: str) -> str:
    from transformers import LlamaConfig
    path = os.path.join(tempfile.gettempdir(), "tokenmill-gpu", name)
    if not os.path.isfile(os.path.join(path, "config.json")):
        LlamaConfig(**shape).save_pretrained(path)
    return path


# ------------------------------------------------------------------ ceilings

@section("ceilings")
def ceilings() -> dict:
    n = 2 * 2**30 // 2  # 2 GiB of bf16
    src = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src))
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    mm = median_ms(lambda: a @ b, reps=10)
    return {"device": torch.cuda.get_device_name(), "sms": torch.cuda.get_device_properties(0).multi_processor_count,
            "torch": torch.__version__, "triton": __import__("triton").__version__,
            "copy_gb_s": round(2 * src.numel() * 2 / ms / 1e6, 1), "bf16_gemm_tflops": round(2 * 8192**3 / mm / 1e9, 1)}


# ------------------------------------------------------------------ kernels against their twins

def _attention_case(gen, seqs: list[tuple[int, int]], hq: int, hkv: int, d: int, bs: int, dtype, splits=None):
    """seqs: (new tokens, total length) per sequence, in step order. Returns (max error vs twin, out)."""
    from tokenmill.ops import triton_attention as ta
    nblocks = sum(-(-L // bs) for _, L in seqs) + 4
    kc = torch.randn(nblocks, bs, hkv, d, generator=gen, device="cuda").to(dtype)
    vc = torch.randn(nblocks, bs, hkv, d, generator=gen, device="cuda").to(dtype)
    perm = torch.randperm(nblocks, generator=gen, device="cuda")
    mb = max(-(-L // bs) for _, L in seqs)
    tables, used = torch.zeros(len(seqs), mb, dtype=torch.int32, device="cuda"), 0
    for i, (_, L) in enumerate(seqs):
        k = -(-L // bs)
        tables[i, :k] = perm[used:used + k].int()
        used += k
    qsl = torch.tensor([0] + [sum(n for n, _ in seqs[:i + 1]) for i in range(len(seqs))], dtype=torch.int32,
                       device="cuda")
    lens = torch.tensor([L for _, L in seqs], dtype=torch.int32, device="cuda")
    q = torch.randn(int(qsl[-1]), hq, d, generator=gen, device="cuda").to(dtype)
    out = ta.paged_attention(q, kc, vc, qsl, lens, tables, d ** -0.5, max(n for n, _ in seqs),
                             max(L for _, L in seqs), num_kv_splits=splits)
    ref = ta.paged_attention_ref(q, kc, vc, qsl, lens, tables, d ** -0.5)
    return rel_err(out, ref)


@section("kernels")
def kernels() -> dict:
    from tokenmill.ops import triton_attention as ta
    from tokenmill.ops import triton_fused as tf
    from tokenmill.ops import triton_quant as tq
    from tokenmill.quantization import awq_format
    from tokenmill.layers.rotary import apply_rotary
    gen = torch.Generator(device="cuda").manual_seed(0)
    res = {}
    mixed = [(1, 37), (1, 200), (16, 16), (5, 69), (1, 1), (64, 128)]
    for dtype in (torch.bfloat16, torch.float16):
        for group in (1, 4, 7):
            for bs in (16, 32):
                res[f"attn-{str(dtype)[6:]}-g{group}-bs{bs}"] = _attention_case(gen, mixed, 2 * group, 2, 128, bs, dtype)
    res["attn-split-decode"] = _attention_case(gen, [(1, 8000), (1, 3000)], 32, 8, 128, 16, torch.bfloat16)
    res["attn-split-forced"] = _attention_case(gen, [(1, 4000), (3, 2048)], 28, 4, 128, 32, torch.bfloat16, splits=8)
    # KV write: -1 rows write nothing
    kc = torch.randn(8, 16, 2, 64, device="cuda")
    vc = torch.randn_like(kc)
    k, v = torch.randn(10, 2, 64, device="cuda"), torch.randn(10, 2, 64, device="cuda")
    slots = torch.tensor([3, -1, 17, 40, -1, 127, 0, 64, 65, 100], device="cuda")
    kr, vr = kc.clone(), vc.clone()
    ta.write_kv(k, v, kc, vc, slots)
    ta.write_kv_ref(k, v, kr, vr, slots)
    res["write_kv_exact"] = bool(torch.equal(kc, kr) and torch.equal(vc, vr))
    # fused ops
    x = torch.randn(300, 4096, device="cuda", dtype=torch.bfloat16)
    r = torch.randn_like(x)
    w = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    r2 = r.clone()
    out = tf.add_rmsnorm(x, r2, w, 1e-5)
    h = (x + r).float()
    want = w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype)
    res["add_rmsnorm"] = rel_err(out, want)
    gu = torch.randn(300, 2 * 14336, device="cuda", dtype=torch.bfloat16)
    res["silu_mul"] = rel_err(tf.silu_mul(gu), torch.nn.functional.silu(gu[:, :14336].float()) * gu[:, 14336:].float())
    qkv = torch.randn(300, 48 * 128, device="cuda", dtype=torch.bfloat16)
    pos = torch.randint(0, 4096, (300,), device="cuda")
    inv = 1.0 / (500000.0 ** (torch.arange(0, 128, 2, device="cuda").float() / 128))
    f = torch.outer(pos.float(), inv)
    cos, sin = torch.cat((f, f), -1).cos().bfloat16(), torch.cat((f, f), -1).sin().bfloat16()
    want = apply_rotary(qkv[:, :40 * 128].view(300, 40, 128), cos, sin)
    tf.rotary_(qkv, cos, sin, 40, 128)
    res["rotary"] = rel_err(qkv[:, :40 * 128].view(300, 40, 128), want)
    # dequantize-GEMMs
    wq = torch.randn(4096, 4096)
    qw, qz, s = (t.cuda() for t in awq_format.quantize_w4(wq, 128))
    for m in (1, 64):
        xa = torch.randn(m, 4096, device="cuda", dtype=torch.float16)
        res[f"awq_gemm_m{m}"] = rel_err(tq.awq_gemm(xa, qw, qz, s, 128), tq.awq_gemm_ref(xa, qw, qz, s, 128))
    q8, s8 = (t.cuda() for t in awq_format.quantize_w8(wq))
    xa = torch.randn(8, 4096, device="cuda", dtype=torch.bfloat16)
    res["int8_gemm_m8"] = rel_err(tq.int8_gemm(xa, q8, s8), tq.int8_gemm_ref(xa, q8, s8))
    bad = [k for k, v in res.items() if (v is False) or (isinstance(v, float) and not v < 2e-2)]
    return {"errors": res, "ok": not bad, "failed": bad}


# ------------------------------------------------------------------ engine correctness

def tiny_checkpoint() -> str:
    """A tiny random Llama saved as a real float32 checkpoint, with weights large enough (N(0, 0.08), as the
    tests use) that greedy choices are not near-ties: engines that agree must give the same tokens."""
    import transformers
    path = os.path.join(tempfile.gettempdir(), "tokenmill-gpu", "tiny-ckpt")
    if not os.path.isfile(os.path.join(path, "config.json")):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**TINY), dtype=torch.float32)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" not in name:
                    p.normal_(0, 0.08)
        model.save_pretrained(path)
    return path


def _greedy_tokens(path: str, prompts, **kw) -> list[list[int]]:
    from tokenmill import LLM, SamplingParams
    kw.setdefault("max_model_len", 1024)
    kw.setdefault("dtype", "float32")
    llm = LLM(path, skip_tokenizer_init=True, **kw)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    graphs = llm.llm_engine.core.runner.decode_step
    backend = llm.llm_engine.core.runner.backend
    info = (type(backend).__name__, getattr(backend, "failure", None), graphs is not None and graphs.enabled)
    del llm
    torch.cuda.empty_cache()
    return [o.outputs[0].token_ids for o in outs], info


@section("engine_greedy")
def engine_greedy() -> dict:
    path = tiny_checkpoint()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (1, 5, 16, 33, 100, 300, 7, 64)]
    chunked = dict(max_num_batched_tokens=64, enable_prefix_caching=True)
    torch_eager, i1 = _greedy_tokens(path, prompts, attention_backend="torch", enforce_eager=True, **chunked)
    triton_eager, i2 = _greedy_tokens(path, prompts, attention_backend="triton", enforce_eager=True, **chunked)
    triton_graphs, i3 = _greedy_tokens(path, prompts, attention_backend="triton", **chunked)
    # 40 blocks of 16 tokens cannot hold eight sequences of up to 324 tokens: preemption
    preempt, i4 = _greedy_tokens(path, prompts, attention_backend="triton", num_kv_blocks=40, max_num_seqs=8,
                                 max_model_len=400)

    # quantized linears: the Triton dequantize-GEMMs against the dequantized torch twins (same int8 codes)
    os.environ["TOKENMILL_DISABLE_TRITON_QUANT"] = "1"
    int8_twin, i5 = _greedy_tokens(path, prompts, quantization="int8", attention_backend="triton")
    del os.environ["TOKENMILL_DISABLE_TRITON_QUANT"]
    int8_triton, i6 = _greedy_tokens(path, prompts, quantization="int8", attention_backend="triton")

    def agree(a, b) -> float:
        return sum(x == y for x, y in zip(a, b)) / len(a)
    return {"triton_vs_torch": agree(triton_eager, torch_eager), "graphs_vs_eager": agree(triton_graphs, triton_eager),
            "preemption_vs_torch": agree(preempt, torch_eager), "int8_triton_vs_twin": agree(int8_triton, int8_twin),
            "backends": [i1, i2, i3, i4, i5, i6]}


# ------------------------------------------------------------------ timings on the 8B shape

@section("llama8b")
def llama8b(copy_gb_s: float, budget_s: float) -> dict:
    from tokenmill import LLM, SamplingParams
    path = model_dir(LLAMA3_8B, "llama3-8b")
    res = {}
    llm = LLM(path, load_format="dummy", dtype="bfloat16", skip_tokenizer_init=True, max_model_len=2048,
              max_num_seqs=256, gpu_memory_utilization=0.9)
    model = llm.llm_engine.core.runner.model
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = model.model.embed_tokens.weight
    read_bytes = weight_bytes - embed.numel() * embed.element_size()  # a decode step reads one embedding row
    res["kv_blocks"] = llm.llm_engine.core.runner.num_blocks
    g = torch.Generator().manual_seed(2)

    def prompts(n, length):
        return [{"prompt_token_ids": torch.randint(10, 128000, (length,), generator=g).tolist()} for _ in range(n)]

    # batch-1 decode: 256 new tokens after a 128-token prompt; per-token time from two lengths' difference
    def gen_time(n_new):
        t = time.perf_counter()
        llm.generate(prompts(1, 128), SamplingParams(temperature=0, max_tokens=n_new, ignore_eos=True), use_tqdm=False)
        return time.perf_counter() - t
    gen_time(8)
    step = (gen_time(264) - gen_time(8)) / 256
    res["decode_b1_ms"] = round(step * 1e3, 3)
    res["decode_b1_roofline_frac"] = round(read_bytes / step / (copy_gb_s * 1e9), 3)
    # prefill: 8 x 2048 tokens, one new token each
    t = time.perf_counter()
    llm.generate(prompts(8, 2048 - 1), SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    el = time.perf_counter() - t
    n_params = weight_bytes / 2
    flops = 8 * 2047 * 2 * n_params + 8 * 32 * 2 * 2 * 2047 ** 2 / 2 * 128  # linears + causal attention
    res["prefill_tflops"] = round(flops / el / 1e12, 1)
    # offline throughput, 128 + 128, high concurrency
    if time.time() - T0 < budget_s:
        n = 2048
        t = time.perf_counter()
        outs = llm.generate(prompts(n, 128), SamplingParams(temperature=0, max_tokens=128, ignore_eos=True),
                            use_tqdm=False)
        el = time.perf_counter() - t
        res["offline_128x128_output_tok_s"] = round(sum(len(o.outputs[0].token_ids) for o in outs) / el)
        res["offline_goal"] = 15000
    llm = model = None  # frees the engine (the timing closure holds its cell, not the object)
    torch.cuda.empty_cache()
    return res


@section("ladder")
def ladder(budget_s: float) -> dict:
    """Offline 128 + 128 on the 8B shape, 512 requests, one lever at a time."""
    from tokenmill import LLM, SamplingParams
    path = model_dir(LLAMA3_8B, "llama3-8b")
    rungs = [("torch backend, eager", dict(attention_backend="torch", enforce_eager=True)),
             ("triton backend, eager", dict(attention_backend="triton", enforce_eager=True)),
             ("triton + CUDA graphs", dict(attention_backend="triton"))]
    g = torch.Generator().manual_seed(3)
    reqs = [{"prompt_token_ids": torch.randint(10, 128000, (128,), generator=g).tolist()} for _ in range(512)]
    res = {}
    for name, kw in rungs:
        if time.time() - T0 > budget_s:
            res[name] = "skipped (time budget)"
            continue
        llm = LLM(path, load_format="dummy", dtype="bfloat16", skip_tokenizer_init=True, max_model_len=1024,
                  max_num_seqs=256, **kw)
        llm.generate(reqs[:4], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
        t = time.perf_counter()
        outs = llm.generate(reqs, SamplingParams(temperature=0, max_tokens=128, ignore_eos=True), use_tqdm=False)
        res[name] = round(sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t))
        del llm
        torch.cuda.empty_cache()
    base = res.get(rungs[0][0])
    if isinstance(base, (int, float)):
        res["ratios"] = {k: round(v / base, 2) for k, v in res.items() if isinstance(v, (int, float))}
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out-dir", default=os.environ.get("OUT", "benchmarks/results"))
    ap.add_argument("--budget-s", type=float, default=420, help="skip the later timings past this many seconds")
    ap.add_argument("--skip", nargs="*", default=[], help="sections to skip")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gpu_check.py needs a CUDA GPU")
    ceilings()
    copy = RESULTS["ceilings"].get("copy_gb_s", 4300.0)
    for name, fn in (("kernels", kernels), ("engine_greedy", engine_greedy)):
        if name not in args.skip:
            fn()
    if "llama8b" not in args.skip:
        llama8b(copy, args.budget_s - 120)
    if "ladder" not in args.skip:
        ladder(args.budget_s)
    RESULTS["total_seconds"] = round(time.time() - T0, 1)
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, "gpu_check.json"), "w") as f:
        json.dump(RESULTS, f, indent=1)
    print("\n== summary")
    for k, v in RESULTS.items():
        print(f"{k:16s} {json.dumps(v)[:300]}")


if __name__ == "__main__":
    main()
