"""Triton dequantize-GEMM kernels (ops/triton_quant.py) against their pure-torch twins.

Kernel cases run in a child process under Triton's interpreter, and a second child compiles the kernels
for sm_90 (tests/triton_child.py says why).

A case passes when the kernel is within `tol` of the twin (relative to max |y|) and at least 10 x tol
away from every mutant twin: the same weights read with the nibble order ignored, the zero points
ignored, the group (int8: channel) scales shifted by one, or (int8) K reversed. So a kernel with one of
those bugs fails; so did kernels with the K tail, the group index or split-K's bias broken by hand.
"""
from __future__ import annotations

import functools
import sys

import pytest
import torch

from tokenmill.ops import triton_quant as tq
from tokenmill.quantization import awq_format
from triton_child import (TRITON_TYPES, assert_compiled, compile_for_sm90, kernel_fixtures, needs_triton, run_jobs,
                          stdout_without_triton)

# relative to max |y|; bfloat16 also absorbs the interpreter's fp32 -> bf16 casts, which truncate (a GPU
# rounds to nearest): the weight tile on its way into tl.dot and the output, up to 1e-2 seen here
TOL = {"float32": 1e-5, "float16": 3e-3, "bfloat16": 2e-2}
MUTANT_MARGIN = 10


def _cases() -> list[dict]:
    """kind, m, n, k, group, dtype, bias, variant (None = chosen by M), split_k, strided x."""
    dtypes = ("float32", "bfloat16", "float16")
    out = []
    for gi, g in enumerate((32, 64, 128)):
        for mi, m in enumerate((1, 3, 17, 40)):
            for variant in ("gemm", "gemv"):
                out.append(dict(kind="w4", m=m, n=(72, 200)[mi % 2], k=g * (2 + mi % 2), group=g,
                                dtype=dtypes[(gi + mi) % 3], bias=mi % 2 == 0, variant=variant))
    for mi, m in enumerate((1, 3, 17, 40)):
        for variant in ("gemm", "gemv"):
            for dtype in dtypes:
                out.append(dict(kind="w8", m=m, n=(72, 136)[mi % 2], k=200, group=0, dtype=dtype,
                                bias=dtype != "float16", variant=variant))
    out += [  # split-K chosen from shapes, forced and uneven; the automatic choice; a strided, 3-d x
        dict(kind="w4", m=2, n=64, k=512, group=128, dtype="bfloat16", bias=True, variant=None),
        dict(kind="w4", m=5, n=48, k=256, group=32, dtype="float32", bias=True, variant="gemv", split_k=3),
        dict(kind="w4", m=20, n=48, k=192, group=64, dtype="float16", bias=False, variant="gemm", split_k=2),
        dict(kind="w8", m=4, n=40, k=1000, group=0, dtype="float32", bias=True, variant=None),
        dict(kind="w8", m=33, n=40, k=300, group=0, dtype="bfloat16", bias=True, variant=None, split_k=2),
        dict(kind="w4", m=6, n=56, k=128, group=64, dtype="float32", bias=False, variant=None, strided=True),
        dict(kind="w8", m=12, n=24, k=96, group=0, dtype="float16", bias=True, variant=None, strided=True),
    ]
    return out


def _case_id(c: dict) -> str:
    dims = f"m{c['m']}-n{c['n']}-k{c['k']}" + (f"-g{c['group']}" if c["kind"] == "w4" else "")
    extra = "".join(f"-{key}{c[key]}" for key in ("split_k", "strided") if c.get(key))
    return f"{c['kind']}-{dims}-{c['dtype']}-{c['variant'] or 'auto'}{'-bias' if c['bias'] else ''}{extra}"


CASES = {_case_id(c): c for c in _cases()}


# ------------------------------------------------------------------ the child process (kernel runs)

def _w4_weights(c: dict, gen: torch.Generator):
    k, n, g = c["k"], c["n"], c["group"]
    q = torch.randint(0, 16, (k, n), generator=gen)
    z = torch.randint(0, 16, (k // g, n), generator=gen)
    s = (torch.rand(k // g, n, generator=gen) * 0.02 + 0.002).to(torch.float16)
    packed = (awq_format.pack_int4(q), awq_format.pack_int4(z), s)
    sequential = (q.view(k, n // 8, 8) << torch.arange(0, 32, 4)).sum(-1, dtype=torch.int32)  # no ORDER
    zero_z = awq_format.pack_int4(torch.zeros_like(z))
    mutants = [(sequential, packed[1], s), (packed[0], zero_z, s), (packed[0], packed[1], s.roll(1, 0))]
    return packed, mutants


def _w8_weights(c: dict, gen: torch.Generator):
    q = torch.randint(-127, 128, (c["n"], c["k"]), generator=gen).to(torch.int8)
    s = (torch.rand(c["n"], generator=gen) * 0.02 + 0.002).to(torch.float16)
    return (q, s), [(q, s.roll(1, 0)), (q.flip(1), s)]


def _activations(c: dict, gen: torch.Generator) -> torch.Tensor:
    dtype = getattr(torch, c["dtype"])
    if c.get("strided"):  # a transposed view, reshaped to [2, m/2, K] by the caller
        return torch.randn(c["k"], c["m"], generator=gen).to(dtype).t()
    return torch.randn(c["m"], c["k"], generator=gen).to(dtype)


def _run_case(c: dict) -> dict:
    gen = torch.Generator().manual_seed(len(_case_id(c)) * 7919 + c["m"])
    x = _activations(c, gen)
    bias = torch.randn(c["n"], generator=gen) if c["bias"] else None
    kernel, ref = (tq.awq_gemm, tq.awq_gemm_ref) if c["kind"] == "w4" else (tq.int8_gemm, tq.int8_gemm_ref)
    weights, mutants = (_w4_weights if c["kind"] == "w4" else _w8_weights)(c, gen)
    group = (c["group"],) if c["kind"] == "w4" else ()
    x_in = x.view(2, c["m"] // 2, c["k"]) if c.get("strided") else x
    y = kernel(x_in, *weights, *group, bias, variant=c["variant"], split_k=c.get("split_k")).reshape(c["m"], -1)
    want = ref(x, *weights, *group, bias).float()
    scale = want.abs().max().item()

    def err(other: torch.Tensor) -> float:
        return (y.float() - other.float()).abs().max().item() / scale

    return dict(dtype=str(y.dtype).removeprefix("torch."), shape=list(y.shape), err=err(want),
                mutant_err=min(err(ref(x, *w, *group, bias)) for w in mutants))


COMPILE_CASES = [(kind, dtype, m) for kind in ("w4", "w8") for dtype in ("float16", "bfloat16", "float32")
                 for m in (1, 17)] + [("w4", "bfloat16", 5)]


def _compile_id(case: tuple) -> str:
    return "-".join(map(str, case))


def _compile_case(kind: str, dtype: str, m: int) -> dict:
    """Compile, as `_launch` would launch it, for an sm_90 target: no GPU needed, ptxas ships with triton."""
    group = {"float16": 32, "bfloat16": 64, "float32": 128}[dtype] if kind == "w4" else 1
    plan = tq._plan(m, 256, 512, group if kind == "w4" else tq._W8_BLOCK_K, torch.device("cpu"), None, None)
    consts = plan.constexprs(4 if kind == "w4" else 8, group, getattr(torch, dtype), True, False)
    x_t, w_t = "*" + TRITON_TYPES[dtype], "*i32" if kind == "w4" else "*i8"
    ptrs = dict(x_ptr=x_t, qw_ptr=w_t, qz_ptr=w_t, s_ptr="*fp16", b_ptr="*fp32",
                out_ptr=x_t if plan.split_k == 1 else "*fp32")
    ints = {name: "i32" for name in ("M", "N", "K", "stride_xm", "stride_xk", "tiles_per_split")}
    signature = {**ptrs, **ints, **{name: "constexpr" for name in consts}}
    cubin = compile_for_sm90(tq._kernels().qgemm_kernel, signature, consts, plan.num_warps)
    return {"cubin_bytes": cubin, "use_dot": plan.use_dot, "split_k": plan.split_k}


def _child_main(mode: str) -> None:
    run_jobs(mode, {case_id: functools.partial(_run_case, c) for case_id, c in CASES.items()},
             {_compile_id(c): functools.partial(_compile_case, *c) for c in COMPILE_CASES})


# ------------------------------------------------------------------ the pytest side

interpreted, compiled = kernel_fixtures(__file__)


@needs_triton
@pytest.mark.parametrize("case_id", list(CASES))
def test_kernel_matches_twin(interpreted, case_id):
    c, r = CASES[case_id], interpreted[case_id]
    assert "exception" not in r, r.get("exception")
    assert r["dtype"] == c["dtype"] and r["shape"] == [c["m"], c["n"]]
    tol = TOL[c["dtype"]]
    assert r["err"] <= tol, f"max error {r['err']:.2e} (relative to max |y|) over {tol:.0e}"
    assert r["mutant_err"] > MUTANT_MARGIN * tol, f"a mutant twin is within {r['mutant_err']:.2e}: weak case"


@needs_triton
@pytest.mark.parametrize("case", COMPILE_CASES, ids=_compile_id)
def test_kernel_compiles_for_sm90(compiled, case):
    r = compiled[_compile_id(case)]
    assert_compiled(r)
    assert r["use_dot"] == (case[2] > tq.SMALL_M)


def test_cases_cover_the_brief():
    cs = list(CASES.values())
    for kind in ("w4", "w8"):
        mine = [c for c in cs if c["kind"] == kind]
        assert {c["m"] for c in mine} >= {1, 3, 17, 40}
        assert {c["dtype"] for c in mine} == set(TOL) and {c["variant"] for c in mine} == {"gemm", "gemv", None}
        assert any(c["bias"] for c in mine) and any(not c["bias"] for c in mine)
        assert any(c["n"] % 64 for c in mine) and any(c["k"] % 64 for c in mine)
    assert {c["group"] for c in cs if c["kind"] == "w4"} == {32, 64, 128}


@needs_triton
def test_variant_chosen_by_m_and_split_from_shapes():
    cpu = torch.device("cpu")
    assert [tq._plan(m, 64, 512, 128, cpu, None, None).use_dot for m in (1, 8, 9, 40)] == [False, False, True, True]
    decode = tq._plan(2, 64, 512, 128, cpu, None, None)  # 16 K tiles, one output tile: split, >= 4 tiles each
    assert decode.split_k == 4 and decode.tiles_per_split == 4
    uneven = tq._plan(5, 48, 256, 32, cpu, "gemv", 3)  # 8 tiles in 3 slices of 3, 3, 2
    assert (uneven.split_k, uneven.tiles_per_split) == (3, 3)
    assert tq._plan(40, 64, 512, 128, cpu, None, None).split_k == 1
    with pytest.raises(ValueError, match="variant"):
        tq._plan(4, 64, 512, 128, cpu, "gemmv", None)


def test_bad_shapes_are_refused_before_any_launch():
    qw, qz, s = awq_format.quantize_w4(torch.randn(16, 64), 32)
    with pytest.raises(ValueError, match="input features"):
        tq.awq_gemm(torch.randn(2, 32), qw, qz, s, 32)
    with pytest.raises(ValueError, match="group size"):
        tq.awq_gemm(torch.randn(2, 64), qw, qz, s, 16)
    with pytest.raises(TypeError, match="activations"):
        tq.int8_gemm(torch.randn(2, 64).double(), *awq_format.quantize_w8(torch.randn(16, 64)))
    with pytest.raises(ValueError, match="bias"):
        tq.int8_gemm(torch.randn(2, 64), *awq_format.quantize_w8(torch.randn(16, 64)), torch.zeros(8))
    assert tq.awq_gemm(torch.randn(0, 64), qw, qz, s, 32).shape == (0, 16)


def test_twins_follow_awq_format():
    w = torch.randn(24, 128)
    qw, qz, s = awq_format.quantize_w4(w, 64)
    x, bias = torch.randn(3, 128).to(torch.bfloat16), torch.randn(24)
    want = (x.float() @ awq_format.dequantize_w4(qw, qz, s, 64).t() + bias).to(torch.bfloat16)
    assert torch.equal(tq.awq_gemm_ref(x, qw, qz, s, 64, bias), want)
    q8, s8 = awq_format.quantize_w8(w)
    assert torch.equal(tq.int8_gemm_ref(x, q8, s8), (x.float() @ (q8.float() * s8.float()[:, None]).t()).bfloat16())


def test_imports_without_triton():
    code = ("import torch\n"
            "from tokenmill.ops import triton_quant as tq\n"
            "from tokenmill.quantization.awq_format import quantize_w8\n"
            "assert not tq.available()\n"
            "print(tuple(tq.int8_gemm_ref(torch.randn(2, 16), *quantize_w8(torch.randn(8, 16))).shape))\n")
    assert stdout_without_triton(code) == "(2, 8)"


if __name__ == "__main__":
    _child_main(sys.argv[1])


def test_a_kernel_that_fails_to_compile_falls_back_to_its_twin(monkeypatch, caplog):
    """A Triton compile failure on the GPU (the first quantized forward is the KV-sizing step: it killed the
    engine's startup) trips a latch: one warning, and the layers dequantize and multiply in torch from then on."""
    from tokenmill.ops.failure_latch import FailureLatch

    def broken():
        raise RuntimeError("PTX compile failed")
    monkeypatch.setattr(tq, "_kernels", broken)
    monkeypatch.setattr(tq, "_failure", FailureLatch(tq._failure.warning))
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 128, generator=g)
    qweight, scales = awq_format.quantize_w8(w)
    q4, z4, s4 = awq_format.quantize_w4(w, 32)
    x = torch.randn(3, 128, generator=g)
    with caplog.at_level("WARNING", logger="tokenmill"):
        for _ in range(2):
            assert torch.equal(tq.int8_gemm(x, qweight, scales), tq.int8_gemm_ref(x, qweight, scales))
            assert torch.equal(tq.awq_gemm(x, q4, z4, s4, 32), tq.awq_gemm_ref(x, q4, z4, s4, 32))
    assert sum("Triton quantized GEMMs failed" in r.message for r in caplog.records) == 1 and tq._failure
