"""CPU kernels against their pure-torch twins, and the engine through them against the plain path.
The kernels build wherever gcc does and the CPU is x86-64 with AVX2 + FMA (the portable C path), or has
AVX512-BF16 (the intrinsics path); TOKENMILL_NATIVE_PORTABLE=1 runs the portable path on AVX-512 CPUs too."""
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tokenmill import SamplingParams
from tokenmill.attention.torch_backend import chunk_attention, decode_attention, gather_kv, prefill_attention
from tokenmill.layers.linear import Linear, UnquantizedLinearMethod, onednn_linear_available
from tokenmill.models import loader
from tokenmill.ops import cpu_attention, cpu_gemv, native
from conftest import make_llm, random_prompts

KERNELS_REASON = "needs gcc and an x86-64 CPU with AVX2 + FMA"
needs_gemv = pytest.mark.skipif(not cpu_gemv.available(), reason=KERNELS_REASON)


def test_cache_key_holds_the_cpu_flags(monkeypatch, tmp_path):
    """-march=native bakes the CPU into the library: a cache shared by two CPUs must hold two builds."""
    src = Path(native.__file__).with_name("cpu_gemv.c")
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TOKENMILL_NATIVE_PORTABLE", raising=False)
    monkeypatch.setattr(native, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
    avx2 = native.library_path([src])
    assert native.library_path([src]) == avx2  # deterministic
    monkeypatch.setattr(native, "cpu_flags", lambda: frozenset({"avx2", "fma", "avx512f", "avx512_bf16"}))
    avx512 = native.library_path([src])
    assert avx512 != avx2 and avx512.parent == avx2.parent == tmp_path / "ops"
    monkeypatch.setenv("TOKENMILL_NATIVE_PORTABLE", "1")  # other flags, another build
    assert native.library_path([src]) not in (avx2, avx512)


def test_load_requires_avx2_and_fma(monkeypatch):
    monkeypatch.setattr(native, "cpu_flags", lambda: frozenset({"avx", "sse4_2"}))
    assert not native.cpu_supported()
    assert native.load.__wrapped__("cpu_gemv.c", "TOKENMILL_TEST_UNSET_SWITCH") is None
    monkeypatch.setattr(native, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
    monkeypatch.setenv("TOKENMILL_DISABLE_CPU_GEMV", "1")
    assert native.load.__wrapped__("cpu_gemv.c", "TOKENMILL_DISABLE_CPU_GEMV") is None


def test_kernels_build_on_an_avx2_cpu():
    """Where the portable path applies, every kernel must be there (no silent fall back to torch)."""
    if not (native.cpu_supported() and native.shutil.which("gcc")):
        pytest.skip(KERNELS_REASON)
    from tokenmill.ops import cpu_fused, cpu_qgemv
    assert cpu_gemv.available() and cpu_attention.available() and cpu_qgemv.available()
    assert cpu_fused._library() is not None


@needs_gemv
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n,k,bias,rows", [(16, 2, False, 1), (64, 70, True, 1), (4864, 896, False, 1),
                                           (1152, 896, True, 1), (16, 2, True, 2), (64, 70, True, 3),
                                           (1152, 896, False, 5), (160, 4100, True, 8),
                                           (64, 70, True, 9), (160, 96, False, 21)])
def test_gemv_matches_linear(n, k, bias, rows, dtype):
    """One row: the GEMV; more: gemm_rows, which reads each panel once for up to 8 of them (K > 4096 takes
    its heap buffer for the widened bf16 rows; over 8 rows, balanced chunks)."""
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g).to(dtype)
    x = torch.randn(rows, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    y = (cpu_gemv.gemv if rows == 1 else cpu_gemv.gemm_rows)(x, cpu_gemv.pack(w), b)
    assert y.dtype == dtype and y.shape == (rows, n)
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    if dtype == torch.bfloat16:  # float32 accumulation, one bfloat16 rounding at the end
        torch.testing.assert_close(y.double(), ref, rtol=8e-3, atol=1e-3)
    else:
        torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-4 * max(1.0, k / 1000))  # float32 sums


def test_gemv_refuses_shapes_it_cannot_pack():
    assert not cpu_gemv.supports(torch.zeros(17, 8, dtype=torch.bfloat16))
    assert not cpu_gemv.supports(torch.zeros(16, 7, dtype=torch.bfloat16))
    assert not cpu_gemv.supports(torch.zeros(17, 8, dtype=torch.float32))
    assert not cpu_gemv.supports(torch.zeros(16, 8, dtype=torch.float16))
    assert cpu_gemv.supports(torch.zeros(16, 7, dtype=torch.float32))  # no k pairs in float32


def test_bf16_rows_without_onednn_multiply_in_float32():
    """"torch+gemv" (no oneDNN bf16 GEMM): above WIDEN_MIN_ROWS rows a bf16 layer widens its weight and
    multiplies in float32, one rounding at the end; fewer rows keep torch's bf16 matmul."""
    from tokenmill.layers.linear import WIDEN_MIN_ROWS, LoadContext

    torch.manual_seed(0)
    layer = Linear(64, 48, bias=True)
    layer.weight.data = torch.randn(48, 64).bfloat16()
    layer.bias.data = torch.randn(48).bfloat16()
    layer.process_after_loading(LoadContext("cpu", torch.bfloat16, cpu_kernel="torch+gemv"))
    assert layer.widen_rows
    many = torch.randn(WIDEN_MIN_ROWS + 3, 64).bfloat16()
    widened = F.linear(many.float(), layer.weight.float(), layer.bias.float()).bfloat16()
    assert torch.equal(layer(many), widened)
    few = many[:WIDEN_MIN_ROWS]
    assert torch.equal(layer(few), F.linear(few, layer.weight, layer.bias))


@pytest.mark.parametrize("kernel", ["onednn", "torch", "onednn+gemv", "torch+gemv"])
def test_linear_kernels_give_the_same_greedy_tokens(model_dirs, kernel):
    if kernel.startswith("onednn") and not onednn_linear_available(torch.bfloat16):
        pytest.skip("oneDNN packs no bfloat16 weights on this CPU (AVX2 only)")
    if kernel.endswith("gemv") and not cpu_gemv.available():
        pytest.skip(KERNELS_REASON)
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
    ref = _greedy_ids(make_llm(path, dtype="float32", cpu_linear_kernel="torch"), prompts)
    llm = make_llm(path, dtype="float32", cpu_linear_kernel="onednn+gemv")
    assert any(m.gemv_packed is not None for m in llm.llm_engine.core.runner.model.modules() if hasattr(m, "gemv_packed"))
    assert _greedy_ids(llm, prompts) == ref


def _greedy_ids(llm, prompts) -> list[list[int]]:
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sp,
                                                           use_tqdm=False)]


def _gemv_layers(llm):
    return [m for m in llm.llm_engine.core.runner.model.modules()
            if isinstance(m, Linear) and isinstance(m.method, UnquantizedLinearMethod)]


@needs_gemv
@pytest.mark.parametrize("onednn", [True, False])
def test_auto_takes_the_gemv_whatever_onednn_packs(model_dirs, monkeypatch, onednn):
    """Where oneDNN cannot pack the dtype (bfloat16 on AVX2), auto still takes the GEMV for one row:
    torch+gemv keeps the plain weight for F.linear and adds the GEMV copy; all of it decodes as the plain path."""
    if onednn and not onednn_linear_available(torch.float32):
        pytest.skip("this PyTorch has no oneDNN linear")
    monkeypatch.setattr(loader, "onednn_linear_available", lambda dtype: onednn)
    path, _ = model_dirs["qwen2"]
    prompts = random_prompts([1, 9, 30], seed=43)
    ref = _greedy_ids(make_llm(path, dtype="float32", cpu_linear_kernel="torch"), prompts)
    llm = make_llm(path, dtype="float32", cpu_linear_kernel="auto")
    layers = _gemv_layers(llm)
    assert layers and all(m.gemv_packed is not None for m in layers)
    if onednn:
        assert all(m.packed is not None and m.weight is None for m in layers)
    else:
        assert all(m.packed is None and m.weight is not None for m in layers)
    assert _greedy_ids(llm, prompts) == ref


def test_auto_resolution(monkeypatch):
    """The mode auto resolves to, from what oneDNN packs, whether the GEMV kernel is there, and the memory rule."""
    from types import SimpleNamespace
    model = torch.nn.Sequential(Linear(64, 32))
    cfg = SimpleNamespace(cpu_linear_kernel="auto")
    monkeypatch.setattr(loader, "_available_memory", lambda: 1 << 40)
    cases = {(True, True): "onednn+gemv", (True, False): "onednn", (False, True): "torch+gemv", (False, False): "torch"}
    for (onednn, gemv), want in cases.items():
        monkeypatch.setattr(loader, "onednn_linear_available", lambda dtype, ok=onednn: ok)
        monkeypatch.setattr(cpu_gemv, "available", lambda ok=gemv: ok)
        assert loader.cpu_linear_kernel(cfg, "cpu", model, torch.bfloat16) == want
        assert loader.cpu_linear_kernel(cfg, "cuda", model, torch.bfloat16) == "torch"
    monkeypatch.setattr(cpu_gemv, "available", lambda: True)
    assert loader.cpu_linear_kernel(cfg, "cpu", model, torch.float16) == "torch"  # no GEMV for float16
    monkeypatch.setattr(loader, "_available_memory", lambda: 1000)  # the copy would not fit
    assert loader.cpu_linear_kernel(cfg, "cpu", model, torch.bfloat16) == "torch"
    monkeypatch.setattr(cpu_gemv, "available", lambda: False)
    with pytest.raises(ValueError, match="torch\\+gemv"):
        loader.cpu_linear_kernel(SimpleNamespace(cpu_linear_kernel="torch+gemv"), "cpu", model, torch.float32)


needs_attention_kernel = pytest.mark.skipif(not cpu_attention.available(), reason=KERNELS_REASON)


def _torch_paged_decode(q, key_cache, value_cache, tables, lens, scale):
    """The oracle: gather each sequence's tokens through its block table, then plain softmax attention."""
    outs = []
    for b in range(q.shape[0]):
        k = gather_kv(key_cache, tables[b], int(lens[b])).unsqueeze(0)
        v = gather_kv(value_cache, tables[b], int(lens[b])).unsqueeze(0)
        outs.append(decode_attention(q[b:b + 1], k, v, scale))
    return torch.cat(outs)


@needs_attention_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv,d,bs", [(14, 2, 64, 16), (4, 2, 16, 16), (8, 8, 32, 16), (14, 2, 64, 8),
                                         (4, 2, 16, 32), (4, 2, 16, 1)])
def test_paged_decode_attention_matches_torch(dtype, hq, hkv, d, bs):
    """The kernel works in 16-key tiles: lengths around tile edges, and block sizes whose blocks a tile
    spans (8, 1) or splits (32)."""
    g = torch.Generator().manual_seed(hq * d + bs)
    lens = torch.tensor([1, 16, 17, 100, 250, 33, 15], dtype=torch.int32)
    max_blocks = -(-250 // bs)
    num_blocks = max_blocks + 8
    key_cache = torch.randn(num_blocks, bs, hkv, d, generator=g).to(dtype)
    value_cache = torch.randn(num_blocks, bs, hkv, d, generator=g).to(dtype)
    # every sequence's blocks are scattered over the pool, as after many allocations and frees
    perm = torch.randperm(num_blocks, generator=g)
    tables = torch.zeros(len(lens), max_blocks, dtype=torch.int32)
    for b, n in enumerate(lens.tolist()):
        need = -(-n // bs)
        tables[b, :need] = perm[torch.randperm(num_blocks, generator=g)[:need]]
    q = torch.randn(len(lens), hq, d, generator=g).to(dtype)
    scale = d ** -0.5
    out = cpu_attention.paged_decode_attention(q, key_cache, value_cache, tables, lens, scale)
    ref = _torch_paged_decode(q, key_cache, value_cache, tables, lens, scale)
    assert out.dtype == dtype and out.shape == q.shape
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-2)
    torch.testing.assert_close(out.float(), ref.float(), **tol)


@needs_attention_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv,d,bs", [(14, 2, 64, 16), (4, 2, 64, 16), (4, 2, 16, 1)])
def test_verification_rows_read_their_blocks_once_and_give_the_same_bits(dtype, hq, hkv, d, bs):
    """Rows of one sequence at lengths L .. L+k (a speculative verification) are attended as one group
    whose keys are read once; each row's output must be bit for bit what the row gives alone. Mixed in:
    a sequence sharing the first blocks (a prefix-cache hit) but not the last, single rows, and a
    verification longer than one group holds (14 x 64 heads: 9 rows per group)."""
    g = torch.Generator().manual_seed(7 + d + bs)
    max_blocks = -(-300 // bs)
    num_blocks = 2 * max_blocks + 8
    key_cache = torch.randn(num_blocks, bs, hkv, d, generator=g).to(dtype)
    value_cache = torch.randn(num_blocks, bs, hkv, d, generator=g).to(dtype)
    perm = torch.randperm(num_blocks, generator=g).to(torch.int32)
    a, b = perm[:max_blocks], perm[max_blocks:2 * max_blocks].clone()
    b[:3] = a[:3]  # shares its first three blocks with a
    rows = [(a, 37), (a, 38), (a, 39), (a, 40), (a, 41), (b, 45), (b, 46), (a, 16), (b, 17)] + \
        [(b, 200 + i) for i in range(12)] + [(a, 300)]
    tables = torch.stack([t for t, _ in rows])
    lens = torch.tensor([n for _, n in rows], dtype=torch.int32)
    q = torch.randn(len(rows), hq, d, generator=g).to(dtype)
    out = cpu_attention.paged_decode_attention(q, key_cache, value_cache, tables, lens, d ** -0.5)
    for i in range(len(rows)):
        alone = cpu_attention.paged_decode_attention(q[i:i + 1], key_cache, value_cache, tables[i:i + 1],
                                                     lens[i:i + 1], d ** -0.5)
        assert torch.equal(out[i], alone[0]), i
    ref = _torch_paged_decode(q, key_cache, value_cache, tables, lens, d ** -0.5)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-2)
    torch.testing.assert_close(out.float(), ref.float(), **tol)


@needs_attention_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_contexts_split_into_chunks_merge_to_the_same_attention(dtype):
    """Past CHUNK tokens a sequence is attended in chunks, one task each, whose softmax states are merged:
    lengths at and around chunk edges match the oracle, and a verification whose rows straddle a chunk
    edge still gives each row the bits it gets alone."""
    C = cpu_attention.CHUNK
    hq, hkv, d, bs = 4, 2, 16, 16
    g = torch.Generator().manual_seed(11)
    max_blocks = -(-(3 * C + 40) // bs)
    num_blocks = max_blocks + 8
    key_cache = torch.randn(num_blocks, bs, hkv, d, generator=g).to(dtype)
    value_cache = torch.randn(num_blocks, bs, hkv, d, generator=g).to(dtype)
    table = torch.randperm(num_blocks, generator=g)[:max_blocks].to(torch.int32)
    singles = [C - 1, C, C + 1, 2 * C + 7, 3 * C + 40]
    verify = [2 * C - 3 + i for i in range(6)]  # one sequence at lengths 2C-3 .. 2C+2
    lens = torch.tensor(singles + verify, dtype=torch.int32)
    tables = table.repeat(len(lens), 1)
    q = torch.randn(len(lens), hq, d, generator=g).to(dtype)
    out = cpu_attention.paged_decode_attention(q, key_cache, value_cache, tables, lens, d ** -0.5)
    ref = _torch_paged_decode(q, key_cache, value_cache, tables, lens, d ** -0.5)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-2)
    torch.testing.assert_close(out.float(), ref.float(), **tol)
    for i in range(len(lens)):
        alone = cpu_attention.paged_decode_attention(q[i:i + 1], key_cache, value_cache, tables[i:i + 1],
                                                     lens[i:i + 1], d ** -0.5)
        assert torch.equal(out[i], alone[0]), i


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("prefix,n", [(1, 1), (1, 40), (37, 1), (100, 64), (300, 29)])
def test_chunk_after_a_cached_prefix_matches_the_masked_attention(dtype, prefix, n):
    """A prefill chunk after a prefix: two flash calls (prefix unmasked, chunk causal) merged by their
    log-sum-exps give what one call with the offset causal mask gives, grouped query heads included."""
    g = torch.Generator().manual_seed(prefix * 7 + n)
    hq, hkv, d = 6, 2, 32
    q = torch.randn(hq, n, d, generator=g).to(dtype)
    k = torch.randn(hkv, prefix + n, d, generator=g).to(dtype)
    v = torch.randn(hkv, prefix + n, d, generator=g).to(dtype)
    mask = torch.ones(n, prefix + n, dtype=torch.bool).tril_(diagonal=prefix)
    ref = prefill_attention(q.float(), k.float(), v.float(), d ** -0.5, mask)
    out = chunk_attention(q, k, v, d ** -0.5)
    assert out.dtype == dtype and out.shape == q.shape
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-2)
    torch.testing.assert_close(out.float(), ref, **tol)


def test_weight_streams_prefetch_in_software_except_on_amd(monkeypatch):
    """ops/stream.h's software prefetch is built in on Intel CPUs and left out on AMD ones (a Zen 4's hardware
    prefetchers read the stream faster alone); TOKENMILL_STREAM_PREFETCH decides instead, and the flag is part
    of the build's cache key, so both builds can sit in the cache."""
    monkeypatch.delenv("TOKENMILL_STREAM_PREFETCH", raising=False)
    for vendor, prefetch in (("GenuineIntel", True), ("AuthenticAMD", False)):
        monkeypatch.setattr(native, "cpu_vendor", lambda vendor=vendor: vendor)
        assert native.stream_prefetch() is prefetch
        assert ("-DTM_NO_STREAM_PREFETCH" in native.compile_flags()) is not prefetch
    src = [Path(native.__file__).with_name("cpu_gemv.c")]
    paths = set()
    for env in ("0", "1"):
        monkeypatch.setenv("TOKENMILL_STREAM_PREFETCH", env)
        assert native.stream_prefetch() is (env == "1")
        paths.add(native.library_path(src))
    assert len(paths) == 2


def test_attention_kernel_refuses_what_it_cannot_run():
    q = torch.zeros(2, 4, 16)
    assert not cpu_attention.supports(torch.zeros(2, 4, 12), torch.zeros(4, 16, 2, 12))  # D % 16
    assert not cpu_attention.supports(q.half(), torch.zeros(4, 16, 2, 16).half())
    assert not cpu_attention.supports(q, torch.zeros(4, 16, 3, 16))  # 4 query heads over 3 KV heads
    assert not cpu_attention.supports(q, torch.zeros(4, 16, 2, 16, dtype=torch.bfloat16))  # dtype mismatch


@needs_attention_kernel
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_decodes_the_same_with_the_attention_kernel(model_dirs, dtype, monkeypatch):
    path, _ = model_dirs["llama"]
    prompts = random_prompts([1, 5, 16, 17, 40, 70], seed=42)  # one-token and block-boundary prompts
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    # the per-op path (enforce_eager: not the one-call decode step, whose attention is its own C code)
    plain = make_llm(path, dtype=dtype, enforce_eager=True)
    plain.llm_engine.core.runner.backend.use_kernel = False
    ref = plain.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    calls = []
    real = cpu_attention.paged_decode_attention
    monkeypatch.setattr(cpu_attention, "paged_decode_attention", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    llm = make_llm(path, dtype=dtype, enforce_eager=True)
    out = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    assert calls and max(calls) > 1  # batched decodes went through the kernel
    got, want = [o.outputs[0].token_ids for o in out], [r.outputs[0].token_ids for r in ref]
    if dtype == "float32":
        assert got == want
    else:  # bfloat16 rounds differently in the two paths: allow a late divergence, not an early one
        assert all(g[:4] == w[:4] for g, w in zip(got, want))
        assert sum(a == b for g, w in zip(got, want) for a, b in zip(g, w)) >= 0.75 * 20 * len(prompts)
    llm.llm_engine.check_invariants()
