"""Quantized engines against references that share their dequantized weights: AutoAWQ checkpoints
packed by autoawq itself, load-time int8, and W8A8, each through both CPU kernel paths."""
import argparse
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from tokenmill import SamplingParams
from tokenmill.ops import cpu_qgemm_amx, native
from tokenmill.quantization import int8 as int8_module
from awq_oracle import autoawq_linear_class, write_autoawq_checkpoint
from conftest import build_model, hf_greedy, make_llm, random_prompts
from tokenmill.config import DEFAULT_MODEL, EngineConfig
from tokenmill.engine.arg_utils import add_engine_args

pytestmark = pytest.mark.skipif(autoawq_linear_class() is None, reason="autoawq is a test dependency")
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
KERNELS = ["auto", "torch"]  # auto: torch's packed int4/int8 CPU kernels; torch: the dequantizing twins


def generate(llm, prompts, params=GREEDY):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def awq_dirs(tmp_path_factory):
    """arch -> (AutoAWQ checkpoint, transformers model on its dequantized weights)."""
    out = {}
    for arch, group in (("llama", 32), ("qwen2", 64)):  # qwen2 has q/k/v bias and tied embeddings
        root = tmp_path_factory.mktemp(f"awq-{arch}")
        build_model(str(root / "float"), arch, seed=3)
        float_dir = write_autoawq_checkpoint(str(root / "float"), str(root / "awq"), group)
        out[arch] = (str(root / "awq"), AutoModelForCausalLM.from_pretrained(float_dir, dtype=torch.float32).eval())
    return out


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_autoawq_checkpoint_matches_transformers_on_dequantized_weights(awq_dirs, arch, kernel):
    path, hf = awq_dirs[arch]
    llm = make_llm(path, cpu_linear_kernel=kernel)  # quantization detected from config.json
    assert llm.llm_engine.config.quantization == "awq"
    prompts = random_prompts([1, 9, 16, 37], seed=4)
    for p, toks in zip(prompts, generate(llm, prompts)):
        assert toks == hf_greedy(hf, p, 16), f"prompt length {len(p)}"


def test_awq_prompt_logprobs_close_to_transformers(awq_dirs):
    path, hf = awq_dirs["llama"]
    llm = make_llm(path, quantization="awq")
    p = random_prompts([30], seed=5)[0]
    out = llm.generate([{"prompt_token_ids": p}], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    with torch.no_grad():
        ref = hf(torch.tensor([p])).logits[0].float().log_softmax(-1)
    ours = torch.tensor([out.prompt_logprobs[i][p[i]].logprob for i in range(1, len(p))])
    torch.testing.assert_close(ours, ref[torch.arange(len(p) - 1), torch.tensor(p[1:])], atol=1e-4, rtol=1e-4)


def test_awq_same_tokens_with_chunked_prefill_prefix_hits_and_preemption(awq_dirs):
    path, hf = awq_dirs["llama"]
    shared = random_prompts([40], seed=6)[0]
    prompts = [shared + tail for tail in random_prompts([3, 11, 20, 5], seed=7)]
    expected = [hf_greedy(hf, p, 16) for p in prompts]
    chunked = make_llm(path, max_num_batched_tokens=16)  # 16-token chunks split every prompt
    assert generate(chunked, prompts) == expected
    assert generate(chunked, prompts) == expected  # again, now from the prefix cache
    assert chunked.llm_engine.get_stats().prefix_cache_hits > 0
    distinct = random_prompts([30, 41, 25, 36], seed=10)
    # at most 57 tokens (4 blocks) each; 10 blocks cannot hold all four at once: preemption
    small = make_llm(path, num_kv_blocks=10, max_model_len=64)
    assert generate(small, distinct) == [hf_greedy(hf, p, 16) for p in distinct]
    assert small.llm_engine.get_stats().num_preemptions > 0
    chunked.llm_engine.check_invariants()
    small.llm_engine.check_invariants()


def int8_reference(src: str, dst: str, lm_head: bool = False):
    """The float model int8 weight-only means: per-output-channel symmetric, fp16 scales, written out."""
    sd = load_file(os.path.join(src, "model.safetensors"))
    for name, t in sd.items():
        if name.endswith("_proj.weight") or (lm_head and name == "lm_head.weight"):
            s = (t.abs().amax(-1, keepdim=True) / 127).half().float()
            sd[name] = (t / s).round().clamp(-127, 127) * s
    os.makedirs(dst, exist_ok=True)
    for f in os.listdir(src):
        if f != "model.safetensors":
            with open(os.path.join(src, f), "rb") as a, open(os.path.join(dst, f), "wb") as b:
                b.write(a.read())
    save_file(sd, os.path.join(dst, "model.safetensors"))
    return AutoModelForCausalLM.from_pretrained(dst, dtype=torch.float32).eval()


@pytest.mark.parametrize("kernel", KERNELS)
def test_int8_weight_only_matches_transformers_on_dequantized_weights(model_dirs, tmp_path, kernel):
    path, _ = model_dirs["llama"]
    hf = int8_reference(path, str(tmp_path / "int8-float"))
    llm = make_llm(path, quantization="int8", cpu_linear_kernel=kernel)
    prompts = random_prompts([1, 13, 29], seed=8)
    for p, toks in zip(prompts, generate(llm, prompts)):
        assert toks == hf_greedy(hf, p, 16)


@pytest.mark.parametrize("fmt", ["int8", "awq"])
def test_weight_only_decode_batches_above_eight_rows_match_transformers(model_dirs, awq_dirs, tmp_path, fmt):
    """20 sequences decode together: the few-row kernels take them in chunks of at most 8 rows (up to 32 rows
    per layer call, and through the one-call decode step), never the dequantizing path."""
    if fmt == "awq":
        path, hf = awq_dirs["llama"]
        llm = make_llm(path, max_num_seqs=32)
    else:
        path, _ = model_dirs["llama"]
        hf = int8_reference(path, str(tmp_path / "int8-float"))
        llm = make_llm(path, quantization="int8", max_num_seqs=32)
    prompts = random_prompts([3 + 2 * i for i in range(20)], seed=12)
    # min_tokens, as hf_greedy's min_new_tokens: one of these prompts has EOS as its argmax
    params = SamplingParams(temperature=0, max_tokens=16, min_tokens=16)
    for p, toks in zip(prompts, generate(llm, prompts, params)):
        assert toks == hf_greedy(hf, p, 16), f"prompt length {len(p)}"


def rtn4_groups(w: torch.Tensor, group: int) -> torch.Tensor:
    """Round-to-nearest 4-bit with zero points per group of `group` inputs, as the format describes it: scale
    (max - min) / 15 rounded to fp16, zero round(-min / scale) in 0..15, W = (q - zero) scale."""
    g = w.float().view(w.shape[0], -1, group)
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    s = ((hi - lo).clamp(min=1e-5) / 15).half().float()
    z = (-lo / s).round().clamp(0, 15)
    return (((g / s + z).round().clamp(0, 15) - z) * s).view_as(w)


@pytest.mark.parametrize("quantization,head", [(None, "int8"), ("int8", "int8"), (None, "int4")])
def test_quantized_lm_head_matches_its_dequantized_reference(model_dirs, tmp_path, quantization, head):
    path, _ = model_dirs["llama"]  # an untied LM head
    ref_dir = str(tmp_path / "ref")
    ref = int8_reference(path, ref_dir, lm_head=head == "int8")
    if quantization is None:  # only the head is quantized
        sd = load_file(os.path.join(ref_dir, "model.safetensors"))
        orig = load_file(os.path.join(path, "model.safetensors"))
        sd = {k: (v if k == "lm_head.weight" else orig[k]) for k, v in sd.items()}
        if head == "int4":
            sd["lm_head.weight"] = rtn4_groups(orig["lm_head.weight"], 64)  # hidden size 64: groups of 64
        save_file(sd, os.path.join(ref_dir, "model.safetensors"))
        ref = AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32).eval()
    llm = make_llm(path, quantization=quantization, quantize_lm_head=head)
    prompts = random_prompts([6, 19], seed=11)
    p = prompts[1]
    out = llm.generate([{"prompt_token_ids": p}], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    with torch.no_grad():
        expected = ref(torch.tensor([p])).logits[0].float().log_softmax(-1)
    ours = torch.tensor([out.prompt_logprobs[i][p[i]].logprob for i in range(1, len(p))])
    torch.testing.assert_close(ours, expected[torch.arange(len(p) - 1), torch.tensor(p[1:])], atol=1e-4, rtol=1e-4)
    for q, toks in zip(prompts, generate(llm, prompts)):
        assert toks == hf_greedy(ref, q, 16)


def test_lm_head_option_spellings(model_dirs):
    path, _ = model_dirs["llama"]
    assert EngineConfig(model=path, quantize_lm_head=True).quantize_lm_head == "int8"  # the older boolean form
    assert EngineConfig(model=path, quantize_lm_head=False).quantize_lm_head is None
    with pytest.raises(ValueError, match="quantize_lm_head must be one of"):
        EngineConfig(model=path, quantize_lm_head="int3")
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert parser.parse_args(["--quantize-lm-head"]).quantize_lm_head == "int8"
    assert parser.parse_args(["--quantize-lm-head", "int4"]).quantize_lm_head == "int4"
    assert parser.parse_args([]).quantize_lm_head is None


@pytest.mark.parametrize("head", [False, True])
def test_w8a8_kernel_matches_its_twin_and_stays_close_to_float(model_dirs, head):
    path, hf = model_dirs["llama"]
    prompts = random_prompts([5, 21, 40], seed=9)
    runs = {k: make_llm(path, quantization="w8a8", cpu_linear_kernel=k, quantize_lm_head=head) for k in KERNELS}
    # int32 accumulation is exact in both, so the VNNI kernel and the twin agree token for token
    assert generate(runs["auto"], prompts) == generate(runs["torch"], prompts)
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    out = runs["auto"].generate([{"prompt_token_ids": prompts[2]}], params, use_tqdm=False)[0]
    p = prompts[2]
    with torch.no_grad():
        ref = hf(torch.tensor([p])).logits[0].float().log_softmax(-1)
    ours = torch.tensor([out.prompt_logprobs[i][p[i]].logprob for i in range(1, len(p))])
    expected = ref[torch.arange(len(p) - 1), torch.tensor(p[1:])]
    assert (ours - expected).abs().max() < 0.1  # lossy, but close
    assert (ours - expected).abs().max() > 0  # and really quantized


@pytest.mark.parametrize("m,k,n", [(3, 37, 11), (5, 8191, 3)])
def test_int_matmul_without_int32_is_exact(monkeypatch, m, k, n):
    """The GPU's path for shapes cuBLAS's int8 GEMM refuses (K or N not a multiple of 8): float64 products, as
    float32 equal to the int32 matmul's, sums of odd products past float32's 2^24 included (127 x -127, K times;
    both round the same exact integer; the shapes and the branch are what this reaches on a CPU)."""
    g = torch.Generator().manual_seed(0)
    xq = torch.randint(-128, 128, (m, k), dtype=torch.int8, generator=g)
    q = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
    xq[0], q[0] = 127, -127
    want = int8_module.int_matmul(xq, q, use_int_mm=False)
    monkeypatch.setattr(int8_module, "NO_INT32_MATMUL", {"cpu", "cuda"})
    got = int8_module.int_matmul(xq, q, use_int_mm=False)
    assert got.dtype == torch.float32 and want.dtype == torch.int32
    assert torch.equal(got, want.float()) and got[0, 0] == -127 * 127 * k


def set_quant_config(path: str, **changes) -> None:
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"].update(changes)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)


@pytest.mark.parametrize("changes, message", [
    (dict(bits=3), "3-bit weights is not supported"),
    (dict(version="gemv"), "version 'gemv' is not supported"),
    (dict(group_size=100), "group_size 100 is not supported"),
    (dict(bits=8), "8-bit AWQ needs version 'tokenmill-w8'"),
    (dict(quant_method="gptq"), "'gptq' is not supported"),
    (dict(group_size=128), "model.layers.0.self_attn.qkv_proj: input size 64 is not a multiple of the AWQ group size"),
])
def test_bad_awq_config_fails_before_loading(awq_dirs, tmp_path, changes, message):
    import shutil

    path = str(tmp_path / "bad")
    shutil.copytree(awq_dirs["llama"][0], path)
    set_quant_config(path, **changes)
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        make_llm(path)


@pytest.mark.parametrize("tensor", ["layers.1.mlp.down_proj.qzeros", "layers.0.self_attn.k_proj.qzeros",
                                    "layers.1.mlp.up_proj.scales"])
def test_awq_checkpoint_missing_qzeros_names_the_tensor(model_dirs, tmp_path, tensor):
    """A piece of a merged projection (k of q/k/v, up of gate/up) too: its rows were left as torch.empty."""
    src = model_dirs["llama"][0]
    write_autoawq_checkpoint(src, str(tmp_path / "awq"), 32, drop=(tensor,))
    with pytest.raises(ValueError, match=r"missing weights: model\." + tensor.replace(".", r"\.")):
        make_llm(str(tmp_path / "awq"))


@pytest.mark.parametrize("keep", [("model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj",
                                   "model.layers.0.self_attn.v_proj"), ("gate_proj", "up_proj"), ("mlp",)])
def test_modules_kept_in_float_by_their_checkpoint_names(model_dirs, tmp_path, keep):
    """modules_to_not_convert as AutoAWQ and transformers write it, with the checkpoint's projection names: the
    merged layer holding them runs in float (they failed to load); the tokens are transformers' on the same
    weights. Naming some parts of a merged layer but not all is refused by name."""
    float_dir = write_autoawq_checkpoint(model_dirs["llama"][0], str(tmp_path / "awq"), 32, keep_float=keep)
    hf = AutoModelForCausalLM.from_pretrained(float_dir, dtype=torch.float32).eval()
    prompts = random_prompts([3, 20], seed=6)
    for p, toks in zip(prompts, generate(make_llm(str(tmp_path / "awq")), prompts)):
        assert toks == hf_greedy(hf, p, 16)


def test_modules_kept_in_float_must_cover_a_merged_layer(model_dirs, tmp_path):
    write_autoawq_checkpoint(model_dirs["llama"][0], str(tmp_path / "awq"), 32, keep_float=("k_proj",))
    with pytest.raises(ValueError, match="keeps k_proj of model.layers.0.self_attn.qkv_proj unquantized but not"):
        make_llm(str(tmp_path / "awq"))


def test_awq_settings_kept_where_older_tools_keep_them(awq_dirs, tmp_path):
    """AutoAWQ's older layout (quant_config.json beside a config.json without quantization_config) loads as
    the same checkpoint; a null `bits` defers to AutoAWQ's `w_bit`; llm-compressor's older compression_config
    and AutoGPTQ's quantize_config.json are refused by name (their int8 / packed tensors were read as float
    weights, or failed on a tensor name)."""
    import shutil

    src = awq_dirs["llama"][0]
    want = generate(make_llm(src), random_prompts([9], seed=7))
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    settings = cfg.pop("quantization_config")
    for name, extra, quant_file in (("old", {}, ("quant_config.json", {k: v for k, v in settings.items()
                                                                      if k != "quant_method"})),
                                    ("nulls", {"quantization_config": {**settings, "bits": None, "w_bit": 4}}, None),
                                    ("ct", {"compression_config": {"quant_method": "compressed-tensors"}}, None),
                                    ("gptq", {}, ("quantize_config.json", {"bits": 4, "group_size": 32}))):
        path = str(tmp_path / name)
        shutil.copytree(src, path)
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump({**cfg, **extra}, f)
        if quant_file is not None:
            with open(os.path.join(path, quant_file[0]), "w") as f:
                json.dump(quant_file[1], f)
        if name in ("old", "nulls"):
            assert generate(make_llm(path), random_prompts([9], seed=7)) == want
        else:
            with pytest.raises(ValueError, match="'compressed-tensors' is not supported" if name == "ct"
                               else "'gptq' is not supported"):
                make_llm(path)


def test_awq_on_a_float_checkpoint_says_to_quantize(llama_dir):
    with pytest.raises(ValueError, match="tokenmill quantize"):
        make_llm(llama_dir, quantization="awq")


def test_int8_on_an_awq_checkpoint_is_refused(awq_dirs):
    with pytest.raises(ValueError, match="needs a float checkpoint"):
        make_llm(awq_dirs["llama"][0], quantization="int8")


def test_unknown_quantization_is_refused(llama_dir):
    with pytest.raises(ValueError, match="quantization must be one of"):
        make_llm(llama_dir, quantization="fp4")


@pytest.fixture(scope="module")
def shipped_awq(tmp_path_factory):
    """The shipped (trained) model as a round-to-nearest AutoAWQ checkpoint, group 64."""
    dst = str(tmp_path_factory.mktemp("shipped-awq") / "awq")
    write_autoawq_checkpoint(DEFAULT_MODEL, dst, 64)
    return dst


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.mark.skipif(not cpu_qgemm_amx.available(), reason="needs a CPU with AMX-BF16")
@pytest.mark.parametrize("fmt", ["int8", "awq"])
def test_bfloat16_weight_only_steps_above_four_rows_take_amx_at_least_as_exact(shipped_awq, monkeypatch, fmt):
    """bfloat16 prefills and decode batches of more than 4 rows go through the AMX GEMM (ops/cpu_qgemm_amx.c),
    which reads the panels as stored and scales each group's product in float32; the path it replaces rounded
    the dequantized weight to bfloat16 first. The two round differently, so neither gives float32's greedy
    tokens on every prompt (random-token prompts leave near-ties); the AMX path must follow the float32 engine
    (the same quantized weights, float32 math) at least as far as the dequantizing path does, with prompt
    logprobs as close. The kernel itself is checked against its twin in tests/test_cpu_qgemm_amx.py."""
    path, kw = (shipped_awq, {}) if fmt == "awq" else (DEFAULT_MODEL, {"quantization": "int8"})
    prompts = random_prompts([3 + 5 * i for i in range(12)], seed=21, vocab=4096)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, prompt_logprobs=0)
    kernel = "gemm_int4" if fmt == "awq" else "gemm_int8"
    calls = []
    real = getattr(cpu_qgemm_amx, kernel)
    monkeypatch.setattr(cpu_qgemm_amx, kernel, lambda x, *a: calls.append(x.shape[0]) or real(x, *a))

    def run(dtype):
        outs = make_llm(path, dtype=dtype, max_num_seqs=16, **kw).generate(
            [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        logprobs = torch.cat([torch.tensor([o.prompt_logprobs[i][p[i]].logprob for i in range(1, len(p))])
                              for o, p in zip(outs, prompts)])
        return [o.outputs[0].token_ids for o in outs], logprobs

    ref_tokens, ref_lp = run("float32")
    assert not calls
    amx_tokens, amx_lp = run("bfloat16")
    assert calls and min(calls) <= 16 < max(calls)  # decode batches of 12 rows and the prefill
    monkeypatch.setattr(int8_module, "amx_rows_kernel", lambda *a, **k: False)  # AWQ's choice goes through it too
    calls.clear()
    plain_tokens, plain_lp = run("bfloat16")
    assert not calls
    followed = [sum(map(common_prefix, tokens, ref_tokens)) for tokens in (amx_tokens, plain_tokens)]
    assert followed[0] >= followed[1], followed
    err_amx, err_plain = (amx_lp - ref_lp).abs(), (plain_lp - ref_lp).abs()
    assert err_amx.mean() <= 1.25 * err_plain.mean() + 1e-3 and err_amx.max() < 0.25, (err_amx, err_plain)


@pytest.mark.parametrize("cpu", ["avx2", "avx512"])
def test_bfloat16_awq_prefill_takes_the_int4_kernels_in_chunks(shipped_awq, monkeypatch, cpu):
    """Where torch has no fast bf16 GEMM (AVX2), and with AVX-512 without the AMX GEMM, AWQ layers take prefill
    chunks of up to INT4_AVX2_KERNEL_ROWS / INT4_AVX512_KERNEL_ROWS rows through the int4 kernels, 8 rows per
    weight pass, instead of dequantizing the weight per call. AVX2's rule is forced here on any CPU (the kernels
    exist everywhere): the long prompts must reach the kernels with more than 64 rows, and the engine must follow
    the float32 engine (the same quantized weights, float32 math) as far as the dequantizing path does, with
    prompt logprobs as close."""
    from tokenmill.layers import linear as linear_module
    from tokenmill.ops import cpu_qgemv

    if cpu == "avx2":
        monkeypatch.setattr(linear_module, "slow_bf16_gemm", lambda: True)
    elif "avx512f" not in native.cpu_flags() or linear_module.slow_bf16_gemm():
        pytest.skip("needs AVX-512 and torch's fast bf16 GEMM")
    limit = "INT4_AVX2_KERNEL_ROWS" if cpu == "avx2" else "INT4_AVX512_KERNEL_ROWS"
    monkeypatch.setattr(int8_module, "amx_rows_kernel", lambda *a, **k: False)
    prompts = random_prompts([70 + 9 * i for i in range(6)] + [3, 11], seed=23, vocab=4096)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, prompt_logprobs=0)
    calls = []
    real = cpu_qgemv.gemv_int4
    monkeypatch.setattr(cpu_qgemv, "gemv_int4", lambda x, *a, **k: calls.append(x.shape[0]) or real(x, *a, **k))

    def run(dtype):
        outs = make_llm(shipped_awq, dtype=dtype, max_num_seqs=8, max_num_batched_tokens=256).generate(
            [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        logprobs = torch.cat([torch.tensor([o.prompt_logprobs[i][p[i]].logprob for i in range(1, len(p))])
                              for o, p in zip(outs, prompts)])
        return [o.outputs[0].token_ids for o in outs], logprobs

    ref_tokens, ref_lp = run("float32")
    calls.clear()
    kernel_tokens, kernel_lp = run("bfloat16")
    assert max(calls) > 64, sorted(set(calls))
    monkeypatch.setattr(linear_module, limit, 64)
    calls.clear()
    dequant_tokens, dequant_lp = run("bfloat16")
    assert all(c <= 64 for c in calls), calls
    followed = [sum(map(common_prefix, tokens, ref_tokens)) for tokens in (kernel_tokens, dequant_tokens)]
    # one near-tie in bfloat16 turns a whole prompt's greedy tokens (the portable build's kernel followed 85 of 96
    # against dequantizing's 96, with the closer prompt logprobs); the teacher-forced logprobs below, which do
    # not cascade, carry the accuracy check
    assert followed[0] >= followed[1] - params.max_tokens, followed
    err_kernel, err_dequant = (kernel_lp - ref_lp).abs(), (dequant_lp - ref_lp).abs()
    assert err_kernel.mean() <= 1.25 * err_dequant.mean() + 1e-3 and err_kernel.max() < 0.25, (err_kernel, err_dequant)


def test_int4_lm_head_takes_groups_of_32_where_64_does_not_divide():
    from tokenmill.layers.linear import ColumnParallelLinear
    from tokenmill.quantization.awq import Int4LinearMethod
    from tokenmill.quantization.registry import LM_HEAD_INT4_GROUPS

    sizes = {}
    for k in (128, 96):
        method = Int4LinearMethod(LM_HEAD_INT4_GROUPS)
        ColumnParallelLinear(k, 64, method=method, prefix="lm_head")
        sizes[k] = method.group_size
    assert sizes == {128: 64, 96: 32}
    with pytest.raises(ValueError, match="lm_head: input size 80 is not a multiple of the AWQ group size 32"):
        ColumnParallelLinear(80, 64, method=Int4LinearMethod(LM_HEAD_INT4_GROUPS), prefix="lm_head")
