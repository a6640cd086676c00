"""Triton paged attention and KV-cache write (ops/triton_attention.py) against their pure-torch twins.

Kernel cases run in a child process under Triton's interpreter, and a second child compiles the kernels
for sm_90 (tests/triton_child.py says why).

An attention case passes when the kernel is within `tol` of the twin (relative to max |out|) and at least
10 x tol away from each mutant twin the case is built to tell apart: no causal mask, every query one
position early (off-by-one causal limit), query head h on KV head h % Hkv (interleaved instead of grouped
GQA), and block-table entries shifted by one. Which mutants a case can tell apart follows from its shape
(`_expected_mutants`): a 1000-token decode barely notices one key more or less, a fresh prefill does.
write_kv cases must match write_kv_ref exactly. The twin itself is checked against SDPA and a direct
softmax formula in plain tests below.

rotary_write_kv cases must leave qkv and both caches bit-equal to its two-launch counterpart (triton_fused's
rotary_ and then write_kv), stay within a few ulps of its torch twin, and sit clearly away from a mutant
that writes the keys unrotated.
"""
from __future__ import annotations

import functools
import math
import sys

import pytest
import torch
import torch.nn.functional as F

from tokenmill.ops import triton_attention as ta
from triton_child import (TRITON_TYPES, assert_compiled, assert_near_twin, compile_for_sm90, kernel_fixtures,
                          needs_triton, run_jobs, stdout_without_triton)

# relative to max |out|; bfloat16 also absorbs the interpreter's fp32 -> bf16 casts, which truncate (a GPU
# rounds to nearest): the softmax weights on their way into tl.dot and the output
TOL = {"float32": 5e-5, "float16": 3e-3, "bfloat16": 2e-2}
MUTANT_MARGIN = 10
MUTANTS = ("no_causal", "causal_off_by_one", "gqa_interleaved", "tables_shifted")


def _case(name, dtype, head_dim, kv_heads, group, block_size, seqs, splits=None, strided=False):
    """seqs: (new tokens n_i, seq_len) per sequence, in batch order; splits: None = the planner's choice."""
    return dict(name=name, dtype=dtype, head_dim=head_dim, kv_heads=kv_heads, group=group,
                block_size=block_size, seqs=seqs, splits=splits, strided=strided)


ATTENTION_CASES = [
    # mixed steps: decodes first (the scheduler's order), one-token prompts, a chunk on a cached prefix,
    # sequences ending on a block boundary (16, 32, 64)
    _case("mixed-decodes-first", "float32", 32, 2, 1, 16, [(1, 9), (1, 4), (1, 16), (3, 8), (5, 5), (1, 1)]),
    _case("mixed-interleaved-gqa4", "float16", 64, 2, 4, 16, [(4, 20), (1, 17), (7, 7), (1, 33), (1, 1), (16, 32)]),
    _case("gqa7-bs32", "bfloat16", 32, 1, 7, 32, [(1, 40), (12, 64), (1, 32), (9, 9), (1, 1)]),
    _case("gqa7-two-kv-heads", "float32", 16, 2, 7, 16, [(3, 50), (1, 1), (20, 20), (1, 48)]),
    _case("head-dim-80", "float16", 80, 2, 2, 16, [(16, 16), (5, 37), (1, 48), (2, 2)]),
    _case("head-dim-96-bs32", "bfloat16", 96, 2, 1, 32, [(1, 64), (30, 45), (1, 3)]),
    _case("chunks-over-several-query-tiles", "float32", 32, 2, 1, 16, [(70, 100), (1, 12), (65, 65)]),
    _case("bs8", "float16", 32, 2, 4, 8, [(1, 23), (10, 24), (4, 4)]),
    _case("bs64", "bfloat16", 64, 2, 2, 64, [(1, 100), (6, 70), (3, 3)]),
    _case("strided-q-and-out", "float16", 32, 2, 2, 16, [(1, 20), (5, 5), (2, 30)], strided=True),
    _case("decodes-only-short", "float32", 32, 2, 4, 16, [(1, 5), (1, 17), (1, 32), (1, 1)]),
    # split-KV at long contexts: forced (even, uneven, more splits than tiles) and chosen by the planner
    _case("split4-decodes", "float16", 64, 2, 4, 16, [(1, 1500), (1, 700), (1, 2000)], splits=4),
    _case("split-auto-decodes", "bfloat16", 64, 2, 4, 32, [(1, 1000), (1, 513)]),
    _case("split3-mixed", "float32", 32, 2, 1, 16, [(1, 900), (6, 520), (1, 17), (4, 4)], splits=3),
    # more splits than tiles; a chunk whose query tiles straddle a KV tile: rows that see nothing in a split
    _case("split8-empty-segments", "float16", 32, 1, 4, 16, [(1, 100), (3, 60), (40, 44), (1, 1)], splits=8),
    _case("split-auto-gqa7-decodes", "float32", 16, 1, 7, 16, [(1, 1200), (1, 600)]),
    _case("split-auto-mixed-d80", "bfloat16", 80, 2, 2, 32, [(1, 800), (20, 540), (1, 10)]),
]
CASES = {c["name"]: c for c in ATTENTION_CASES}


def _expected_mutants(c: dict) -> list[str]:
    """The mutants this case's shape makes far from the twin (the off-by-one and causal ones only show
    where a query sees few keys)."""
    out = ["tables_shifted"]
    if any(n >= 2 and length - n < n for n, length in c["seqs"]):
        out.append("no_causal")
    if any(length - n + 1 <= 16 for n, length in c["seqs"]):
        out.append("causal_off_by_one")
    if c["group"] > 1 and c["kv_heads"] > 1:
        out.append("gqa_interleaved")
    return out


WRITE_CASES = {
    "write-fp32-d80-bs16": dict(dtype="float32", head_dim=80, kv_heads=3, block_size=16, tokens=21),
    "write-fp16-bs32-strided": dict(dtype="float16", head_dim=64, kv_heads=2, block_size=32, tokens=40, strided=True),
    "write-bf16-many-heads": dict(dtype="bfloat16", head_dim=16, kv_heads=8, block_size=16, tokens=9),
}

# rotary_write_kv: q heads per KV head (1: MHA, 7: an odd GQA group), a head_dim that is not a power of two,
# qkv rows inside wider rows (strided)
ROTARY_CASES = {
    "rotary-kv-fp32-d80-gqa7": dict(dtype="float32", head_dim=80, kv_heads=1, group=7, block_size=16, tokens=13),
    "rotary-kv-bf16-d128-bs32-strided": dict(dtype="bfloat16", head_dim=128, kv_heads=2, group=4, block_size=32,
                                             tokens=11, strided=True),
    "rotary-kv-fp16-d64-mha": dict(dtype="float16", head_dim=64, kv_heads=3, group=1, block_size=16, tokens=9),
}
# max |fused - twin| relative to max |x|: the twin rounds once per product as the kernel does, but not
# necessarily in the same order of a sum
ROTARY_TOL = {"float32": 1e-6, "float16": 1e-3, "bfloat16": 8e-3}


# ------------------------------------------------------------------ inputs (shared by child and plain tests)

def _step(seqs, kv_heads, group, head_dim, block_size, dtype, gen, extra_blocks=5):
    """A step's tensors: caches filled with noise everywhere (so reading a wrong block shows), block ids
    shuffled and non-contiguous, tables padded with 0."""
    per_seq = [math.ceil(length / block_size) for _, length in seqs]
    num_blocks = sum(per_seq) + extra_blocks
    key_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    value_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    ids = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(seqs), max(per_seq) + 2, dtype=torch.int32)
    used = 0
    for i, nb in enumerate(per_seq):
        tables[i, :nb] = ids[used:used + nb]
        used += nb
    news = torch.tensor([n for n, _ in seqs])
    query_start_loc = torch.cat([torch.zeros(1, dtype=torch.int64), news.cumsum(0)]).to(torch.int32)
    seq_lens = torch.tensor([length for _, length in seqs], dtype=torch.int32)
    q = torch.randn(int(news.sum()), kv_heads * group, head_dim, generator=gen).to(dtype)
    return q, key_cache, value_cache, query_start_loc, seq_lens, tables


def _mutant(name, q, key_cache, value_cache, query_start_loc, seq_lens, tables, scale):
    kw = dict(no_causal=dict(causal=False), causal_off_by_one=dict(causal_shift=-1),
              gqa_interleaved=dict(interleaved_heads=True), tables_shifted={})[name]
    if name == "tables_shifted":
        tables = tables.flatten().roll(1).view_as(tables)
    return ta._attention_ref(q, key_cache, value_cache, query_start_loc, seq_lens, tables, scale, **kw)


# ------------------------------------------------------------------ the child process (kernel runs)

def _run_attention_case(c: dict) -> dict:
    dtype = getattr(torch, c["dtype"])
    gen = torch.Generator().manual_seed(sum(map(ord, c["name"])))
    q, kc, vc, qsl, seq_lens, tables = _step(c["seqs"], c["kv_heads"], c["group"], c["head_dim"],
                                             c["block_size"], dtype, gen)
    scale = c["head_dim"] ** -0.5
    max_q, max_len = max(n for n, _ in c["seqs"]), max(length for _, length in c["seqs"])
    out = None
    if c["strided"]:  # q inside a fused qkv buffer, out written through a transposed view
        t, h, d = q.shape
        qkv = torch.randn(t, (h + 2 * c["kv_heads"]) * d, generator=gen).to(dtype)
        qkv[:, :h * d] = q.reshape(t, h * d)
        q = qkv[:, :h * d].view(t, h, d)
        out = torch.empty(t, d, h, dtype=dtype).transpose(1, 2)
    y = ta.paged_attention(q, kc, vc, qsl, seq_lens, tables, scale, max_q, max_len, out=out,
                           num_kv_splits=c["splits"])
    want = ta.paged_attention_ref(q, kc, vc, qsl, seq_lens, tables, scale).float()
    top = want.abs().max().item()

    def err(other: torch.Tensor) -> float:
        return (y.float() - other.float()).abs().max().item() / top

    plan = ta._plan(q.shape[0], len(c["seqs"]), c["kv_heads"], c["group"], c["head_dim"], max_q, max_len,
                    ta._sm_count(q.device), c["splits"])
    return dict(dtype=str(y.dtype).removeprefix("torch."), shape=list(y.shape), err=err(want),
                into_out=out is None or y.data_ptr() == out.data_ptr(), num_splits=plan.num_splits,
                block_q=plan.block_q, mutant_err={m: err(_mutant(m, q, kc, vc, qsl, seq_lens, tables, scale))
                                                  for m in _expected_mutants(c)})


def _write_inputs(c: dict, gen: torch.Generator):
    dtype = getattr(torch, c["dtype"])
    t, h, d, bs = c["tokens"], c["kv_heads"], c["head_dim"], c["block_size"]
    num_blocks = math.ceil(t / bs) + 3
    key_cache = torch.randn(num_blocks, bs, h, d, generator=gen).to(dtype)
    value_cache = torch.randn(num_blocks, bs, h, d, generator=gen).to(dtype)
    # distinct slots, shuffled, including the last slot of a block and the first of the next
    rest = torch.randperm(num_blocks * bs - 2, generator=gen)[:t - 2]
    slots = torch.cat([torch.tensor([bs - 1, bs]), rest + 2 * (rest >= bs - 1)])
    slots[::4] = -1  # padding rows
    if c.get("strided"):  # k and v inside a fused qkv buffer
        kv = torch.randn(t, 3 * h * d, generator=gen).to(dtype)
        k, v = kv[:, h * d:2 * h * d].view(t, h, d), kv[:, 2 * h * d:].view(t, h, d)
    else:
        k, v = (torch.randn(t, h, d, generator=gen).to(dtype) for _ in range(2))
    return k, v, key_cache, value_cache, slots.to(torch.int64)


def _run_write_case(c: dict) -> dict:
    k, v, kc, vc, slots = _write_inputs(c, torch.Generator().manual_seed(c["tokens"]))
    kc_ref, vc_ref = kc.clone(), vc.clone()
    before = kc.clone()
    ta.write_kv(k, v, kc, vc, slots)
    ta.write_kv_ref(k, v, kc_ref, vc_ref, slots)
    changed = (kc != before).flatten(2).any(-1).sum().item()  # slots whose key rows changed
    return dict(equal_k=torch.equal(kc, kc_ref), equal_v=torch.equal(vc, vc_ref), changed=changed,
                written=int((slots >= 0).sum()))


def _rotary_inputs(c: dict, gen: torch.Generator):
    """qkv [T, (Hq + 2 Hkv) D] (a view of wider rows when strided), cos/sin of real rotary angles, the
    caches and slots as _write_inputs makes them."""
    dtype = getattr(torch, c["dtype"])
    t, hkv, d = c["tokens"], c["kv_heads"], c["head_dim"]
    width = (hkv * c["group"] + 2 * hkv) * d
    _, _, kc, vc, slots = _write_inputs(dict(c, strided=False), gen)
    qkv = torch.randn(t, width + (3 * d if c.get("strided") else 0), generator=gen).to(dtype)[:, :width]
    pos = torch.randint(0, 4000, (t, 1), generator=gen).float()
    inv_freq = 10000.0 ** (-torch.arange(0, d, 2).float() / d)
    angles = torch.cat([pos * inv_freq, pos * inv_freq], dim=-1)
    return qkv, angles.cos().to(dtype), angles.sin().to(dtype), kc, vc, slots


def _run_rotary_case(c: dict) -> dict:
    from tokenmill.ops import triton_fused
    qkv, cos, sin, kc, vc, slots = _rotary_inputs(c, torch.Generator().manual_seed(c["tokens"] + c["head_dim"]))
    hq, hkv, d = c["kv_heads"] * c["group"], c["kv_heads"], c["head_dim"]
    x0, before = qkv.clone(), kc.clone()
    two = [qkv.clone(), kc.clone(), vc.clone()]  # rotary_ then write_kv
    twin = [qkv.clone(), kc.clone(), vc.clone()]
    mutant = [kc.clone(), vc.clone()]  # keys written as the projection made them, unrotated
    ta.rotary_write_kv(qkv, cos, sin, hq, hkv, kc, vc, slots)
    triton_fused.rotary_(two[0], cos, sin, hq + hkv, d)
    ta.write_kv(two[0][:, hq * d:(hq + hkv) * d].view(-1, hkv, d), two[0][:, (hq + hkv) * d:].view(-1, hkv, d),
                two[1], two[2], slots)
    ta.rotary_write_kv_ref(twin[0], cos, sin, hq, hkv, twin[1], twin[2], slots)
    ta.write_kv_ref(x0[:, hq * d:(hq + hkv) * d].view(-1, hkv, d), x0[:, (hq + hkv) * d:].view(-1, hkv, d),
                    *mutant, slots)
    top = x0.float().abs().max().item()

    def err(a: torch.Tensor, b: torch.Tensor) -> float:
        return (a.float() - b.float()).abs().max().item() / top

    return dict(equal_two_launch=[torch.equal(a, b) for a, b in zip((qkv, kc, vc), two)],
                twin_err=max(err(a, b) for a, b in zip((qkv, kc, vc), twin)), mutant_err=err(kc, mutant[0]),
                v_untouched=torch.equal(qkv[:, (hq + hkv) * d:], x0[:, (hq + hkv) * d:]),
                changed=(kc != before).flatten(2).any(-1).sum().item(), written=int((slots >= 0).sum()))


# compile cases: (kernel, dtype, group, head_dim, max_query_len, splits)
COMPILE_CASES = [
    ("attention", "float16", 4, 64, 1, 1), ("attention", "bfloat16", 7, 80, 16, 4),
    ("attention", "float16", 1, 128, 512, 1), ("attention", "bfloat16", 1, 256, 512, 1),
    ("attention", "float32", 2, 64, 8, 2),
    ("reduce", "float16", 4, 128, 1, 8), ("reduce", "bfloat16", 2, 80, 1, 3),
    ("write_kv", "float16", 1, 128, 1, 1), ("write_kv", "bfloat16", 1, 96, 1, 1),
    ("rotary_write_kv", "bfloat16", 4, 128, 1, 1), ("rotary_write_kv", "float16", 7, 80, 1, 1),
]


def _compile_id(case: tuple) -> str:
    return "-".join(map(str, case))


def _signature(kernel, types: dict, consts: dict) -> dict:
    """Every argument typed: pointers from `types`, constexprs, and the remaining ints (strides) as i32."""
    return {name: "constexpr" if name in consts else types.get(name, "i32") for name in kernel.arg_names}


def _compile_case(kernel_name: str, dtype: str, group: int, head_dim: int, max_q: int, splits: int) -> dict:
    """Compile as paged_attention / write_kv would launch, for an sm_90 target (no GPU needed)."""
    kernels, t = ta._kernels(), "*" + TRITON_TYPES[dtype]
    plan = ta._plan(max_q * 4, 4, 2, group, head_dim, max_q, 2048, ta.NOMINAL_SMS, splits)
    if kernel_name == "attention":
        consts = plan.constexprs(head_dim, group, 16, getattr(torch, dtype), False)
        part = "*fp32" if splits > 1 else t
        types = dict(q_ptr=t, kc_ptr=t, vc_ptr=t, out_ptr=t, part_out_ptr=part, part_lse_ptr=part,
                     qsl_ptr="*i32", seq_lens_ptr="*i32", bt_ptr="*i32", scale_log2="fp32")
        kernel, warps = kernels.unified_attention_kernel, plan.num_warps
    elif kernel_name == "reduce":
        consts = dict(HEAD_DIM=head_dim, HEAD_DIM_PAD=plan.head_dim_pad, SPLITS_PAD=ta._next_pow2(splits))
        types = dict(part_out_ptr="*fp32", part_lse_ptr="*fp32", out_ptr=t)
        kernel, warps = kernels.reduce_splits_kernel, 4
    elif kernel_name == "write_kv":
        consts = dict(BLOCK_SIZE=16, HEAD_DIM=head_dim, HEAD_DIM_PAD=ta._next_pow2(head_dim), HEAD_BLOCK=8)
        types = dict(k_ptr=t, v_ptr=t, kc_ptr=t, vc_ptr=t, slot_ptr="*i64")
        kernel, warps = kernels.write_kv_kernel, 4
    else:  # rotary_write_kv for an 8-KV-head layer, as rotary_launch tiles it
        from tokenmill.ops.triton_fused import rotary_launch
        _, params = rotary_launch(8 * group + 8, head_dim)
        warps = params.pop("num_warps")
        consts = dict(BLOCK_SIZE=16, HEAD_DIM=head_dim, **params)
        types = dict(qkv_ptr=t, cos_ptr=t, sin_ptr=t, kc_ptr=t, vc_ptr=t, slot_ptr="*i64")
        kernel = kernels.rotary_write_kv_kernel
    cubin = compile_for_sm90(kernel, _signature(kernel, types, consts), consts, warps)
    return {"cubin_bytes": cubin, "block_m": plan.block_m}


def _child_main(mode: str) -> None:
    jobs = {name: functools.partial(_run_attention_case, c) for name, c in CASES.items()}
    jobs.update({name: functools.partial(_run_write_case, c) for name, c in WRITE_CASES.items()})
    jobs.update({name: functools.partial(_run_rotary_case, c) for name, c in ROTARY_CASES.items()})
    run_jobs(mode, jobs, {_compile_id(c): functools.partial(_compile_case, *c) for c in COMPILE_CASES})


# ------------------------------------------------------------------ the pytest side: kernel cases

interpreted, compiled = kernel_fixtures(__file__)


@needs_triton
@pytest.mark.parametrize("name", list(CASES))
def test_attention_matches_twin(interpreted, name):
    c, r = CASES[name], interpreted[name]
    assert "exception" not in r, r.get("exception")
    hq = c["kv_heads"] * c["group"]
    assert r["dtype"] == c["dtype"] and r["shape"] == [sum(n for n, _ in c["seqs"]), hq, c["head_dim"]]
    assert r["into_out"]
    if c["splits"] is not None:
        assert r["num_splits"] == c["splits"]
    elif name.startswith("split-auto"):
        assert r["num_splits"] > 1, "the planner did not split this long-context case"
    assert_near_twin(r["err"], r["mutant_err"], TOL[c["dtype"]], MUTANT_MARGIN)


@needs_triton
@pytest.mark.parametrize("name", list(WRITE_CASES))
def test_write_kv_matches_twin(interpreted, name):
    r = interpreted[name]
    assert "exception" not in r, r.get("exception")
    assert r["equal_k"] and r["equal_v"]
    assert r["changed"] == r["written"] > 0  # -1 rows wrote nothing, every other row its own slot


@needs_triton
@pytest.mark.parametrize("name", list(ROTARY_CASES))
def test_rotary_write_kv_matches_two_launches_and_twin(interpreted, name):
    r, c = interpreted[name], ROTARY_CASES[name]
    assert "exception" not in r, r.get("exception")
    assert r["equal_two_launch"] == [True, True, True], "qkv, key cache, value cache differ from rotary_ + write_kv"
    tol = ROTARY_TOL[c["dtype"]]
    assert r["twin_err"] <= tol, f"{r['twin_err']:.2e} from the torch twin"
    assert r["mutant_err"] > 10 * max(tol, 1e-3), "the case cannot tell rotated keys from unrotated ones"
    assert r["v_untouched"]
    assert r["changed"] == r["written"] > 0  # -1 rows wrote nothing, every other row its own slot


@needs_triton
@pytest.mark.parametrize("case", COMPILE_CASES, ids=_compile_id)
def test_kernel_compiles_for_sm90(compiled, case):
    r = compiled[_compile_id(case)]
    assert_compiled(r)


def test_cases_cover_the_brief():
    cs = list(CASES.values())
    assert {c["dtype"] for c in cs} == set(TOL)
    assert {16, 32} <= {c["block_size"] for c in cs} and {1, 4, 7} <= {c["group"] for c in cs}
    assert any(c["head_dim"] & (c["head_dim"] - 1) for c in cs)  # not a power of two
    seqs = [s for c in cs for s in c["seqs"]]
    assert (1, 1) in seqs  # one-token prompt
    assert any(n > 1 and length > n for n, length in seqs)  # chunk over a cached prefix
    assert any(length % c["block_size"] == 0 for c in cs for _, length in c["seqs"])
    ns = [[n for n, _ in c["seqs"]] for c in cs]
    assert any(n[0] == 1 and n[1] == 1 and max(n) > 1 for n in ns)  # decodes first
    assert any(any(a > 1 and b == 1 for a, b in zip(n, n[1:])) for n in ns)  # a decode after a prefill
    splits = [c for c in cs if max(length for _, length in c["seqs"]) >= 500]
    assert any(c["splits"] for c in splits) and any(c["splits"] is None for c in splits)
    assert any(all(n == 1 for n, _ in c["seqs"]) for c in splits)  # decode-only split-KV
    for c in cs:
        assert _expected_mutants(c), c["name"]
    for m in MUTANTS:
        assert sum(m in _expected_mutants(c) for c in cs) >= 3, m


# ------------------------------------------------------------------ planner and validation (no kernels)

def test_planner_tiles_and_splits_from_shapes():
    sms = ta.NOMINAL_SMS
    decode = ta._plan(2, 2, 2, 4, 64, 1, 2000, sms)  # 4 busy programs, 63 KV tiles: split, >= 4 tiles each
    assert (decode.block_m, decode.block_q, decode.head_dim_pad) == (16, 4, 64)
    assert decode.num_splits == 8 and decode.grid(2, 2, 2) == (2 // 4 + 2, 2, 8)
    assert ta._plan(128, 128, 8, 4, 128, 1, 2000, sms).num_splits == 1  # a big batch fills the GPU alone
    assert ta._plan(2, 2, 2, 4, 64, 1, 100, sms).num_splits == 1  # short contexts: nothing worth splitting
    assert ta._plan(1, 1, 1, 1, 64, 1, 1 << 20, sms).num_splits == ta.MAX_KV_SPLITS
    assert ta._plan(1, 1, 1, 1, 64, 1, 1 << 20, sms, num_kv_splits=3).num_splits == 3  # forced, not rounded
    prefill = ta._plan(4096, 1, 8, 4, 128, 4096, 4096, sms)
    assert (prefill.block_m, prefill.block_q, prefill.num_splits, prefill.num_warps) == (64, 16, 1, 8)
    assert ta._plan(300, 1, 1, 1, 256, 300, 300, sms).block_m == 32  # head dim 256: smaller tiles
    gqa7 = ta._plan(5, 5, 1, 7, 80, 1, 64, sms)
    assert (gqa7.block_m, gqa7.block_q, gqa7.head_dim_pad) == (16, 2, 128)
    assert ta._plan(5, 5, 1, 32, 64, 1, 64, sms).block_q == 1  # a group wider than 16 rows
    assert ta._plan(24, 4, 2, 1, 16, 12, 64, sms).block_m == 16  # small chunks keep small tiles
    # the fp32 scratch bound: 128 tokens x 32 heads x 128 wide leave room for 32 splits, not 64
    assert ta._plan(128, 128, 1, 32, 128, 1, 1 << 20, 1 << 20).num_splits == 32
    with pytest.raises(ValueError, match="num_kv_splits"):
        ta._plan(2, 2, 2, 4, 64, 1, 2000, sms, num_kv_splits=0)


def test_bad_inputs_are_refused_before_any_launch():
    q, kc, vc, qsl, seq_lens, tables = _step([(1, 5), (3, 3)], 2, 2, 16, 16, torch.float16, torch.Generator())
    args = (qsl, seq_lens, tables, 0.25, 3, 5)
    with pytest.raises(TypeError, match="share a dtype"):
        ta.paged_attention(q.float(), kc, vc, *args)
    with pytest.raises(TypeError, match="caches"):
        ta.paged_attention(q, kc, vc.float(), *args)
    with pytest.raises(TypeError, match="caches"):
        ta.paged_attention(q.double(), kc.double(), vc.double(), *args)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        ta.paged_attention(q[:, :3].contiguous(), kc, vc, *args)
    with pytest.raises(ValueError, match="q must be"):
        ta.paged_attention(q.flatten(1), kc, vc, *args)
    with pytest.raises(ValueError, match="key_cache"):
        ta.paged_attention(q, kc.flatten(0, 1), vc.flatten(0, 1), *args)
    with pytest.raises(ValueError, match="head dim"):
        ta.paged_attention(q[..., :8], kc, vc, *args)
    with pytest.raises(TypeError, match="seq_lens"):
        ta.paged_attention(q, kc, vc, qsl, seq_lens.float(), tables, 0.25, 3, 5)
    with pytest.raises(ValueError, match="block_tables"):
        ta.paged_attention(q, kc, vc, qsl, seq_lens, tables[0], 0.25, 3, 5)
    with pytest.raises(ValueError, match="num_seqs"):
        ta.paged_attention(q, kc, vc, qsl[:-1], seq_lens, tables, 0.25, 3, 5)
    with pytest.raises(ValueError, match="out must be"):
        ta.paged_attention(q, kc, vc, *args, out=torch.empty_like(q).float())
    with pytest.raises(ValueError, match="num_kv_splits"):
        ta.paged_attention(q, kc, vc, *args, num_kv_splits=0)
    assert ta.paged_attention(q[:0], kc, vc, qsl[:1], seq_lens[:0], tables[:0], 0.25, 1, 1).shape == (0, 4, 16)
    k = torch.randn(4, 2, 16).half()
    slots = torch.arange(4)
    with pytest.raises(TypeError, match="cache's dtype"):
        ta.write_kv(k.float(), k.float(), kc, vc, slots)
    with pytest.raises(ValueError, match="k and v"):
        ta.write_kv(k[:, :1], k[:, :1], kc, vc, slots)
    with pytest.raises(ValueError, match="slot_mapping has"):
        ta.write_kv(k, k, kc, vc, slots[:3])
    with pytest.raises(TypeError, match="slot_mapping"):
        ta.write_kv(k, k, kc, vc, slots.float())
    ta.write_kv(k[:0], k[:0], kc, vc, slots[:0])  # nothing to write: no launch
    qkv, cos = torch.randn(4, 8 * 16).half(), torch.randn(4, 16).half()  # 4 q + 2 x 2 kv heads of 16
    ta.rotary_write_kv(qkv[:0], cos[:0], cos[:0], 4, 2, kc, vc, slots[:0])
    for bad, match in (((qkv, cos, cos, 5, 2), "must fit"), ((qkv, cos, cos, 2, 3), "must fit"),
                       ((qkv, cos.float(), cos, 4, 2), "cos must be"), ((qkv, cos, cos[:3], 4, 2), "sin must be"),
                       ((qkv.float(), cos.float(), cos.float(), 4, 2), "share a dtype"),
                       ((qkv.flatten()[None], cos[:1], cos[:1], 4, 2), "slot_mapping has")):
        before = bad[0].clone()
        with pytest.raises((TypeError, ValueError), match=match):
            ta.rotary_write_kv(*bad, kc, vc, slots if bad[0].shape[0] == 4 else slots[:2])
        assert torch.equal(bad[0], before)


# ------------------------------------------------------------------ the twins against independent formulas

def _expand(cache, tables, i, length, group):
    """Sequence i's first `length` keys (or values), KV heads repeated for their query heads: [length, Hq, D]."""
    bs = cache.shape[1]
    rows = torch.cat([cache[int(b)] for b in tables[i, :math.ceil(length / bs)]])[:length]
    return rows.float().repeat_interleave(group, dim=1)


def test_twin_matches_sdpa_on_fresh_prefills():
    gen = torch.Generator().manual_seed(1)
    seqs, group = [(7, 7), (1, 1), (33, 33), (16, 16)], 3
    q, kc, vc, qsl, seq_lens, tables = _step(seqs, 2, group, 32, 16, torch.float32, gen)
    got = ta.paged_attention_ref(q, kc, vc, qsl, seq_lens, tables, 0.2)
    for i, (n, _) in enumerate(seqs):
        s, e = int(qsl[i]), int(qsl[i + 1])
        k, v = _expand(kc, tables, i, n, group), _expand(vc, tables, i, n, group)
        want = F.scaled_dot_product_attention(q[s:e].transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                              is_causal=True, scale=0.2).transpose(0, 1)
        torch.testing.assert_close(got[s:e], want, rtol=1e-5, atol=1e-5)


def test_twin_matches_a_direct_softmax_on_decodes_and_prefix_chunks():
    gen = torch.Generator().manual_seed(2)
    seqs, group, scale = [(1, 40), (1, 1), (4, 21), (1, 16)], 2, 0.3
    q, kc, vc, qsl, seq_lens, tables = _step(seqs, 2, group, 16, 8, torch.float32, gen)
    got = ta.paged_attention_ref(q, kc, vc, qsl, seq_lens, tables, scale)
    for i, (n, length) in enumerate(seqs):
        k, v = _expand(kc, tables, i, length, group), _expand(vc, tables, i, length, group)
        for j in range(n):
            row = int(qsl[i]) + j
            visible = length - n + j + 1
            for h in range(q.shape[1]):
                logits = (k[:visible, h] @ q[row, h]) * scale
                w = torch.exp(logits - logits.max())
                want = (w / w.sum()) @ v[:visible, h]
                torch.testing.assert_close(got[row, h], want, rtol=1e-5, atol=1e-5)


def test_write_kv_twin_writes_slots_and_skips_padding():
    gen = torch.Generator().manual_seed(3)
    kc, vc = torch.zeros(4, 8, 2, 16), torch.zeros(4, 8, 2, 16)
    k, v = torch.randn(5, 2, 16, generator=gen), torch.randn(5, 2, 16, generator=gen)
    slots = torch.tensor([9, -1, 31, 0, -1])
    ta.write_kv_ref(k, v, kc, vc, slots)
    for row, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(kc[slot // 8, slot % 8], k[row]) and torch.equal(vc[slot // 8, slot % 8], v[row])
    assert int((kc.flatten(2).abs().sum(-1) > 0).sum()) == 3  # nothing else was touched


def test_rotary_write_kv_twin_is_rotate_half_then_write():
    """The twin against the textbook formula: x * cos + rotate_half(x) * sin on q and k, v as it came."""
    gen = torch.Generator().manual_seed(4)
    t, hq, hkv, d = 5, 4, 2, 8
    qkv, cos, sin = torch.randn(t, (hq + 2 * hkv) * d, generator=gen), torch.randn(t, d, generator=gen), \
        torch.randn(t, d, generator=gen)
    x = qkv.clone().view(t, -1, d)
    kc, vc = torch.zeros(2, 4, hkv, d), torch.zeros(2, 4, hkv, d)
    slots = torch.tensor([3, -1, 0, 7, 5])
    ta.rotary_write_kv_ref(qkv, cos, sin, hq, hkv, kc, vc, slots)
    halves = x[..., d // 2:], x[..., :d // 2]
    want = x * cos[:, None] + torch.cat([-halves[0], halves[1]], dim=-1) * sin[:, None]
    torch.testing.assert_close(qkv.view(t, -1, d)[:, :hq + hkv], want[:, :hq + hkv])
    assert torch.equal(qkv.view(t, -1, d)[:, hq + hkv:], x[:, hq + hkv:])
    for row, slot in enumerate(slots.tolist()):
        if slot >= 0:
            torch.testing.assert_close(kc[slot // 4, slot % 4], want[row, hq:hq + hkv])
            assert torch.equal(vc[slot // 4, slot % 4], x[row, hq + hkv:])
    assert int((kc.flatten(2).abs().sum(-1) > 0).sum()) == 4


def test_imports_without_triton():
    code = ("import torch\n"
            "from tokenmill.ops import triton_attention as ta\n"
            "assert not ta.available()\n"
            "kc = torch.randn(3, 16, 1, 8); vc = torch.randn(3, 16, 1, 8)\n"
            "ta.write_kv_ref(torch.ones(2, 1, 8), torch.ones(2, 1, 8), kc, vc, torch.tensor([5, -1]))\n"
            "qsl = torch.tensor([0, 2], dtype=torch.int32); lens = torch.tensor([6], dtype=torch.int32)\n"
            "bt = torch.tensor([[0]], dtype=torch.int32)\n"
            "print(tuple(ta.paged_attention_ref(torch.randn(2, 2, 8), kc, vc, qsl, lens, bt, 0.3).shape))\n")
    assert stdout_without_triton(code) == "(2, 2, 8)"


if __name__ == "__main__":
    _child_main(sys.argv[1])
