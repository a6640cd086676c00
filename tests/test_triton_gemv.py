"""Decode-row GEMVs with fused prologues (ops/triton_gemv.py) against their pure-torch twins, and the twins
against the layers they stand for (layers/norm.py's RMSNorm, layers/activation.py's SiLU-and-mul, F.linear).

Kernel cases run in a child process under Triton's interpreter, and a second child compiles the kernel for
sm_90 (tests/triton_child.py says why). A case passes when the kernel is within `tol` of its twin (relative
to max |y|) and at least 10 x tol away from each mutant twin: output columns shifted by one, the bias left
out, the norm without the residual, without its weight, or without normalizing, SiLU on the up half. The
inputs stay bit-identical, and the new residual equals the twin's x + residual (to one ulp where the
interpreter truncates).
"""
from __future__ import annotations

import functools
import sys

import pytest
import torch
import torch.nn.functional as F

from tokenmill.layers.activation import silu_and_mul
from tokenmill.layers.norm import RMSNorm
from tokenmill.ops import triton_gemv as tg
from tokenmill.ops.failure_latch import FailureLatch
from triton_child import (TRITON_TYPES, assert_compiled, assert_near_twin, compile_for_sm90, kernel_fixtures,
                          needs_triton, run_jobs)

# relative to max |y|; bfloat16 absorbs the interpreter's fp32 -> bf16 casts, which truncate (a GPU rounds
# to nearest), in the norm's and SiLU's intermediates
TOL = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 2.5e-2}
MUTANT_MARGIN = 10
EPS = 1e-5

# (op, rows, N, K, bias, strided x, forced plan); K not a multiple of the tile, N not of the column block
CASES = {
    "gemv-m1-bias-fp32": dict(op="gemv", m=1, n=96, k=256, bias=True, dtype="float32"),
    "gemv-m3-bf16-strided": dict(op="gemv", m=3, n=50, k=200, bias=False, dtype="bfloat16", strided=True),
    "gemv-m8-fp16-forced-tiles": dict(op="gemv", m=8, n=33, k=72, bias=True, dtype="float16",
                                      tune=dict(block_n=16, block_k=16, num_warps=2, num_stages=1)),
    "gemv-m1-bf16-forced-tiles": dict(op="gemv", m=1, n=21, k=40, bias=False, dtype="bfloat16",
                                      tune=dict(block_n=8, block_k=16)),
    "norm-m1-residual-bf16": dict(op="norm", m=1, n=64, k=256, bias=False, dtype="bfloat16"),
    "norm-m5-residual-fp32-bias": dict(op="norm", m=5, n=40, k=96, bias=True, dtype="float32"),
    "norm-m3-residual-bf16": dict(op="norm", m=3, n=48, k=600, bias=False, dtype="bfloat16"),
    "norm-m2-no-residual-fp16": dict(op="norm", m=2, n=48, k=128, bias=False, dtype="float16", residual=False),
    "silu-m1-bf16": dict(op="silu", m=1, n=64, k=160, bias=False, dtype="bfloat16"),
    "silu-m4-fp32-strided-bias": dict(op="silu", m=4, n=30, k=100, bias=True, dtype="float32", strided=True),
}
MUTANTS = {"gemv": ("columns_shifted", "no_bias"), "norm": ("no_residual", "no_norm_weight", "not_normalized"),
           "silu": ("silu_on_up",)}


# ------------------------------------------------------------------ inputs (shared by child and plain tests)

def _inputs(c: dict, gen: torch.Generator) -> dict:
    dtype = getattr(torch, c["dtype"])
    m, n, k = c["m"], c["n"], c["k"]
    width = 2 * k if c["op"] == "silu" else k
    x = torch.randn(m, width + (7 if c.get("strided") else 0), generator=gen).to(dtype)[:, :width]
    return dict(x=x, weight=(torch.randn(n, k, generator=gen) / k ** 0.5).to(dtype),
                bias=torch.randn(n, generator=gen).to(dtype) if c["bias"] else None,
                residual=torch.randn(m, k, generator=gen).to(dtype) if c.get("residual", True) else None,
                norm_weight=(1 + 0.6 * torch.randn(k, generator=gen)).to(dtype))


def _call(c: dict, t: dict, impl: str, mutant: str | None = None):
    """(y, new residual or None) of the kernel (impl "kernel") or the twin, optionally a mutant twin."""
    bias = None if mutant == "no_bias" else t["bias"]
    if c["op"] == "gemv":
        weight = t["weight"].roll(1, 0) if mutant == "columns_shifted" else t["weight"]
        return (tg.gemv(t["x"], weight, bias, **c.get("tune", {})) if impl == "kernel"
                else tg.gemv_ref(t["x"], weight, bias)), None
    if c["op"] == "silu":
        x = t["x"]
        if mutant == "silu_on_up":
            x = torch.cat([x[:, c["k"]:], x[:, :c["k"]]], dim=1)
        return (tg.silu_mul_gemv(x, t["weight"], bias) if impl == "kernel"
                else tg.silu_mul_gemv_ref(x, t["weight"], bias)), None
    if impl == "kernel":
        return tg.add_rmsnorm_gemv(t["x"], t["residual"], t["norm_weight"], EPS, t["weight"], bias)
    residual = None if mutant == "no_residual" else t["residual"]
    norm_weight = torch.ones_like(t["norm_weight"]) if mutant == "no_norm_weight" else t["norm_weight"]
    if mutant == "not_normalized":
        x = t["x"] if residual is None else t["x"] + residual
        return tg.gemv_ref(norm_weight * x, t["weight"], bias), None
    return tg.add_rmsnorm_gemv_ref(t["x"], residual, norm_weight, EPS, t["weight"], bias)


# ------------------------------------------------------------------ the child process (kernel runs)

def _run_case(c: dict) -> dict:
    t = _inputs(c, torch.Generator().manual_seed(c["m"] * 1000 + c["k"]))
    before = {name: v.clone() for name, v in t.items() if v is not None}
    y, r_out = _call(c, t, "kernel")
    want, r_want = _call(c, t, "twin")
    top = want.float().abs().max().item()

    def err(other: torch.Tensor) -> float:
        return (y.float() - other.float()).abs().max().item() / top

    res = dict(dtype=str(y.dtype).removeprefix("torch."), shape=list(y.shape), err=err(want),
               inputs_untouched=all(torch.equal(before[name], t[name]) for name in before),
               mutant_err={mu: err(_call(c, t, "twin", mu)[0]) for mu in MUTANTS[c["op"]]
                           if (mu != "no_bias" or c["bias"]) and (mu != "no_residual" or c.get("residual", True))},
               residual=None)
    if r_want is not None:  # ulps of the new residual: 0 on a GPU, at most 1 where the interpreter truncates
        ulp = torch.finfo(r_want.dtype).eps * r_want.float().abs().clamp(min=1e-30)
        res["residual"] = ((r_out.float() - r_want.float()).abs() / ulp).max().item()
    return res


COMPILE_CASES = [("bfloat16", 0, 1, False), ("bfloat16", 1, 1, True), ("float16", 2, 4, False),
                 ("bfloat16", 1, 8, False), ("float32", 2, 2, True), ("bfloat16", 2, 1, False),
                 ("bfloat16", 0, 8, True)]  # (dtype, prologue, rows, bias)


def _compile_id(case: tuple) -> str:
    return "-".join(map(str, case))


def _compile_case(dtype: str, prologue: int, rows: int, bias: bool) -> dict:
    """Compile as an 8B layer's launch would (132 SMs), for an sm_90 target (no GPU needed)."""
    kernel, t = tg._kernels().gemv_kernel, "*" + TRITON_TYPES[dtype]
    p = tg.plan(rows, 4096, 4096, 132)
    consts = dict(PROLOGUE=prologue, HAS_RESIDUAL=prologue == 1, HAS_BIAS=bias,
                  **tg.constexprs(p, 4096, getattr(torch, dtype), False))
    types = {name: t for name in ("x_ptr", "r_ptr", "r_out_ptr", "g_ptr", "w_ptr", "b_ptr", "y_ptr")}
    types["eps"] = "fp32"
    signature = {name: "constexpr" if name in consts else types.get(name, "i32") for name in kernel.arg_names}
    return {"cubin_bytes": compile_for_sm90(kernel, signature, consts, p.num_warps)}


def _child_main(mode: str) -> None:
    run_jobs(mode, {name: functools.partial(_run_case, c) for name, c in CASES.items()},
             {_compile_id(c): functools.partial(_compile_case, *c) for c in COMPILE_CASES})


# ------------------------------------------------------------------ the pytest side: kernel cases

interpreted, compiled = kernel_fixtures(__file__)


@needs_triton
@pytest.mark.parametrize("name", list(CASES))
def test_gemv_matches_twin(interpreted, name):
    c, r = CASES[name], interpreted[name]
    assert "exception" not in r, r.get("exception")
    assert r["dtype"] == c["dtype"] and r["shape"] == [c["m"], c["n"]]
    assert r["inputs_untouched"]
    assert_near_twin(r["err"], r["mutant_err"], TOL[c["dtype"]], MUTANT_MARGIN)
    if c["op"] == "norm" and c.get("residual", True):
        assert r["residual"] <= (1 if c["dtype"] == "bfloat16" else 0)


@needs_triton
@pytest.mark.parametrize("case", COMPILE_CASES, ids=_compile_id)
def test_kernel_compiles_for_sm90(compiled, case):
    r = compiled[_compile_id(case)]
    assert_compiled(r)


# ------------------------------------------------------------------ plain tests

def test_twins_are_the_layers_they_fold():
    """The twins against the model's own ops: RMSNorm with its residual, SiLU-and-mul, F.linear."""
    gen = torch.Generator().manual_seed(1)
    for dtype in (torch.float32, torch.bfloat16):
        x, r = torch.randn(3, 64, generator=gen).to(dtype), torch.randn(3, 64, generator=gen).to(dtype)
        w, b = torch.randn(24, 64, generator=gen).to(dtype), torch.randn(24, generator=gen).to(dtype)
        norm = RMSNorm(64, EPS).to(dtype)
        norm.weight.data = (1 + 0.2 * torch.randn(64, generator=gen)).to(dtype)
        normed, new_r = norm(x.clone(), r.clone())
        y, r_out = tg.add_rmsnorm_gemv_ref(x, r, norm.weight.data, EPS, w, b)
        assert torch.equal(r_out, new_r)
        torch.testing.assert_close(y, F.linear(normed, w, b), rtol=1e-2 if dtype == torch.bfloat16 else 1e-5,
                                   atol=1e-2 if dtype == torch.bfloat16 else 1e-5)
        gu = torch.randn(3, 128, generator=gen).to(dtype)
        torch.testing.assert_close(tg.silu_mul_gemv_ref(gu, w), F.linear(silu_and_mul(gu), w),
                                   rtol=1e-2 if dtype == torch.bfloat16 else 1e-5,
                                   atol=1e-2 if dtype == torch.bfloat16 else 1e-5)


def test_a_failing_fold_falls_back_to_the_plain_layer(llama_dir, monkeypatch, caplog):
    """A folded GEMV that raises (a compile failure, say) turns folding off for every layer, with one warning,
    and the step goes on through the plain ops: the same tokens as without folding."""
    from conftest import make_llm
    from tokenmill import SamplingParams
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in make_llm(llama_dir).generate([[5, 6, 7], [9]], sp, use_tqdm=False)]
    real_enabled = tg.enabled
    monkeypatch.setenv(tg.ENABLE_ENV, "1")
    monkeypatch.setattr(tg, "enabled", lambda: not tg._failure)
    monkeypatch.setattr(tg, "runs_on", lambda x: True)

    def broken(*a, **k):
        raise RuntimeError("PTX compile failed")
    monkeypatch.setattr(tg, "add_rmsnorm_gemv", broken)
    monkeypatch.setattr(tg, "_failure", FailureLatch(tg._failure.warning))
    llm = make_llm(llama_dir, cpu_linear_kernel="torch")
    with caplog.at_level("WARNING"):
        got = [o.outputs[0].token_ids for o in llm.generate([[5, 6, 7], [9]], sp, use_tqdm=False)]
    assert got == want
    layers = llm.llm_engine.core.runner.model.model.layers
    assert [layer.folds_gemvs for layer in layers] == [False] * len(layers)
    assert sum("folded GEMVs failed" in r.message for r in caplog.records) == 1 and tg._failure
    assert not real_enabled()  # given up for good: a new layer would not try


def test_plan_fills_the_gpu_and_bounds_the_tile():
    p = tg.plan(1, 4096, 4096, 132)
    assert 4096 // p.block_n >= 2 * 132 and p.block_m * p.block_n * p.block_k <= tg._TILE
    assert tg.plan(1, 128256, 4096, 132).block_n == 64  # the LM head: plenty of columns
    rows5 = tg.plan(5, 6144, 4096, 132)  # 2-8 rows: a 16-row tl.dot tile, at least 16 columns
    assert rows5.use_dot and rows5.block_m == 16 and rows5.block_n >= 16 and not tg.plan(1, 6144, 4096, 132).use_dot
    assert tg.plan(1, 4096, 8, 132).block_k == 16  # never past K's power of two, never under 16
    assert tg.plan(1, 4096, 4096, 132, block_n=32, block_k=64, num_warps=8, num_stages=2) == \
        tg.GemvPlan(1, 32, 64, 8, 2)
    assert tg.constexprs(tg.plan(8, 4096, 4096, 132), 4096, torch.bfloat16, False)["STAT_BLOCK"] == 256


def test_bad_inputs_are_refused_before_any_launch():
    x, w = torch.randn(2, 16).half(), torch.randn(8, 16).half()
    with pytest.raises(TypeError, match="weight must be"):
        tg.gemv(x, w.float())
    with pytest.raises(TypeError, match="x must be one of"):
        tg.gemv(x.double(), w.double())
    with pytest.raises(ValueError, match="1 <= M <= 8"):
        tg.gemv(torch.randn(9, 16).half(), w)
    with pytest.raises(ValueError, match="1 <= M <= 8"):
        tg.gemv(x[:0], w)
    with pytest.raises(ValueError, match="weight must be"):
        tg.gemv(x, w[:, :8])
    with pytest.raises(ValueError, match="bias must be"):
        tg.gemv(x, w, torch.zeros(7).half())
    with pytest.raises(ValueError, match="residual must be"):
        tg.add_rmsnorm_gemv(x, x[:1], torch.ones(16).half(), EPS, w)
    with pytest.raises(ValueError, match="norm_weight must be"):
        tg.add_rmsnorm_gemv(x, x, torch.ones(15).half(), EPS, w)
    with pytest.raises(ValueError, match="gate_up must be"):
        tg.silu_mul_gemv(torch.randn(2, 33).half(), w)
    with pytest.raises(ValueError, match="contiguous last dimension"):
        tg.gemv(x, w.t().contiguous().t())


if __name__ == "__main__":
    _child_main(sys.argv[1])
