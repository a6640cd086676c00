"""Triton fused small ops (ops/triton_fused.py) against their pure-torch twins, the torch code in
layers/norm.py, layers/activation.py and layers/rotary.py; and the layers' routing to them.

Kernel cases run in a child process under Triton's interpreter, and a second child compiles the kernels
for sm_90 (tests/triton_child.py says why). A case passes when the op is within `tol` of the twin
(relative to max |out|) and at least 10 x tol away from every mutant twin: rmsnorm without eps, with the
square of the mean instead of the mean of squares, without the residual or the weight, the residual left
as it was; rotary with GPT-J interleaved pairs, the wrong rotation sign, or no rotation; SiLU on the up
half, no SiLU, a bare sigmoid. What lies outside the op's rows (V heads, row tails, the buffer beyond a
strided view, the inputs) must stay bit-identical.
"""
from __future__ import annotations

import functools
import sys

import pytest
import torch
import torch.nn.functional as F

from tokenmill.layers import activation, norm, rotary
from tokenmill.ops import triton_fused as tf
from tokenmill.ops.failure_latch import FailureLatch
from triton_child import (TRITON_TYPES, assert_compiled, compile_for_sm90, kernel_fixtures, needs_triton, run_jobs,
                          stdout_without_triton)

# relative to max |out|; float16 and bfloat16 also absorb the interpreter's fp32 -> fp16/bf16 casts, which
# truncate (a GPU rounds to nearest): one ulp of the output, 2^-7 in bfloat16
TOL = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 2e-2}
MUTANT_MARGIN = 10
DTYPES = tuple(TOL)


def _cases() -> list[dict]:
    out = []
    for i, (t, h, res, strided) in enumerate([(1, 64, True, False), (3, 200, True, False), (4, 96, False, False),
                                              (2, 201, True, True), (3, 1000, False, True), (2, 48, True, False)]):
        for dtype in DTYPES:
            out.append(dict(op="norm", t=t, h=h, residual=res, strided=strided, dtype=dtype))
    out += [dict(op="norm", t=3, h=80, residual=True, strided=False, dtype="bfloat16", wdtype="float32"),
            dict(op="norm", t=0, h=64, residual=True, strided=False, dtype="float16")]
    # heads rotated, heads left (V), extra elements at the row end; 40 heads of 128 span two head blocks
    for i, (t, heads, rest, hd, tail, strided) in enumerate([(4, 3, 2, 80, 0, False), (3, 5, 1, 96, 7, False),
                                                             (2, 2, 2, 64, 0, True), (3, 1, 0, 128, 0, False),
                                                             (2, 40, 0, 128, 5, False), (1, 4, 2, 8, 3, True)]):
        for dtype in DTYPES:
            out.append(dict(op="rotary", t=t, heads=heads, rest=rest, hd=hd, tail=tail, strided=strided, dtype=dtype))
    out.append(dict(op="rotary", t=0, heads=3, rest=1, hd=64, tail=0, strided=False, dtype="bfloat16"))
    for t, inter, strided in [(3, 64, False), (2, 100, False), (4, 37, True), (1, 1, False), (2, 1500, False)]:
        for dtype in DTYPES:
            out.append(dict(op="silu", t=t, inter=inter, strided=strided, dtype=dtype))
    out.append(dict(op="silu", t=0, inter=64, strided=False, dtype="float32"))
    return out


def _case_id(c: dict) -> str:
    dims = {"norm": "h{h}{residual}", "rotary": "n{heads}+{rest}-d{hd}+{tail}", "silu": "i{inter}"}[c["op"]]
    dims = dims.format(**{**c, "residual": "-res" if c.get("residual") else ""})
    extra = ("-strided" if c["strided"] else "") + (f"-w{c['wdtype']}" if c.get("wdtype") else "")
    return f"{c['op']}-t{c['t']}-{dims}-{c['dtype']}{extra}"


CASES = {_case_id(c): c for c in _cases()}


# ------------------------------------------------------------------ the child process (kernel runs)

def _rows(t: int, width: int, dtype: torch.dtype, strided: bool, gen: torch.Generator, scale: float = 1.0):
    """(buffer, [t, width] view): a strided view is the left part of wider rows."""
    buf = (torch.randn(t, width + (9 if strided else 0), generator=gen) * scale).to(dtype)
    return buf, buf[:, :width]


def _err(got: torch.Tensor, want: torch.Tensor, scale: float) -> float:
    diff = (got.float() - want.float()).abs()
    return float("inf") if not diff.isfinite().all() else diff.max().item() / scale


def _norm_mutants(x, r, w, eps):
    h = (x if r is None else x + r).float()
    dtype = x.dtype

    def normed(hh, ms):
        return w * (hh * torch.rsqrt(ms)).to(dtype)

    ms = h.pow(2).mean(-1, keepdim=True)
    out = [normed(h, ms), normed(h, h.mean(-1, keepdim=True).pow(2) + eps), (h * torch.rsqrt(ms + eps)).to(dtype)]
    if r is not None:
        xf = x.float()
        out.append(normed(xf, xf.pow(2).mean(-1, keepdim=True) + eps))
    return out


def _run_norm(c: dict, gen: torch.Generator) -> dict:
    dtype = getattr(torch, c["dtype"])
    t, h = c["t"], c["h"]
    x_buf, x = _rows(t, h, dtype, c["strided"], gen, 0.05)
    r_buf, r = _rows(t, h, dtype, c["strided"], gen, 0.05) if c["residual"] else (None, None)
    eps = 0.05 ** 2 * (2 if c["residual"] else 1)  # the expected mean square: leaving eps out is far off
    w = (torch.randn(h, generator=gen) + 1).to(getattr(torch, c.get("wdtype", c["dtype"])))
    layer = norm.RMSNorm(h, eps)
    layer.weight = torch.nn.Parameter(w, requires_grad=False)
    before = [b.clone() for b in (x_buf, r_buf) if b is not None]
    with torch.no_grad():
        want = layer(x, None if r is None else r.clone())
    want_out, want_res = want if r is not None else (want, None)
    out = tf.add_rmsnorm(x, r, w, eps)
    rec = dict(dtype=str(out.dtype).removeprefix("torch."), want_dtype=str(want_out.dtype).removeprefix("torch."),
               shape=list(out.shape), x_unchanged=torch.equal(x_buf, before[0]))
    if r is not None:  # the residual in place, and nothing beyond its rows
        rec["outside_unchanged"] = torch.equal(r_buf[:, h:], before[1][:, h:])
    if t == 0:
        return rec
    scale = want_out.float().abs().max().item()
    rec["err"] = _err(out, want_out, scale)
    rec["mutant_err"] = min(_err(out, m, scale) for m in _norm_mutants(x, r, w, eps))
    if r is not None:
        rscale = want_res.float().abs().max().item()
        rec["res_err"] = _err(r, want_res, rscale)
        rec["res_mutant_err"] = _err(r, before[1][:, :h], rscale)  # the residual not updated
    return rec


def _rotary_mutants(x, cos, sin):
    """x [T, H, D] in float32."""
    d = x.shape[-1] // 2
    c, s = cos.float()[:, None, :d], sin.float()[:, None, :d]
    ev, od = x[..., 0::2], x[..., 1::2]
    gptj = torch.stack((ev * c - od * s, od * c + ev * s), dim=-1).flatten(-2)
    x1, x2 = x[..., :d], x[..., d:]
    backwards = torch.cat((x1 * c + x2 * s, x2 * c - x1 * s), dim=-1)
    return [gptj, backwards, x]


def _run_rotary(c: dict, gen: torch.Generator) -> dict:
    dtype = getattr(torch, c["dtype"])
    t, heads, hd = c["t"], c["heads"], c["hd"]
    width = (heads + c["rest"]) * hd + c["tail"]
    buf, qkv = _rows(t, width, dtype, c["strided"], gen)
    emb = rotary.RotaryEmbedding(hd, 4096, 10000.0, None, dtype)
    cos, sin = emb.cos_sin(torch.randint(1, 4096, (t,), generator=gen))
    before = buf.clone()
    want = rotary.rotate_heads(qkv.clone(), cos, sin, heads, hd)  # on CPU: the torch twin, a new tensor
    tf.rotary_(qkv, cos, sin, heads, hd)
    got = qkv[:, :heads * hd].view(t, heads, hd)
    rec = dict(dtype=str(qkv.dtype).removeprefix("torch."), shape=list(got.shape),
               outside_unchanged=torch.equal(buf[:, heads * hd:], before[:, heads * hd:]))
    if t == 0:
        return rec
    scale = want.float().abs().max().item()
    x = before[:, :heads * hd].view(t, heads, hd).float()
    rec["err"] = _err(got, want, scale)
    rec["mutant_err"] = min(_err(got, m, scale) for m in _rotary_mutants(x, cos, sin))
    return rec


def _run_silu(c: dict, gen: torch.Generator) -> dict:
    dtype = getattr(torch, c["dtype"])
    t, inter = c["t"], c["inter"]
    buf, gu = _rows(t, 2 * inter, dtype, c["strided"], gen, 3.0)
    before = buf.clone()
    want = activation.silu_and_mul(gu)
    out = tf.silu_mul(gu)
    rec = dict(dtype=str(out.dtype).removeprefix("torch."), shape=list(out.shape),
               outside_unchanged=torch.equal(buf, before))
    if t == 0:
        return rec
    g, u = gu[:, :inter].float(), gu[:, inter:].float()
    scale = want.float().abs().max().item()
    rec["err"] = _err(out, want, scale)
    rec["mutant_err"] = min(_err(out, m, scale) for m in (F.silu(u) * g, g * u, torch.sigmoid(g) * u))
    return rec


def _run_case(c: dict) -> dict:
    gen = torch.Generator().manual_seed(len(_case_id(c)) * 7919 + c["t"])
    return {"norm": _run_norm, "rotary": _run_rotary, "silu": _run_silu}[c["op"]](c, gen)


def _compile_cases() -> list[tuple]:
    out = [("norm", dtype, h, res) for dtype in DTYPES for h, res in ((4096, True), (200, False))]
    out += [("rotary", dtype, 40, 128) for dtype in DTYPES] + [("rotary", "bfloat16", 3, 80)]
    out += [("silu", dtype, 1500, None) for dtype in DTYPES]
    return out


COMPILE_CASES = _compile_cases()


def _compile_id(case: tuple) -> str:
    return "-".join(map(str, case))


def _compile_case(op: str, dtype: str, a: int, b) -> dict:
    """Compile, with the launch parameters the op picks, for an sm_90 target."""
    ptr = "*" + TRITON_TYPES[dtype]
    k = tf._kernels()
    if op == "norm":
        params = tf.norm_launch(a)
        kernel, ptrs, ints = k.add_rmsnorm_kernel, ("x_ptr", "r_ptr", "w_ptr", "out_ptr"), \
            ("H", "stride_x", "stride_r", "stride_o")
        params["HAS_RESIDUAL"] = b
        extra = {"eps": "fp32"}
    elif op == "rotary":
        _, params = tf.rotary_launch(a, b)
        kernel, ptrs, ints = k.rotary_kernel, ("qkv_ptr", "cos_ptr", "sin_ptr"), \
            ("num_heads", "head_dim", "stride_qkv", "stride_cos", "stride_sin")
        extra = {}
    else:
        _, params = tf.silu_launch(a)
        kernel, ptrs, ints = k.silu_mul_kernel, ("gu_ptr", "out_ptr"), ("inter", "stride_gu", "stride_o")
        extra = {}
    warps = params.pop("num_warps")
    signature = {**{p: ptr for p in ptrs}, **{i: "i32" for i in ints}, **extra, **{n: "constexpr" for n in params}}
    return {"cubin_bytes": compile_for_sm90(kernel, signature, params, warps)}


def _child_main(mode: str) -> None:
    from tokenmill.ops import cpu_fused
    cpu_fused.usable = lambda *a, **k: False  # the twins are the layers' torch code, not the C kernels
    run_jobs(mode, {case_id: functools.partial(_run_case, c) for case_id, c in CASES.items()},
             {_compile_id(c): functools.partial(_compile_case, *c) for c in COMPILE_CASES})


# ------------------------------------------------------------------ the pytest side

interpreted, compiled = kernel_fixtures(__file__)


@needs_triton
@pytest.mark.parametrize("case_id", list(CASES))
def test_kernel_matches_twin(interpreted, case_id):
    c, r = CASES[case_id], interpreted[case_id]
    assert "exception" not in r, r.get("exception")
    assert r["dtype"] == r.get("want_dtype", c["dtype"])
    dims = {"norm": ("h",), "rotary": ("heads", "hd"), "silu": ("inter",)}[c["op"]]
    assert r["shape"] == [c["t"], *(c[k] for k in dims)]
    assert r.get("x_unchanged", True) and r.get("outside_unchanged", True), "wrote outside its rows"
    if c["t"] == 0:
        return
    tol = TOL[c["dtype"]]
    for key in ("err", "res_err"):
        if key in r:
            assert r[key] <= tol, f"{key} {r[key]:.2e} (relative to max |out|) over {tol:.0e}"
    for key in ("mutant_err", "res_mutant_err"):
        if key in r:
            assert r[key] > MUTANT_MARGIN * tol, f"a mutant twin is within {r[key]:.2e}: weak case"


@needs_triton
@pytest.mark.parametrize("case", COMPILE_CASES, ids=_compile_id)
def test_kernel_compiles_for_sm90(compiled, case):
    r = compiled[_compile_id(case)]
    assert_compiled(r)


def test_cases_cover_the_brief():
    cs = list(CASES.values())
    for op in ("norm", "rotary", "silu"):
        mine = [c for c in cs if c["op"] == op]
        assert {c["dtype"] for c in mine} == set(DTYPES)
        assert any(c["t"] == 0 for c in mine) and any(c["strided"] for c in mine)
    norms = [c for c in cs if c["op"] == "norm"]
    assert {True, False} == {c["residual"] for c in norms} and any(c["h"] % 2 for c in norms)
    rots = [c for c in cs if c["op"] == "rotary"]
    assert {80, 96} <= {c["hd"] for c in rots} and any(c["rest"] and c["tail"] for c in rots)


@needs_triton
def test_cases_span_several_programs_per_row():
    cs = list(CASES.values())
    assert any(tf.rotary_launch(c["heads"], c["hd"])[0] > 1 for c in cs if c["op"] == "rotary")
    assert any(tf.silu_launch(c["inter"])[0] > 1 for c in cs if c["op"] == "silu")
    assert tf.norm_launch(200)["BLOCK_H"] == 256 and tf.rotary_launch(3, 80)[1]["BLOCK_HALF"] == 64


def test_bad_inputs_are_refused_before_any_launch():
    x, w = torch.randn(2, 64), torch.randn(64)
    with pytest.raises(TypeError, match="x must be"):
        tf.add_rmsnorm(x.double(), None, w, 1e-6)
    with pytest.raises(ValueError, match="2-D"):
        tf.add_rmsnorm(x.view(2, 8, 8), None, w, 1e-6)
    with pytest.raises(ValueError, match="contiguous last"):
        tf.add_rmsnorm(torch.randn(64, 2).t(), None, torch.randn(2), 1e-6)
    with pytest.raises(ValueError, match="residual must match"):
        tf.add_rmsnorm(x, torch.randn(2, 64).half(), w, 1e-6)
    with pytest.raises(ValueError, match="weight"):
        tf.add_rmsnorm(x, None, torch.randn(32), 1e-6)
    qkv, cs = torch.randn(3, 4 * 64), torch.randn(3, 64)
    with pytest.raises(ValueError, match="even head_dim"):
        tf.rotary_(qkv, cs, cs, 4, 63)
    with pytest.raises(ValueError, match="fit"):
        tf.rotary_(qkv, cs, cs, 5, 64)
    with pytest.raises(ValueError, match="cos must be"):
        tf.rotary_(qkv, cs.half(), cs, 4, 64)
    with pytest.raises(ValueError, match="sin must be"):
        tf.rotary_(qkv, cs, cs[:2], 4, 64)
    with pytest.raises(ValueError, match="even"):
        tf.silu_mul(torch.randn(2, 7))
    with pytest.raises(ValueError, match="contiguous last"):
        tf.silu_mul(torch.randn(8, 2).t())


def test_empty_batches_launch_nothing():
    r = torch.randn(0, 64)
    assert tf.add_rmsnorm(torch.randn(0, 64), r, torch.randn(64), 1e-6).shape == (0, 64)
    tf.rotary_(torch.randn(0, 128), torch.randn(0, 64), torch.randn(0, 64), 2, 64)
    assert tf.silu_mul(torch.randn(0, 64).bfloat16()).shape == (0, 32)


def test_switch_and_device_gate(monkeypatch):
    monkeypatch.delenv(tf.DISABLE_ENV, raising=False)
    assert tf.available() == (tf.triton is not None)
    monkeypatch.setenv(tf.DISABLE_ENV, "1")
    assert not tf.available()
    monkeypatch.setattr(tf, "available", lambda: True)
    assert not tf.usable(torch.randn(2, 64))  # CPU tensors never take the Triton ops


def _layer_outputs(dtype: str) -> list[torch.Tensor]:
    dtype = getattr(torch, dtype)
    g = torch.Generator().manual_seed(3)
    x, r = (torch.randn(3, 64, generator=g).to(dtype) for _ in range(2))
    layer = norm.RMSNorm(64, 1e-6).to(dtype)
    emb = rotary.RotaryEmbedding(64, 64, 10000.0, None, dtype)
    cos, sin = emb.cos_sin(torch.tensor([1, 5, 9]))
    qkv = torch.randn(3, 4 * 64, generator=g).to(dtype)
    with torch.no_grad():
        out, res = layer(x, r.clone())
        return [out, res, layer(x), activation.silu_and_mul(qkv),
                rotary.rotate_heads(qkv.clone(), cos, sin, 3, 64).reshape(3, -1)]


@pytest.mark.parametrize("dtype", DTYPES)
def test_layers_on_cpu_never_call_triton(monkeypatch, dtype):
    want = _layer_outputs(dtype)

    def boom(*args, **kwargs):
        raise AssertionError("a Triton op was called for CPU tensors")

    monkeypatch.setattr(tf, "available", lambda: True)
    for name in ("add_rmsnorm", "rotary_", "silu_mul", "_kernels"):
        monkeypatch.setattr(tf, name, boom)
    for got, ref in zip(_layer_outputs(dtype), want):
        assert torch.equal(got, ref)


def test_layers_route_device_tensors_to_triton(monkeypatch):
    """With `usable` saying yes (as for CUDA tensors), the layers call the ops and return what their torch
    path returns: here the ops are stand-ins that run the torch twin with the ops' in-place contracts."""
    want = _layer_outputs("float32")
    calls = []

    def add_rmsnorm(x, residual, weight, eps):
        calls.append("norm")
        if residual is not None:
            residual.copy_(x + residual)
        h = (x if residual is None else residual).float()
        return weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)

    def rotary_(qkv, cos, sin, num_heads, head_dim):
        calls.append("rotary")
        view = qkv[:, :num_heads * head_dim].view(-1, num_heads, head_dim)
        view.copy_(rotary.apply_rotary(view.clone(), cos, sin))

    def silu_mul(gu):
        calls.append("silu")
        return F.silu(gu[:, :gu.shape[1] // 2]) * gu[:, gu.shape[1] // 2:]

    monkeypatch.setattr(tf, "usable", lambda *tensors: True)
    for f in (add_rmsnorm, rotary_, silu_mul):
        monkeypatch.setattr(tf, f.__name__, f)
    for got, ref in zip(_layer_outputs("float32"), want):
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
    assert calls == ["norm", "norm", "silu", "rotary"]


def test_a_failing_op_turns_the_triton_ops_off_with_one_warning(monkeypatch, caplog):
    """An op that raises (a compile failure on the GPU) is given up: the layers return their torch results
    (nothing was written before the raise), one warning, and no later call tries Triton again."""
    want = _layer_outputs("float32")
    calls = []

    def broken(*a, **k):
        calls.append("tried")
        raise RuntimeError("PTXAS error: no kernel image")
    monkeypatch.setattr(tf, "_failure", FailureLatch(tf._failure.warning))
    monkeypatch.setattr(tf, "usable", lambda *tensors: not tf._failure)  # as for CUDA tensors, until a failure
    for name in ("add_rmsnorm", "rotary_", "silu_mul"):
        monkeypatch.setattr(tf, name, broken)
    with caplog.at_level("WARNING"):
        for _ in range(2):
            for got, ref in zip(_layer_outputs("float32"), want):
                torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
    assert calls == ["tried"] and tf._failure and "PTXAS" in tf._failure.reason
    assert sum("Triton fused ops failed" in r.message for r in caplog.records) == 1


def test_imports_without_triton():
    code = ("import torch\n"
            "from tokenmill.ops import triton_fused as tf\n"
            "from tokenmill.layers.norm import RMSNorm\n"
            "from tokenmill.layers.activation import silu_and_mul\n"
            "assert not tf.available()\n"
            "out, res = RMSNorm(16, 1e-6)(torch.randn(2, 16), torch.randn(2, 16))\n"
            "print(tuple(out.shape), tuple(silu_and_mul(torch.randn(2, 16)).shape))\n")
    assert stdout_without_triton(code) == "(2, 16) (2, 8)"


if __name__ == "__main__":
    _child_main(sys.argv[1])
