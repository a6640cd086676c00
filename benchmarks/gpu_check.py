"""Everything GPU-specific in one run (issues 15, 18, 19): correctness first, then the timings. About 3 minutes
on one H200 (the whole script, 2026-12-04, before decode_profile and gemv_fusion; expect 5-6 with them).
Writes JSON (and a log) to --out-dir and prints a short table last.

    ceilings        device-to-device copy bandwidth (bytes read + written), bf16 GEMM TFLOP/s (random data)
    kernels         Triton kernels against their torch twins on CUDA (paged attention over mixed steps, GQA 1/4/7,
                    block sizes 16/32, split-KV; the KV write with -1 rows; add+RMSNorm, rotary, SiLU-and-mul;
                    the AWQ / int8 dequantize-GEMMs)
    engine_greedy   on a tiny random Llama: Triton == torch backend, CUDA graphs == eager, preemption, int8
                    Triton == twin, async scheduling == none (greedy, and seeded sampling with a penalty, logprobs
                    and stops), W8A8 on the GPU against the CPU, fused rotary + KV write == two launches,
                    folded GEMVs == plain, the int4 LM head's Triton GEMM == its twin, n-gram speculation over
                    the graphs == plain, KV tiers (host + disk) == none with tier hits, W8A8 on shapes
                    cuBLAS's int8 GEMM refuses exact
    nccl_tp1        issue 19: an NCCL group through the engine's rendezvous, a tp=1 runner through it == plain
                    (its tokens, and its KV blocks from the profile)
    multimodal      issue 18: the shipped tiny-llava on CUDA, inline / encoder thread on a side stream / int8
    mm_encoder      the LLaVA-1.5 vision tower in bf16 / int8 / W8A8, ms per image
    llama8b         Llama-3-8B shape, dummy bf16: batch-1 and batch-64 decode with and without async scheduling
                    against the bare graph replay, the host's busy time per step (1, 64, 256), batch-1 as a
                    fraction of the HBM roofline, prefill TFLOP/s, offline 128 + 128 (goal >= 15,000 tok/s;
                    TensorRT-LLM FP8 on H200: 27,911)
    decode_profile  8B shape, batch 1: graph replay with the fused rotary + KV write and without, and with the
                    GEMVs folded (ops/triton_gemv.py, TOKENMILL_TRITON_GEMV=1) (buckets 1, 64),
                    the replay's kernels by kind against its wall time, one-row GEMV bandwidth per linear,
                    the host's top functions per engine step
    gemv_fusion     ops/triton_gemv.py on the 8B layer shapes: against cuBLAS at 1 row (and a sweep of tiles)
                    and 8 rows, and add+RMSNorm / SiLU-and-mul folded into the GEMV against the small kernel
                    then cuBLAS
    ladder          torch eager -> Triton eager -> + CUDA graphs -> + async scheduling, 256 requests
    offline_scaling offline 128 + 128 with 1,024 requests at max_num_seqs 256 and 512

On the lent machine the image has torch, triton and transformers but not msgspec (nor, perhaps, xgrammar and its
apache-tvm-ffi: the constrained checks are skipped without them). Fetch their wheels here once (into .whl/,
ignored through .git/info/exclude):

    echo /.whl/ >> .git/info/exclude
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
        msgspec xgrammar apache-tvm-ffi

then one device call, with carry=[".whl"]:

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:.;
    PYTHONUNBUFFERED=1 python3 benchmarks/gpu_check.py --out-dir $OUT

Each section runs in a worker process with its own time limit (LIMITS): a failure is recorded with its
traceback, a hang dumps the stacks and ends the worker, and the driver starts another for the sections left.
`--sections` picks some; `--budget-s` skips the later ones past that many seconds.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import gc
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
OUT_DIR = [os.environ.get("OUT", "benchmarks/results")]


def section(name: str):
    def wrap(fn):
        def run(*a, **kw):
            t = time.time()
            try:
                RESULTS[name] = fn(*a, **kw)
            except Exception:  # what the section saved before failing stays, with the error
                prev = RESULTS.get(name)
                kept = prev if isinstance(prev, dict) and prev.get("partial") else {}
                RESULTS[name] = {**kept, "error": traceback.format_exc()[-4000:]}
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
                res[f"attn-{str(dtype)[6:]}-g{group}-bs{bs}"] = _attention_case(gen, mixed, 2 * group, 2, 128, bs,
                                                                                 dtype)
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
    # fused ops, in both half types (fp16 models take them too)
    for dt in (torch.bfloat16, torch.float16):
        name = str(dt)[6:]
        x = torch.randn(300, 4096, device="cuda", dtype=dt)
        r = torch.randn_like(x)
        w = torch.randn(4096, device="cuda", dtype=dt)
        out = tf.add_rmsnorm(x, r.clone(), w, 1e-5)
        h = (x + r).float()
        want = w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype)
        res[f"add_rmsnorm-{name}"] = rel_err(out, want)
        gu = torch.randn(300, 2 * 14336, device="cuda", dtype=dt)
        res[f"silu_mul-{name}"] = rel_err(tf.silu_mul(gu), torch.nn.functional.silu(gu[:, :14336].float())
                                          * gu[:, 14336:].float())
        qkv = torch.randn(300, 48 * 128, device="cuda", dtype=dt)
        pos = torch.randint(0, 4096, (300,), device="cuda")
        inv = 1.0 / (500000.0 ** (torch.arange(0, 128, 2, device="cuda").float() / 128))
        f = torch.outer(pos.float(), inv)
        cos, sin = torch.cat((f, f), -1).cos().to(dt), torch.cat((f, f), -1).sin().to(dt)
        want = apply_rotary(qkv[:, :40 * 128].view(300, 40, 128), cos, sin)
        tf.rotary_(qkv, cos, sin, 40, 128)
        res[f"rotary-{name}"] = rel_err(qkv[:, :40 * 128].view(300, 40, 128), want)
    # dequantize-GEMMs, without and with a bias (Qwen2-style qkv), through the GEMV (m <= 8) and GEMM plans
    wq = torch.randn(4096, 4096)
    qw, qz, s = (t.cuda() for t in awq_format.quantize_w4(wq, 128))
    q8, s8 = (t.cuda() for t in awq_format.quantize_w8(wq))
    for bias in (None, torch.randn(4096, device="cuda", dtype=torch.float16)):
        tag = "" if bias is None else "_bias"
        for m in (1, 64):
            xa = torch.randn(m, 4096, device="cuda", dtype=torch.float16)
            res[f"awq_gemm_m{m}{tag}"] = rel_err(tq.awq_gemm(xa, qw, qz, s, 128, bias),
                                                 tq.awq_gemm_ref(xa, qw, qz, s, 128, bias))
        b16 = None if bias is None else bias.bfloat16()
        for m in (8, 64):
            xa = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
            res[f"int8_gemm_m{m}{tag}"] = rel_err(tq.int8_gemm(xa, q8, s8, b16), tq.int8_gemm_ref(xa, q8, s8, b16))
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


@contextlib.contextmanager
def _env(name: str, value: str):
    """An environment switch for one variant, restored even when the variant raises (the sections share
    one worker process: a leftover switch would change every later figure)."""
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def _greedy_tokens(path: str, prompts, sp=None, **kw) -> list[list[int]]:
    from tokenmill import LLM, SamplingParams
    kw.setdefault("max_model_len", 1024)
    kw.setdefault("dtype", "float32")
    llm = LLM(path, skip_tokenizer_init=True, **kw)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        sp or SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    llm.llm_engine.check_invariants()
    core = llm.llm_engine.core
    graphs = core.runner.decode_step
    backend = core.runner.backend
    model = core.runner.model
    info = (type(backend).__name__, getattr(backend, "failure", None), graphs is not None and graphs.enabled,
            f"async={core.config.async_scheduling} run_ahead={core.scheduler.num_run_ahead} "
            f"deferred={core.runner.num_deferred_steps} staged={getattr(graphs, 'num_staged_steps', None)} "
            f"drafts={core.scheduler.spec.stats.num_draft_tokens if core.scheduler.spec else None} "
            f"accepted={core.scheduler.spec.stats.num_accepted_tokens if core.scheduler.spec else None} "
            f"draft_graph_runs={getattr(getattr(core.runner.proposer, 'decode_step', None), 'num_runs', None)} "
            f"draft_mirrors={len(getattr(getattr(core.runner.proposer, 'decode_step', None), '_mirrors', ()))}",
            # which variant actually ran: a silent fallback would compare plain with plain
            f"fused_rotary_kv={getattr(backend, 'fuse_rotary_kv', None)} "
            f"folded_layers={sum(bool(getattr(layer, 'folds_gemvs', False)) for layer in model.model.layers)} "
            f"lm_head_triton={getattr(model.lm_head, 'triton', None)}")
    del llm, graphs, backend, core, model
    gc.collect()
    torch.cuda.empty_cache()
    return [o.outputs[0].token_ids for o in outs], info


def _shipped_constrained(**kw) -> list[list[int]]:
    """The shipped model (it has a tokenizer) with requests whose masks the sampler makes on the device: JSON and
    regex grammars (greedy and seeded), bad words, allowed tokens; their tokens, to compare across variants."""
    from tokenmill import LLM, SamplingParams
    llm = LLM(dtype="float32", max_model_len=512, **kw)
    tok = llm.get_tokenizer()
    text = '{"name": "ROMEO", "line": "But soft"} {"name": "JULIET", "line": "O Romeo"} ROMEO:'
    schema = {"type": "object", "required": ["name", "line"], "properties": {
        "name": {"enum": ["ROMEO", "JULIET"]}, "line": {"type": "string", "maxLength": 30}}}
    sps = [SamplingParams(temperature=0, max_tokens=40, structured_outputs={"json": schema}),
           SamplingParams(temperature=0.8, seed=3, max_tokens=40,
                          structured_outputs={"regex": "[A-Z]{3,8}: [a-z ]+\\."}),
           SamplingParams(temperature=0, max_tokens=24, bad_words=["Messenger", "I"]),
           SamplingParams(temperature=0.7, seed=5, max_tokens=24, allowed_token_ids=list(range(40, 90)))]
    outs = llm.generate([{"prompt_token_ids": tok.encode(text)}] * len(sps), sps, use_tqdm=False)
    llm.llm_engine.check_invariants()
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return [o.outputs[0].token_ids for o in outs]


def _tier_round_trip(path: str, prompts) -> dict:
    """KV tiers on the GPU (host RAM and disk): each prompt alone, twice, in a pool too small to keep them all
    (20 blocks) and a host tier of a few blocks, so the second pass loads evicted prefix blocks back from both
    tiers; tokens against a run without tiers, and the hits (`tier_hits`: none would make the check vacuous)."""
    import tempfile
    from tokenmill import LLM, SamplingParams
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    res = {}
    with tempfile.TemporaryDirectory() as d:
        for name, kw in (("plain", {}), ("tiers", dict(kv_host_cache_gb=0.0002, kv_disk_cache_dir=d))):
            llm = LLM(path, skip_tokenizer_init=True, dtype="float32", max_model_len=320, num_kv_blocks=20,
                      max_num_seqs=2, enable_prefix_caching=True, **kw)
            res[name] = [llm.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)[0].outputs[0].token_ids
                         for p in prompts + prompts]
            llm.llm_engine.check_invariants()
            if kw:
                res["stats"] = llm.llm_engine.get_stats().kv_tiers
                res["tier_hits"] = sum(t.get("hit_tokens", 0) for t in res["stats"].values())
            del llm
            gc.collect()
            torch.cuda.empty_cache()
    return res


@section("engine_greedy")
def engine_greedy() -> dict:
    """Greedy (and seeded) tokens of each GPU variant against its reference, each comparison saved as soon as both
    sides ran: the section builds ~17 engines, and a time limit must not cost the checks already made."""
    path = tiny_checkpoint()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (1, 5, 16, 33, 100, 300, 7, 64)]
    chunked = dict(max_num_batched_tokens=64, enable_prefix_caching=True)
    res: dict = {"backends": []}

    def run(*args, **kw):
        tokens, info = _greedy_tokens(path, prompts, *args, **kw)
        res["backends"].append(info)
        return tokens

    def check(name: str, a, b) -> None:
        res[name] = sum(x == y for x, y in zip(a, b)) / len(a) if a else 0.0
        save_partial("engine_greedy", res)

    torch_eager = run(attention_backend="torch", enforce_eager=True, async_scheduling=False, **chunked)
    triton_eager = run(attention_backend="triton", enforce_eager=True, **chunked)
    check("triton_vs_torch", triton_eager, torch_eager)
    triton_graphs = run(attention_backend="triton", **chunked)  # async: the default
    check("graphs_vs_eager", triton_graphs, triton_eager)
    graphs_sync = run(attention_backend="triton", async_scheduling=False, **chunked)
    check("async_vs_sync_graphs", triton_graphs, graphs_sync)
    # async scheduling with seeded sampling, a penalty, logprobs, stop tokens and short max_tokens
    from tokenmill import SamplingParams
    sps = [SamplingParams(temperature=0.8, top_p=0.9, seed=11 + i, max_tokens=(3, 24)[i % 2], ignore_eos=True,
                          stop_token_ids=[7, 8, 9], repetition_penalty=1.2 if i == 3 else 1.0,
                          logprobs=2 if i == 5 else None) for i in range(len(prompts))]
    check("async_vs_sync_sampled", run(sps, attention_backend="triton", **chunked),
          run(sps, attention_backend="triton", async_scheduling=False, **chunked))
    # a draft model (the target as its own draft: drafts all but always accepted) with CUDA graphs of its own
    draft = {"method": "draft_model", "model": path, "num_speculative_tokens": 3, "adaptive": False}
    check("draft_model_graphs_vs_plain", run(attention_backend="triton", speculative_config=draft, **chunked),
          graphs_sync)
    # n-gram speculation over the decode graphs (verification rows replay in the buckets; no async with it)
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 3}
    check("ngram_spec_vs_plain_graphs", run(attention_backend="triton", speculative_config=ngram, **chunked),
          graphs_sync)
    # 40 blocks of 16 tokens cannot hold eight sequences of up to 324 tokens: preemption
    check("preemption_vs_torch", run(attention_backend="triton", num_kv_blocks=40, max_num_seqs=8, max_model_len=400),
          torch_eager)
    # rotary and the KV write as two launches (the fused launch is the default) against the fused graphs run
    with _env("TOKENMILL_DISABLE_TRITON_ROTARY_KV", "1"):
        check("fused_rotary_kv_vs_two_launch", triton_graphs, run(attention_backend="triton", **chunked))
    # ops/triton_gemv.py folded into the layers (off by default) against the plain graphs run
    with _env("TOKENMILL_TRITON_GEMV", "1"):
        check("folded_gemvs_vs_plain", run(attention_backend="triton", **chunked), triton_graphs)
    # quantized linears: the Triton dequantize-GEMMs against the dequantized torch twins (same int8 codes)
    with _env("TOKENMILL_DISABLE_TRITON_QUANT", "1"):
        int8_twin = run(quantization="int8", attention_backend="triton")
    check("int8_triton_vs_twin", run(quantization="int8", attention_backend="triton"), int8_twin)
    # the int4 LM head: the Triton AWQ GEMM against its dequantized twin (same codes)
    with _env("TOKENMILL_DISABLE_TRITON_QUANT", "1"):
        head4_twin = run(attention_backend="triton", quantize_lm_head="int4")
    check("int4_head_triton_vs_twin", run(attention_backend="triton", quantize_lm_head="int4"), head4_twin)
    # W8A8 on the GPU (cuBLAS int8 GEMM through torch._int_mm) against the same method on the CPU
    check("w8a8_gpu_vs_cpu", run(quantization="w8a8", attention_backend="triton"),
          run(quantization="w8a8", device="cpu"))
    # W8A8 where cuBLAS's int8 GEMM refuses the shape (K, N not multiples of 8): the exact float64 path
    from tokenmill.quantization.int8 import int_matmul
    gen = torch.Generator().manual_seed(3)
    a, b = (torch.randint(-127, 128, shape, generator=gen, dtype=torch.int8) for shape in ((5, 250), (37, 250)))
    res["w8a8_odd_shape_exact"] = torch.equal(int_matmul(a.cuda(), b.cuda(), False).cpu(),
                                              (a.int() @ b.int().t()).float())
    save_partial("engine_greedy", res)
    # grammar masks, bad words and allowed tokens on the device: async (the default) and n-gram drafts (grammar
    # masks per verification row) against the synchronous engine
    try:  # (xgrammar missing from the image must not cost the checks after these)
        constrained_sync = _shipped_constrained(async_scheduling=False)
        check("constrained_async_vs_sync", _shipped_constrained(), constrained_sync)
        check("constrained_ngram_vs_sync",
              _shipped_constrained(speculative_config={**ngram, "prompt_lookup_min": 1}), constrained_sync)
    except ImportError as e:
        res["constrained_checks"] = f"not run: {e}"
    try:  # last and on its own: a failure here must not cost the checks above
        tiers = _tier_round_trip(path, prompts)
    except Exception as e:
        tiers = {"tiers": [], "plain": [], "tier_hits": 0, "stats": f"{type(e).__name__}: {e}"[:500]}
    check("kv_tiers_vs_plain", tiers["tiers"], tiers["plain"])
    res.update(kv_tier_hits=tiers["tier_hits"], kv_tier_stats=tiers["stats"])
    return res


# ------------------------------------------------------------------ timings on the 8B shape

@section("nccl_tp1")
def nccl_tp1() -> dict:
    """Issue 19 on one GPU: the NCCL process group initializes through the engine's rendezvous, its collectives
    give the right values, a tp=1 runner built through the distributed path (its shard, NCCL's agree_min)
    samples the same greedy tokens as a runner built without it, and sizes its KV cache by the same profile."""
    import torch.distributed as dist
    from tokenmill.config import EngineConfig, ModelConfig
    from tokenmill.distributed.layout import ParallelLayout
    from tokenmill.distributed.rendezvous import Rendezvous, agree_min, free_port, init_rank, release_group
    from tokenmill.models.loader import load_hf_config
    from tokenmill.worker.build import build_runner
    path = tiny_checkpoint()
    mc = ModelConfig.from_hf(load_hf_config(path))
    res = {}
    t = time.time()
    shard, link, stats = init_rank(ParallelLayout(1, 1), Rendezvous("127.0.0.1", free_port("127.0.0.1"), 1, 0, 60.0,
                                                                    "cuda"), mc.num_layers)
    res["init_s"] = round(time.time() - t, 2)
    res["backend"] = dist.get_backend()
    x = torch.arange(1 << 20, device="cuda", dtype=torch.float32)
    y = x.clone()
    dist.all_reduce(y)
    res["all_reduce_ok"] = bool(torch.equal(x, y))
    res["agree_min"] = agree_min(7)

    def tokens(sh) -> list[int]:
        cfg = EngineConfig(model=path, dtype="float32", max_model_len=1024, num_kv_blocks=64, enforce_eager=True)
        cfg.resolve(mc)
        runner = build_runner(cfg, mc, torch.float32, sh) if sh is not None else build_runner(cfg, mc, torch.float32)
        step = _prompt_step([[5, 17, 300, 41, 9, 2, 77], [8] * 20, [100, 200]], 16)
        out = runner.execute(step)
        return [out.sampled_token_ids[s.request_id][0] for s in step.seqs]
    res["tp1_tokens"] = tokens(shard)
    res["plain_tokens"] = tokens(None)
    res["same_tokens"] = res["tp1_tokens"] == res["plain_tokens"]

    def profiled_blocks(*dist_args) -> int:  # the KV profile, as a TP rank runs it (with its link) and alone
        cfg = EngineConfig(model=path, dtype="float32", max_model_len=1024, enforce_eager=True)
        cfg.resolve(mc)
        n = build_runner(cfg, mc, torch.float32, *dist_args).num_blocks
        torch.cuda.empty_cache()
        return n
    res["profiled_kv_blocks_tp1"] = profiled_blocks(shard, link, agree_min)
    res["profiled_kv_blocks_plain"] = profiled_blocks()
    release_group(True)
    res["ok"] = (res["all_reduce_ok"] and res["agree_min"] == 7 and res["same_tokens"]
                 and res["profiled_kv_blocks_tp1"] == res["profiled_kv_blocks_plain"])
    return res


def _prompt_step(prompts: list[list[int]], block_size: int):
    from tokenmill.sampling_params import SamplingParams
    from tokenmill.sched.output import NewRequestData, ScheduledRequest, SchedulerOutput
    seqs, nb = [], 0
    for i, p in enumerate(prompts):
        k = -(-len(p) // block_size)
        new = NewRequestData(f"r{i}", p, [], SamplingParams(temperature=0.0, max_tokens=1), list(range(nb, nb + k)))
        nb += k
        seqs.append(ScheduledRequest(new.request_id, 0, len(p), [], 1, new_request=new))
    return SchedulerOutput(seqs=seqs, num_scheduled_tokens=sum(map(len, prompts)))


@section("multimodal")
def multimodal() -> dict:
    """Issue 18 on a GPU: the shipped tiny-llava answers its held-out set on CUDA with the model card's accuracy,
    with the encoder inline and in its thread on a side stream (overlap), and the INT8 encoder within the gate."""
    import re
    from pathlib import Path
    from tokenmill import LLM, SamplingParams
    from tokenmill.config import DEFAULT_MODEL
    from tokenmill.multimodal import synthetic
    model = str(Path(DEFAULT_MODEL).parent / "tiny-llava")
    card = re.search(r"\*\*overall\*\*[^\n]*?(\d+)/(\d+)", (Path(model) / "README.md").read_text())
    samples = synthetic.eval_samples()
    convs = []
    for smp in samples:
        frames = smp.video if smp.video is not None else smp.images
        convs.append([{"role": "user", "content": [{"type": "image", "image": f} for f in frames]
                       + [{"type": "text", "text": smp.question}]}])
    res = {"card": f"{card.group(1)}/{card.group(2)}" if card else None}
    for name, kw in (("inline", {}), ("overlap", dict(mm_encoder_overlap=True)),
                     ("int8_encoder", dict(mm_encoder_quantization="int8"))):
        llm = LLM(model, dtype="float32", device="cuda", **kw)
        t = time.perf_counter()
        outs = llm.chat(convs, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
        el = time.perf_counter() - t
        enc = llm.llm_engine.core.runner.encoder
        res[name] = {"correct": sum(synthetic.is_correct(smp, o.outputs[0].text) for smp, o in zip(samples, outs)),
                     "seconds": round(el, 2), "images_prefetched": enc.images_prefetched,
                     # async scheduling, on by default on a GPU, runs with multimodal models since session 30
                     "async": llm.llm_engine.core.config.async_scheduling,
                     "run_ahead": llm.llm_engine.core.scheduler.num_run_ahead,
                     "device": str(next(llm.llm_engine.core.runner.model.parameters()).device)}
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    want = int(card.group(1)) if card else -1
    res["ok"] = (res["inline"]["correct"] == want and res["overlap"]["correct"] == want
                 and res["int8_encoder"]["correct"] >= want - 2)
    return res


def host_busy_ms(llm, batch: int, steps: int = 100) -> float:
    """Host time per decode step with async scheduling: the step's wall time less the time it waits for the
    device (the token copy's event), over `steps` decode steps of `batch` requests."""
    from tokenmill import SamplingParams
    engine = llm.llm_engine
    g = torch.Generator().manual_seed(5)
    for i in range(batch):
        prompt = {"prompt_token_ids": torch.randint(10, 128000, (32,), generator=g).tolist()}
        engine.add_request(f"busy-{batch}-{i}", prompt,
                           SamplingParams(temperature=0, max_tokens=steps + 40, ignore_eos=True))
    for _ in range(20):  # prefills, then decodes
        engine.step()
    waited = [0.0]
    sync = torch.cuda.Event.synchronize

    def timed(ev):
        t = time.perf_counter()
        sync(ev)
        waited[0] += time.perf_counter() - t
    torch.cuda.Event.synchronize = timed
    try:
        t = time.perf_counter()
        for _ in range(steps):
            engine.step()
        wall = time.perf_counter() - t
    finally:
        torch.cuda.Event.synchronize = sync
    engine.abort_request([f"busy-{batch}-{i}" for i in range(batch)])
    _drain(engine)
    return round((wall - waited[0]) / steps * 1e3, 3)


@section("offline_scaling")
def offline_scaling(deadline: float) -> dict:
    """Offline 128 + 128 with 1,024 requests at max_num_seqs 256 and 512 (async scheduling, graphs)."""
    from tokenmill import LLM, SamplingParams
    path = model_dir(LLAMA3_8B, "llama3-8b")
    g = torch.Generator().manual_seed(4)
    reqs = [{"prompt_token_ids": torch.randint(10, 128000, (128,), generator=g).tolist()} for _ in range(1024)]
    res = {}
    for seqs in (512, 256):
        if time.time() > deadline - 40:
            res[f"max_num_seqs_{seqs}"] = "skipped (time budget)"
            continue
        t = time.perf_counter()
        llm = LLM(path, load_format="dummy", dtype="bfloat16", skip_tokenizer_init=True, max_model_len=1024,
                  max_num_seqs=seqs)
        startup = time.perf_counter() - t
        llm.generate(reqs[:4], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
        t = time.perf_counter()
        outs = llm.generate(reqs, SamplingParams(temperature=0, max_tokens=128, ignore_eos=True), use_tqdm=False)
        res[f"max_num_seqs_{seqs}"] = {"output_tok_s": round(sum(len(o.outputs[0].token_ids) for o in outs)
                                                             / (time.perf_counter() - t)),
                                       "startup_s": round(startup, 1),
                                       "kv_blocks": llm.llm_engine.core.runner.num_blocks}
        RESULTS["offline_scaling"] = dict(res)
        save(OUT_DIR[0])
        llm = None
        gc.collect()
        torch.cuda.empty_cache()
    return res


@section("mm_encoder")
def mm_encoder() -> dict:
    """Issue 18 on a GPU: the CLIP ViT-L/14-336 tower of a LLaVA-1.5-7B-shaped model (dummy weights, 24 vision
    layers, one text layer), ms per image at batch 8 (CUDA events, median of 10): bf16 against weight-only int8
    (Triton dequantize-GEMM) and W8A8 (int8 activations, torch._int_mm), with the rows' cosine to bf16's."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_multimodal import write_llava15_dir
    from tokenmill import LLM
    path = os.path.join(tempfile.gettempdir(), "tokenmill-gpu", "llava15")
    if not os.path.isfile(os.path.join(path, "config.json")):
        write_llava15_dir(path, text_layers=1, vision_layers=24)
    gen = torch.Generator().manual_seed(6)
    pixels = torch.randn(8, 3, 336, 336, generator=gen)
    res, ref = {}, None
    for name, quant in (("bf16", None), ("int8", "int8"), ("w8a8", "w8a8")):
        llm = LLM(path, dtype="bfloat16", mm_encoder_quantization=quant, load_format="dummy", max_model_len=1024,
                  num_kv_blocks=128, max_num_seqs=1, seed=0)
        model = llm.llm_engine.core.runner.model
        x = pixels.to("cuda", torch.bfloat16)
        with torch.inference_mode():
            ms = median_ms(lambda: model.encode_images(x), reps=10)
            out = model.encode_images(x).double()
        if ref is None:
            ref = out
        cos = torch.nn.functional.cosine_similarity(out.flatten(0, 1), ref.flatten(0, 1), dim=-1)
        res[name] = {"ms_per_image": round(ms / 8, 3), "cosine_vs_bf16_mean": round(cos.mean().item(), 5)}
        llm = model = None
        gc.collect()
        torch.cuda.empty_cache()
    for name in ("int8", "w8a8"):
        res[name]["speedup_vs_bf16"] = round(res["bf16"]["ms_per_image"] / res[name]["ms_per_image"], 2)
    return res


def prefill_flops(cfg: dict, seqs: int, length: int) -> float:
    """FLOPs of `seqs` prompts of `length` tokens, each sampling one token: every decoder linear on every token,
    causal attention (QK^T and PV over the lower triangle, all heads), and the LM head on one row a prompt (the
    embedding is a lookup). (The first formula counted the embedding and the head on every token, and attention
    over one head: 11 % high for the 8B shape.)"""
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    head_dim = h // heads
    per_layer = 2 * h * h + 2 * h * cfg["num_key_value_heads"] * head_dim + 3 * h * cfg["intermediate_size"]
    linears = 2 * seqs * length * cfg["num_hidden_layers"] * per_layer
    attention = seqs * cfg["num_hidden_layers"] * 2 * 2 * (length ** 2 / 2) * heads * head_dim
    return linears + attention + 2 * seqs * cfg["vocab_size"] * h


@section("llama8b")
def llama8b(copy_gb_s: float, deadline: float) -> dict:
    """Startup, batch-1 and batch-64 decode (engine step against the bare graph replay: the host's share),
    prefill TFLOP/s and offline throughput, on the 8B shape with CUDA graphs."""
    from tokenmill import LLM, SamplingParams
    path = model_dir(LLAMA3_8B, "llama3-8b")
    res = {}
    t = time.perf_counter()
    llm = LLM(path, load_format="dummy", dtype="bfloat16", skip_tokenizer_init=True, max_model_len=2048,
              max_num_seqs=256, gpu_memory_utilization=0.9)
    res["startup_s"] = round(time.perf_counter() - t, 1)
    res["async_scheduling"] = llm.llm_engine.core.config.async_scheduling
    runner = llm.llm_engine.core.runner
    model = runner.model
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = model.model.embed_tokens.weight
    read_bytes = weight_bytes - embed.numel() * embed.element_size()  # a decode step reads one embedding row
    res["kv_blocks"] = runner.num_blocks
    graphs = runner.decode_step
    res["graphs"] = None if graphs is None else (type(graphs).__name__, graphs.enabled, len(graphs.graphs))
    g = torch.Generator().manual_seed(2)

    def prompts(n, length):
        return [{"prompt_token_ids": torch.randint(10, 128000, (length,), generator=g).tolist()} for _ in range(n)]

    def step_ms(batch: int, steps: int) -> float:
        """Per decode step, from two generation lengths' difference (prefill and startup cancel)."""
        def gen(n_new):
            t = time.perf_counter()
            llm.generate(prompts(batch, 128), SamplingParams(temperature=0, max_tokens=n_new, ignore_eos=True),
                         use_tqdm=False)
            return time.perf_counter() - t
        gen(8)
        return (gen(8 + steps) - gen(8)) / steps * 1e3

    for batch, steps in ((1, 256), (64, 128)):
        ms = step_ms(batch, steps)
        res[f"decode_b{batch}_ms"] = round(ms, 3)
        llm.llm_engine.core.set_async_scheduling(False)
        res[f"decode_b{batch}_sync_ms"] = round(step_ms(batch, steps), 3)
        llm.llm_engine.core.set_async_scheduling(True)
        if graphs is not None and graphs.enabled:
            size = next(s for s in graphs.sizes if s >= batch)
            replay = median_ms(graphs.graphs[size].replay, reps=50)
            res[f"graph_replay_b{batch}_ms"] = round(replay, 3)
            # logits + sampling on the device count as host here; without the overlap, and what the overlap leaves
            res[f"host_b{batch}_ms"] = round(res[f"decode_b{batch}_sync_ms"] - replay, 3)
            res[f"exposed_host_b{batch}_ms"] = round(ms - replay, 3)
    for batch in (1, 64, 256):
        res[f"host_busy_b{batch}_ms"] = host_busy_ms(llm, batch)
    res["decode_b1_roofline_frac"] = round(read_bytes / (res["decode_b1_ms"] / 1e3) / (copy_gb_s * 1e9), 3)
    # prefill: 8 x 2048 tokens, one new token each
    llm.generate(prompts(2, 2047), SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    t = time.perf_counter()
    llm.generate(prompts(8, 2048 - 1), SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    el = time.perf_counter() - t
    res["prefill_tflops"] = round(prefill_flops(LLAMA3_8B, 8, 2047) / el / 1e12, 1)
    # offline throughput, 128 + 128, high concurrency
    if time.time() < deadline - 40:
        n = 1024
        t = time.perf_counter()
        outs = llm.generate(prompts(n, 128), SamplingParams(temperature=0, max_tokens=128, ignore_eos=True),
                            use_tqdm=False)
        el = time.perf_counter() - t
        res["offline_128x128_output_tok_s"] = round(sum(len(o.outputs[0].token_ids) for o in outs) / el)
        res["offline_requests"] = n
        res["offline_goal"] = 15000
    llm = model = runner = graphs = embed = None
    gc.collect()
    torch.cuda.empty_cache()
    return res


def _profile_kernels(fn, reps: int) -> dict:
    """fn's device kernels under torch.profiler, per call: kernel time by kind, the kernel count, the top 10."""
    from torch.profiler import ProfilerActivity, profile
    kinds = (("gemm", ("gemv", "gemm", "cutlass", "nvjet", "sm90_", "cublas")), ("attention", ("unified_attention",
             "reduce_splits")), ("rotary_kv", ("rotary",)), ("norm", ("rms",)), ("silu", ("silu",)),
             ("kv_write", ("write_kv",)))
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    by_kind, top, count = {}, [], 0
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", 0) or getattr(e, "cuda_time_total", 0)
        if us <= 0 or e.key.startswith(("cuda", "aten::", "Memcpy", "Memset")) or e.device_type.name != "CUDA":
            continue
        kind = next((k for k, keys in kinds if any(w in e.key.lower() for w in keys)), "other")
        by_kind[kind] = by_kind.get(kind, 0) + us / reps
        count += e.count
        top.append((round(us / reps, 1), e.count // reps, e.key[:90]))
    return {"kernel_us_by_kind": {k: round(v, 1) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
            "kernel_us_total": round(sum(by_kind.values()), 1), "kernels_per_call": count // reps,
            "top": sorted(top, reverse=True)[:10]}


def _drain(engine) -> None:
    """After an abort: the output side forgets aborted requests at once, while the core may still hold a step
    in flight (async scheduling) or stores landing; step the core until it holds nothing."""
    while engine.core.has_unfinished():
        engine.step()


def _sync_points(engine, params: list, steps: int = 20, late=None) -> dict:
    """Decode steps of one request per SamplingParams in `params` under torch.cuda.set_sync_debug_mode("warn"):
    the synchronizing calls per step and the lines that made them (async scheduling's one wait per step is an
    event, which it does not count). `late`: a request of 300 prompt tokens with these params joins in the
    measured window (its prefill among the decodes: sampled rows that are not consecutive)."""
    import collections
    import warnings
    tag = time.monotonic_ns()
    rids = [f"sync-{tag}-{i}" for i in range(len(params))]
    for i, (rid, sp) in enumerate(zip(rids, params)):
        engine.add_request(rid, {"prompt_token_ids": list(range(10 + i, 138 + i))}, sp)
    try:
        for _ in range(5):  # the prefill and the first decodes
            engine.step()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                for i in range(steps):
                    if late is not None and i == steps // 2:
                        rids.append(f"sync-{tag}-late")
                        engine.add_request(rids[-1], {"prompt_token_ids": list(range(20, 320))}, late)
                    engine.step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
    finally:
        engine.abort_request(rids)
        _drain(engine)
    caught = [w for w in caught if "synchroniz" in str(w.message)]  # torch: "called a synchronizing CUDA op"
    where = collections.Counter(f"{os.path.basename(w.filename)}:{w.lineno}" for w in caught)
    return {"per_step": round(len(caught) / steps, 2), "where": where.most_common(8)}


@section("decode_profile")
def decode_profile(copy_gb_s: float) -> dict:
    """Where a batch-1 decode step goes on the 8B shape (issue 15's 85 % of roofline): the graph replay at
    buckets 1, 4, 8 and 64, the replay's kernels by kind against its wall time (the gaps are launch and
    dependency bubbles), each linear's one-row GEMV bandwidth against the copy bandwidth, the host's top
    functions per engine step at batch 1; then the replays again with rotary and the KV write as two
    launches, and with the GEMVs folded (ops/triton_gemv.py)."""
    import torch.nn.functional as F
    from common import profile_top
    from tokenmill import LLM, SamplingParams
    path = model_dir(LLAMA3_8B, "llama3-8b")
    llm = LLM(path, load_format="dummy", dtype="bfloat16", skip_tokenizer_init=True, max_model_len=2048,
              max_num_seqs=64, gpu_memory_utilization=0.9)
    runner = llm.llm_engine.core.runner
    graphs, backend = runner.decode_step, runner.backend
    if graphs is None or not graphs.enabled:
        return {"error": "no CUDA graphs"}
    res = {"fused_rotary_kv": getattr(backend, "fuse_rotary_kv", None), "kv_blocks": runner.num_blocks}
    def set_context() -> None:
        """A realistic context for the replays: row r at position 255 of blocks [16 r, 16 r + 16), writing its
        slot. Set before every variant's replays: engine steps between them (the host profile, the sync probes)
        stage their own rows and leave the rest as padding (one key each), which would make a later variant
        read far less KV than the first."""
        ctx, bs, rows = 256, graphs.block_size, graphs.sizes[-1]
        per_row = ctx // bs
        if runner.num_blocks >= rows * per_row:
            graphs.block_tables[:rows, :per_row].copy_(torch.arange(rows * per_row).view(rows, per_row))
            graphs.seq_lens[:rows].fill_(ctx)
            graphs.positions[:rows].fill_(ctx - 1)
            graphs.slot_mapping[:rows].copy_(graphs.block_tables[:rows, per_row - 1].long() * bs + bs - 1)
            graphs.filled = rows
    sizes = [s for s in (1, 4, 8, 64) if s in graphs.graphs]  # the folded GEMVs take buckets up to 8

    def recapture(fold: bool | None = False) -> None:
        """The decode graphs captured again (after a switch), each layer's GEMV folding set to `fold` (None:
        decided again at the capture's warm-up)."""
        for layer in runner.model.model.layers:
            layer.folds_gemvs = fold
        graphs.graphs.clear()
        graphs.outputs.clear()
        graphs._capture_all()

    def replays(tag: str) -> None:
        set_context()
        for size in sizes:
            res[f"replay_b{size}_{tag}_ms"] = round(median_ms(graphs.graphs[size].replay, reps=50), 3)
    replays("fused" if res["fused_rotary_kv"] else "two_launch")
    res["profile_b1_replay"] = _profile_kernels(graphs.graphs[1].replay, 10)
    res["profile_b1_replay"]["replay_ms"] = round(median_ms(graphs.graphs[1].replay, reps=20), 3)
    res["profile_b1_eager"] = _profile_kernels(lambda: graphs._forward(1), 5)
    res["eager_b1_ms"] = round(median_ms(lambda: graphs._forward(1), reps=20), 3)
    def keep() -> None:
        save_partial("decode_profile", res)
    keep()
    # one-row GEMVs (cuBLAS through F.linear) over the 32 layers' own weights in turn, so that L2 holds
    # none of them (o_proj's 33.5 MB alone would fit): GB/s against the copy's
    model = runner.model
    layers = model.model.layers
    linears = {"qkv": [la.self_attn.qkv_proj.weight for la in layers],
               "o": [la.self_attn.o_proj.weight for la in layers],
               "gate_up": [la.mlp.gate_up_proj.weight for la in layers],
               "down": [la.mlp.down_proj.weight for la in layers], "lm_head": [model.lm_head.weight]}
    gemv = {}
    for name, ws in linears.items():
        x = torch.randn(1, ws[0].shape[1], dtype=ws[0].dtype, device=ws[0].device)
        calls = 64
        ms = median_ms(lambda: [F.linear(x, ws[i % len(ws)]) for i in range(calls)], reps=10) / calls
        w = ws[0]
        gb_s = w.numel() * w.element_size() / (ms / 1e3) / 1e9
        gemv[name] = {"shape": list(w.shape), "us": round(ms * 1e3, 1), "gb_s": round(gb_s),
                      "of_copy": round(gb_s / copy_gb_s, 3), "l2_resident": len(ws) == 1}
    res["gemv_1row"] = gemv
    keep()
    # the host: cProfile over 100 engine steps of one request (async scheduling, graphs)
    engine = llm.llm_engine
    engine.add_request("prof", {"prompt_token_ids": list(range(10, 138))},
                       SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    for _ in range(10):
        engine.step()
    seconds, res["host_top_b1"] = profile_top(engine.step, 100)  # us per step: own, cumulative
    res["engine_step_b1_ms_under_cprofile"] = round(seconds * 10, 3)
    engine.abort_request(["prof"])
    _drain(engine)
    # where a decode step still makes the host wait for the GPU (torch's sync debug mode): plain greedy, then a
    # seeded sample with penalties and min_tokens (the sampler's batched paths)
    sampled = SamplingParams(temperature=0.8, top_p=0.9, seed=1, repetition_penalty=1.1, presence_penalty=0.2,
                             frequency_penalty=0.1, min_tokens=50, max_tokens=200, ignore_eos=True)
    # and a mixed batch: greedy with logprobs, seeded next to unseeded samples, a prompt arriving mid-way
    mixed = [SamplingParams(temperature=0, logprobs=2, max_tokens=200, ignore_eos=True),
             SamplingParams(temperature=0.8, seed=3, max_tokens=200, ignore_eos=True),
             SamplingParams(temperature=0.8, max_tokens=200, ignore_eos=True)]
    for name, params, late in (("greedy", [SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)], None),
                               ("sampled_penalties", [sampled], None), ("mixed", mixed, mixed[0])):
        try:
            res[f"sync_points_{name}"] = _sync_points(engine, params, late=late)
        except Exception as e:
            res[f"sync_points_{name}"] = f"{type(e).__name__}: {e}"[:300]
    keep()
    if res["fused_rotary_kv"]:  # the same graphs with rotary and write_kv as two launches
        backend.fuse_rotary_kv = False
        recapture()
        replays("two_launch")
        res["kernels_per_step_two_launch"] = _profile_kernels(graphs.graphs[1].replay, 3)["kernels_per_call"]
        backend.fuse_rotary_kv = True
        recapture()
        keep()
    # ops/triton_gemv.py folded into the layers (TOKENMILL_TRITON_GEMV=1): steps of <= 8 rows (last: the
    # most compiles)
    with _env("TOKENMILL_TRITON_GEMV", "1"):
        recapture(fold=None)
        res["folded_layers"] = sum(bool(layer.folds_gemvs) for layer in layers)
        replays("folded")  # (sets the context the profile below reads too)
        res["profile_b1_folded"] = _profile_kernels(graphs.graphs[1].replay, 10)
    recapture(fold=False)
    llm = engine = runner = graphs = backend = model = layers = linears = ws = None
    gc.collect()
    torch.cuda.empty_cache()
    return res


def _graph_us(calls: list, warmup: int = 2) -> float:
    """Microseconds per call of `calls` (callables) replayed back to back from one CUDA graph: the kernels'
    own time and their in-graph gaps, as in a captured decode step, without the host's launches."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            for fn in calls:
                fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in calls:
            fn()
    us = median_ms(graph.replay, reps=20) * 1e3 / len(calls)
    del graph
    return us


@section("gemv_fusion")
def gemv_fusion(copy_gb_s: float) -> dict:
    """ops/triton_gemv.py on the 8B layer shapes: correctness at 1, 4 and 8 rows; each GEMV against cuBLAS
    (F.linear) at 1 row (the default plan and a sweep of tiles) and at 8 rows (a 16-row tl.dot tile); the
    folded prologues (add+RMSNorm into qkv and gate_up, SiLU-and-mul into down) against the small kernel
    then cuBLAS, with the plan the model uses. All in CUDA graphs over weight copies that outgrow L2. The
    saving x 32 layers is what TOKENMILL_TRITON_GEMV=1 would buy per step (decode_profile replays it)."""
    import itertools
    import torch.nn.functional as F
    from tokenmill.ops import triton_fused as tf, triton_gemv as tg
    dev, dt, g = "cuda", torch.bfloat16, torch.Generator(device="cuda").manual_seed(7)
    shapes = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
    res = {"sms": torch.cuda.get_device_properties(0).multi_processor_count, "correct": {}, "gemv": {}}

    def keep() -> None:
        save_partial("gemv_fusion", res)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, device=dev, generator=g) * scale).to(dt)

    def rel(a, b):
        return round(((a.float() - b.float()).abs().max() / b.float().abs().max()).item(), 5)

    def weights(n, k):  # > 200 MB of copies, cycled: L2 holds none of them
        copies = max(2, -(-200_000_000 // (n * k * 2)))
        ws = [rnd(n, k, scale=k ** -0.5) for _ in range(copies)]
        return [ws[i % copies] for i in range(max(16, copies))]
    for m in (1, 4, 8):
        x, r, gamma = rnd(m, 4096), rnd(m, 4096), 1 + rnd(4096, scale=0.1)
        w, wd, gu = rnd(6144, 4096, scale=4096 ** -0.5), rnd(4096, 14336, scale=14336 ** -0.5), rnd(m, 2 * 14336)
        y, r_out = tg.add_rmsnorm_gemv(x, r, gamma, 1e-5, w)
        y_ref, r_ref = tg.add_rmsnorm_gemv_ref(x, r, gamma, 1e-5, w)
        res["correct"][f"m{m}"] = {"gemv": rel(tg.gemv(x, w), tg.gemv_ref(x, w)), "norm_gemv": rel(y, y_ref),
                                   "residual_equal": torch.equal(r_out, r_ref),
                                   "silu_gemv": rel(tg.silu_mul_gemv(gu, wd), tg.silu_mul_gemv_ref(gu, wd))}
    keep()
    configs = [dict(block_n=bn, block_k=bk, num_warps=nw) for bn, bk, nw in
               itertools.product((8, 16, 32), (256, 512), (4, 8))]
    for name, (n, k) in shapes.items():
        reps = weights(n, k)
        x1, x8 = rnd(1, k), rnd(8, k)
        row = {"cublas_us": _graph_us([functools.partial(F.linear, x1, w) for w in reps]),
               "triton_us": _graph_us([functools.partial(tg.gemv, x1, w) for w in reps]),
               "cublas_m8_us": _graph_us([functools.partial(F.linear, x8, w) for w in reps]),
               "triton_m8_us": _graph_us([functools.partial(tg.gemv, x8, w) for w in reps])}
        sweep = {}
        for cfg in configs:
            key = f"{cfg['block_n']}x{cfg['block_k']}w{cfg['num_warps']}"
            try:
                sweep[key] = round(_graph_us([functools.partial(tg.gemv, x1, w, **cfg) for w in reps]), 2)
            except Exception as e:  # a tile the compiler refuses: recorded, not fatal
                sweep[key] = type(e).__name__
        timed = {key: us for key, us in sweep.items() if isinstance(us, float)}
        gb = n * k * 2 / 1e3  # bytes per us -> GB/s
        row = {key: round(us, 2) for key, us in row.items()}
        row.update({"default_plan": str(tg.plan(1, n, k, res["sms"])), "cublas_of_copy":
                    round(gb / row["cublas_us"] / copy_gb_s, 3), "triton_of_copy":
                    round(gb / row["triton_us"] / copy_gb_s, 3), "sweep_us": sweep})
        if timed:
            top = min(timed, key=timed.get)
            row.update({"best": top, "best_of_copy": round(gb / timed[top] / copy_gb_s, 3)})
        res["gemv"][name] = row
        reps = None
        keep()
    # the folded prologues (the model's plan) against their small kernel + cuBLAS, 16+ calls per graph
    h, r, gamma = rnd(1, 4096), rnd(1, 4096), 1 + rnd(4096, scale=0.1)
    r_apart = r.clone()  # add_rmsnorm updates its residual in place, as in the model
    fused = {}
    for name, prologue in (("qkv", "norm"), ("gate_up", "norm"), ("down", "silu")):
        n, k = shapes[name]
        reps = weights(n, k)
        if prologue == "norm":
            def apart(w):
                return F.linear(tf.add_rmsnorm(h, r_apart, gamma, 1e-5), w)
            together = [functools.partial(tg.add_rmsnorm_gemv, h, r, gamma, 1e-5, w) for w in reps]
        else:
            gu = rnd(1, 2 * k)

            def apart(w):
                return F.linear(tf.silu_mul(gu), w)
            together = [functools.partial(tg.silu_mul_gemv, gu, w) for w in reps]
        sep = _graph_us([functools.partial(apart, w) for w in reps])
        fus = _graph_us(together)
        fused[name] = {"apart_us": round(sep, 2), "folded_us": round(fus, 2), "saved_us": round(sep - fus, 2)}
        reps = together = None
        res["fused"] = fused
        keep()
    res["saved_per_8b_step_ms"] = round(32 * sum(v["saved_us"] for v in fused.values()) / 1e3, 3)
    torch.cuda.empty_cache()
    return res


@section("ladder")
def ladder(deadline: float) -> dict:
    """Offline 128 + 128 on the 8B shape, 256 requests, one lever at a time (the slow rung last, so that a
    time limit costs only it)."""
    from tokenmill import LLM, SamplingParams
    path = model_dir(LLAMA3_8B, "llama3-8b")
    rungs = [("triton + CUDA graphs + async scheduling", dict(attention_backend="triton", async_scheduling=True)),
             ("triton + CUDA graphs", dict(attention_backend="triton", async_scheduling=False)),
             ("triton backend, eager", dict(attention_backend="triton", enforce_eager=True, async_scheduling=False)),
             ("torch backend, eager", dict(attention_backend="torch", enforce_eager=True, async_scheduling=False))]
    g = torch.Generator().manual_seed(3)
    reqs = [{"prompt_token_ids": torch.randint(10, 128000, (128,), generator=g).tolist()} for _ in range(256)]
    res = {}
    for name, kw in rungs:
        if time.time() > deadline - 30:
            res[name] = "skipped (time budget)"
            continue
        llm = LLM(path, load_format="dummy", dtype="bfloat16", skip_tokenizer_init=True, max_model_len=1024,
                  max_num_seqs=256, **kw)
        llm.generate(reqs[:4], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
        t = time.perf_counter()
        outs = llm.generate(reqs, SamplingParams(temperature=0, max_tokens=128, ignore_eos=True), use_tqdm=False)
        res[name] = round(sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t))
        RESULTS["ladder"] = dict(res)  # kept if a later rung dies
        save(OUT_DIR[0])
        llm = None
        gc.collect()
        torch.cuda.empty_cache()
    base = res.get(rungs[-1][0])
    if isinstance(base, (int, float)):
        res["ratios_vs_torch_eager"] = {k: round(v / base, 2) for k, v in res.items() if isinstance(v, (int, float))}
    return res


SECTIONS = ("ceilings", "kernels", "engine_greedy", "nccl_tp1", "multimodal", "mm_encoder", "llama8b",
            "decode_profile", "gemv_fusion", "ladder", "offline_scaling")
# seconds each may take before the worker dumps its stacks and exits (a hang must not eat the lease), and
# the least time left that a section needs to be worth starting
LIMITS = {"ceilings": 60, "kernels": 150, "engine_greedy": 240, "nccl_tp1": 60, "multimodal": 90, "llama8b": 200,
          "ladder": 180, "offline_scaling": 150, "mm_encoder": 90, "decode_profile": 200,
          "gemv_fusion": 150}
NEEDS = {"llama8b": 60, "ladder": 60, "offline_scaling": 60, "decode_profile": 120, "gemv_fusion": 90}


def save(out_dir: str) -> None:
    """Written whole or not at all: a section past its limit kills the worker at any moment, and a file cut off
    mid-write would lose every result."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "gpu_check.json")
    with open(path + ".tmp", "w") as f:
        json.dump(RESULTS, f, indent=1)
    os.replace(path + ".tmp", path)


def save_partial(name: str, res: dict) -> None:
    """What a section has measured so far, on disk: it survives a later phase's failure or time limit (the
    section wrapper keeps it, with the error, when the section raises)."""
    RESULTS[name] = dict(res, partial=True)
    save(OUT_DIR[0])


def worker(args) -> None:
    """Runs the sections in order, saving after each; a section past its limit kills this process (the
    driver starts another for the rest)."""
    import faulthandler
    OUT_DIR[0] = args.out_dir
    path = os.path.join(args.out_dir, "gpu_check.json")
    if os.path.isfile(path):
        with open(path) as f:
            RESULTS.update(json.load(f))
    deadline = T0 + args.budget_s
    for name in args.sections:
        left = deadline - time.time()
        if left < NEEDS.get(name, 20):
            RESULTS[name] = {"skipped": f"time budget ({left:.0f} s left)"}
            save(args.out_dir)
            continue
        gc.collect()  # what an earlier section left behind must not shrink this one's KV cache
        torch.cuda.empty_cache()
        RESULTS[name] = {"error": "running (the worker died or hit its limit here; see the log)"}
        save(args.out_dir)
        faulthandler.dump_traceback_later(min(LIMITS[name], max(left, 10)), exit=True)
        copy_gb_s = RESULTS.get("ceilings", {}).get("copy_gb_s") or float("nan")  # (the driver ran it first)
        if name == "llama8b":
            llama8b(copy_gb_s, deadline - 90)
        elif name in ("decode_profile", "gemv_fusion"):
            globals()[name](copy_gb_s)
        elif name in ("ladder", "offline_scaling"):
            globals()[name](deadline)
        else:
            globals()[name]()
        faulthandler.cancel_dump_traceback_later()
        save(args.out_dir)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out-dir", default=os.environ.get("OUT", "benchmarks/results"))
    ap.add_argument("--budget-s", type=float, default=420, help="skip later sections past this many seconds")
    ap.add_argument("--sections", nargs="*", default=list(SECTIONS), choices=SECTIONS, metavar="SECTION",
                    help=f"any of {', '.join(SECTIONS)} (ceilings runs first where a section needs its copy rate)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gpu_check.py needs a CUDA GPU")
    if args.worker:
        worker(args)
        return
    import subprocess
    path = os.path.join(args.out_dir, "gpu_check.json")
    if os.path.isfile(path):
        os.remove(path)
    todo = list(args.sections)
    if "ceilings" not in todo and set(todo) & {"llama8b", "decode_profile", "gemv_fusion"}:
        todo.insert(0, "ceilings")  # their roofline fractions divide by its measured copy rate, never a guess
    while todo:
        left = args.budget_s - (time.time() - T0)
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--out-dir", args.out_dir, "--budget-s",
               str(max(left, 1)), "--sections", *todo]
        subprocess.run(cmd)
        RESULTS.clear()
        with open(path) as f:
            RESULTS.update(json.load(f))
        # the section that was running when the worker died is recorded as such; go on after it
        todo = [s for s in todo if s not in RESULTS]
        if todo and time.time() - T0 > args.budget_s:
            for s in todo:
                RESULTS[s] = {"skipped": "time budget"}
            break
    RESULTS["total_seconds"] = round(time.time() - T0, 1)
    save(args.out_dir)
    print("\n== summary")
    for k, v in RESULTS.items():
        print(f"{k:14s} {json.dumps(v)[:700]}")


if __name__ == "__main__":
    main()
