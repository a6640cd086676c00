"""The quantized batch-1 GEMV kernels (ops/cpu_qgemv.c) against their dequantizing twins."""
import pytest
import torch

from tokenmill.ops import cpu_qgemv
from tokenmill.quantization.awq_format import dequantize_w4, quantize_w4, unpack_int4
from tokenmill.quantization.int8 import w8a16_linear_ref

pytestmark = pytest.mark.skipif(not cpu_qgemv.available(), reason="needs gcc and an x86-64 CPU with AVX2 + FMA")


@pytest.mark.parametrize("n, k", [(16, 8), (48, 100), (32, 98), (1024, 896)])  # 98: k lines end on one k pair
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_int8_gemv_matches_twin(n, k, dtype, with_bias):
    if not cpu_qgemv.supports(n, k):
        pytest.skip("this build's int8 lines hold k quads")
    g = torch.Generator().manual_seed(n + k)
    q = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)  # -128 too: the quad lines offset codes
    s = torch.rand(n, generator=g) * 0.01
    x = torch.randn(1, k, generator=g).to(dtype)
    bias = torch.randn(n, generator=g) if with_bias else None
    y = cpu_qgemv.gemv_int8(x, cpu_qgemv.pack_int8(q), s, bias)
    ref = w8a16_linear_ref(x.float(), q, s, bias)
    assert y.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(y.float(), ref, atol=tol * ref.abs().max().item(), rtol=0)


@pytest.mark.parametrize("n, k, group", [(16, 64, 32), (48, 128, 64), (512, 896, 128), (32, 96, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_gemv_matches_awq_twin(n, k, group, dtype):
    g = torch.Generator().manual_seed(n * k)
    w = torch.randn(n, k, generator=g)
    qweight, qzeros, scales = quantize_w4(w, group)
    x = torch.randn(1, k, generator=g).to(dtype)
    bias = torch.randn(n, generator=g)
    panels = cpu_qgemv.pack_int4(unpack_int4(qweight).t(), scales, unpack_int4(qzeros), group)
    y = cpu_qgemv.gemv_int4(x, *panels, group, bias)
    ref = x.float() @ dequantize_w4(qweight, qzeros, scales, group).t() + bias
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(y.float(), ref, atol=tol * ref.abs().max().item(), rtol=0)



@pytest.mark.parametrize("rows", [1, 3])
def test_int4_gemv_of_bfloat16_rows_matches_its_integer_twin(rows):
    """bfloat16 rows may take integer dot products (AVX2), each group of x scaled to 15 bits (`int16_twin`):
    the result is that product rounded once to bfloat16, also where it cancels, for groups spanning
    2^-20 .. 2^4; its error against the float product is within 2^-14 of (each group's largest |x|) . |W|.
    A row holding a NaN still comes out NaN, and the others are unaffected."""
    n, k, group = 64, 256, 64
    g = torch.Generator().manual_seed(7)
    qweight, qzeros, scales = quantize_w4(torch.randn(n, k, generator=g), group)
    w = dequantize_w4(qweight, qzeros, scales, group).double()
    panels = cpu_qgemv.pack_int4(unpack_int4(qweight).t(), scales, unpack_int4(qzeros), group)
    x = (torch.randn(rows, k, generator=g) * torch.exp2(torch.randint(-20, 4, (rows, k), generator=g).float()))
    x = x.bfloat16()
    y = cpu_qgemv.gemv_int4(x, *panels, group).double()
    twin = (cpu_qgemv.int16_twin(x, group) if cpu_qgemv.int16_rows() else x.double()) @ w.t()
    torch.testing.assert_close(y, twin, atol=1e-5, rtol=2 ** -8)
    group_max = x.double().abs().view(rows, -1, group).amax(-1).repeat_interleave(group, -1)
    exact = x.double() @ w.t()
    assert ((y - exact).abs() <= 2 ** -8 * exact.abs() + 2 ** -14 * (group_max @ w.abs().t())).all()
    x[0, 5] = float("nan")
    y = cpu_qgemv.gemv_int4(x, *panels, group)
    assert y[0].isnan().all() and not y[1:].isnan().any()


@pytest.mark.parametrize("rows", [1, 3])
def test_int8_gemv_of_bfloat16_rows_matches_its_integer_twin(rows):
    """The int8 kernels' integer path (AVX-512 VNNI and AVX2, bfloat16 rows): x in blocks of INT8_BLOCK scaled to 15 bits, the
    product rounded once to bfloat16, also where it cancels; a NaN row stays NaN and spares the others."""
    n, k = 48, 4 * cpu_qgemv.INT8_BLOCK
    g = torch.Generator().manual_seed(11)
    q = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
    q[:16] = -128  # a panel at each extreme of the codes (AVX-512 stores them offset by 128)
    q[16:32] = 127
    s = torch.rand(n, generator=g) * 0.01
    w = q.double() * s.double()[:, None]
    x = (torch.randn(rows, k, generator=g) * torch.exp2(torch.randint(-20, 4, (rows, k), generator=g).float()))
    x = x.bfloat16()
    y = cpu_qgemv.gemv_int8(x, cpu_qgemv.pack_int8(q), s).double()
    twin = (cpu_qgemv.int16_twin(x, cpu_qgemv.INT8_BLOCK) if cpu_qgemv.int16_rows() else x.double()) @ w.t()
    torch.testing.assert_close(y, twin, atol=1e-5, rtol=2 ** -8)
    for r in range(rows):  # one row alone (its own kernel at batch 1) gives the bits it gets in a batch
        assert torch.equal(cpu_qgemv.gemv_int8(x[r:r + 1], cpu_qgemv.pack_int8(q), s).double()[0], y[r])
    x[0, 5] = float("nan")
    y = cpu_qgemv.gemv_int8(x, cpu_qgemv.pack_int8(q), s)
    assert y[0].isnan().all() and not y[1:].isnan().any()


def test_int8_bfloat16_rows_at_the_edges():
    """bfloat16 rows through the int8 kernels: K a multiple of 4 but not of INT8_BLOCK (the float path), a block of
    subnormals beside normal ones (its scale 2^(14 - e) must not overflow), and an infinity, which makes its own
    row non-finite and leaves the others alone."""
    g = torch.Generator().manual_seed(5)
    n = 32
    for k in (68, 2 * cpu_qgemv.INT8_BLOCK):
        q = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
        s = (torch.rand(n, generator=g) + 0.5) * 1e28  # so that row 1's products are normal numbers
        x = torch.randn(3, k, generator=g).bfloat16()
        x[1] = (torch.randn(k, generator=g) * 2.0 ** -130).bfloat16()  # subnormal bfloat16
        y = cpu_qgemv.gemv_int8(x, cpu_qgemv.pack_int8(q), s).double()
        ref = w8a16_linear_ref(x.double(), q, s, None).double()
        for row in range(3):
            torch.testing.assert_close(y[row], ref[row], atol=1e-5 * ref[row].abs().max().item(), rtol=2 ** -7)
        x[2, 3] = float("inf")
        y = cpu_qgemv.gemv_int8(x, cpu_qgemv.pack_int8(q), s)
        assert not y[2].isfinite().any() and y[:2].isfinite().all()  # as the float product (inf or NaN)


def test_int8_panels_unpack_to_their_codes():
    q = torch.randint(-128, 128, (48, 200), dtype=torch.int8, generator=torch.Generator().manual_seed(3))
    assert torch.equal(cpu_qgemv.unpack_int8(cpu_qgemv.pack_int8(q)), q)


def test_unsupported_shapes_are_declined():
    assert not cpu_qgemv.supports(40, 64)  # rows come in panels of 16
    assert not cpu_qgemv.supports(32, 100, 64)  # K must split into whole groups
    assert not cpu_qgemv.supports(32, 99)  # int8 lines hold whole k pairs (portable) or quads (AVX-512)
    assert cpu_qgemv.supports(32, 100)
    assert cpu_qgemv.supports(32, 98) == (cpu_qgemv.int8_layout() == 0)  # k quads (AVX-512) hold 4 k each


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantized_panels_are_the_twins_weights(dtype):
    g = torch.Generator().manual_seed(7)
    q = torch.randint(-127, 128, (48, 200), dtype=torch.int8, generator=g)  # K not a multiple of 16
    s = torch.rand(48, generator=g)
    w8 = cpu_qgemv.dequant_int8(cpu_qgemv.pack_int8(q), s, dtype)
    w = torch.randn(32, 96, generator=g)
    qweight, qzeros, scales = quantize_w4(w, 32)
    panels = cpu_qgemv.pack_int4(unpack_int4(qweight).t(), scales, unpack_int4(qzeros), 32)
    w4 = cpu_qgemv.dequant_int4(*panels, 32, dtype)
    assert w8.dtype == w4.dtype == dtype
    exact = dict(atol=0, rtol=0) if dtype == torch.float32 else dict(atol=0, rtol=2 ** -8)
    torch.testing.assert_close(w8.float(), q.float() * s[:, None], **exact)
    torch.testing.assert_close(w4.float(), dequantize_w4(qweight, qzeros, scales, 32), **exact)


@pytest.mark.parametrize("rows", [2, 5, 8, 9, 21])  # over 8: balanced chunks of at most 8 (ops/rows.h)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_multi_row_kernels_match_twins(rows, dtype):
    g = torch.Generator().manual_seed(rows)
    n, k, group = 48, 256, 64
    x = torch.randn(rows, k, generator=g).to(dtype)
    bias = torch.randn(n, generator=g)
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    s = torch.rand(n, generator=g) * 0.01
    y8 = cpu_qgemv.gemv_int8(x, cpu_qgemv.pack_int8(q), s, bias)
    ref8 = w8a16_linear_ref(x.float(), q, s, bias)
    qweight, qzeros, scales = quantize_w4(torch.randn(n, k, generator=g), group)
    panels = cpu_qgemv.pack_int4(unpack_int4(qweight).t(), scales, unpack_int4(qzeros), group)
    y4 = cpu_qgemv.gemv_int4(x, *panels, group, bias)
    ref4 = x.float() @ dequantize_w4(qweight, qzeros, scales, group).t() + bias
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for y, ref in ((y8, ref8), (y4, ref4)):
        assert y.shape == (rows, n) and y.dtype == dtype
        torch.testing.assert_close(y.float(), ref, atol=tol * ref.abs().max().item(), rtol=0)
