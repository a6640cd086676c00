"""CPU kernels against their pure-torch twins, and the engine through them against the plain path."""
import pytest
import torch
import torch.nn.functional as F

from tokenmill import SamplingParams
from tokenmill.ops import cpu_gemv
from conftest import make_llm, random_prompts

needs_gemv = pytest.mark.skipif(not cpu_gemv.available(), reason="needs an AVX512-BF16 CPU and gcc")


@needs_gemv
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n,k,bias", [(16, 2, False), (64, 70, True), (4864, 896, False), (1152, 896, True)])
def test_gemv_matches_linear(n, k, bias, dtype):
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g).to(dtype)
    x = torch.randn(1, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    y = cpu_gemv.gemv(x, cpu_gemv.pack(w), b)
    assert y.dtype == dtype and y.shape == (1, n)
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    if dtype == torch.bfloat16:  # float32 accumulation, one bfloat16 rounding at the end
        torch.testing.assert_close(y.double(), ref, rtol=8e-3, atol=1e-3)
    else:
        torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-4)


def test_gemv_refuses_shapes_it_cannot_pack():
    assert not cpu_gemv.supports(torch.zeros(17, 8, dtype=torch.bfloat16))
    assert not cpu_gemv.supports(torch.zeros(16, 7, dtype=torch.bfloat16))
    assert not cpu_gemv.supports(torch.zeros(17, 8, dtype=torch.float32))
    assert not cpu_gemv.supports(torch.zeros(16, 8, dtype=torch.float16))
    assert cpu_gemv.supports(torch.zeros(16, 7, dtype=torch.float32))  # no k pairs in float32


@pytest.mark.parametrize("kernel", ["onednn", "torch"] + (["onednn+gemv"] if cpu_gemv.available() else []))
def test_linear_kernels_give_the_same_greedy_tokens(model_dirs, kernel):
    path, _ = model_dirs["qwen2"]  # q/k/v bias exercises the bias path
    prompts = random_prompts([1, 9, 30], seed=40)
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    # bfloat16: the GEMV kernel only serves bf16; compare with the plain F.linear path at the same dtype
    ref = make_llm(path, dtype="bfloat16", cpu_linear_kernel="torch").generate(
        [{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    out = make_llm(path, dtype="bfloat16", cpu_linear_kernel=kernel).generate(
        [{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    agree = [sum(a == b for a, b in zip(r.outputs[0].token_ids, o.outputs[0].token_ids)) for r, o in zip(ref, out)]
    # bfloat16 kernels round differently, so allow a late divergence but not an early one
    for r, o in zip(ref, out):
        assert r.outputs[0].token_ids[:4] == o.outputs[0].token_ids[:4]
    assert sum(agree) >= 0.75 * 12 * len(prompts)


@needs_gemv
def test_float32_gemv_gives_the_same_greedy_tokens(model_dirs):
    path, _ = model_dirs["qwen2"]
    prompts = random_prompts([1, 9, 30], seed=41)
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ref = make_llm(path, dtype="float32", cpu_linear_kernel="torch").generate(
        [{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    llm = make_llm(path, dtype="float32", cpu_linear_kernel="onednn+gemv")
    assert any(m.gemv_packed is not None for m in llm.llm_engine.core.runner.model.modules() if hasattr(m, "gemv_packed"))
    out = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == [r.outputs[0].token_ids for r in ref]
