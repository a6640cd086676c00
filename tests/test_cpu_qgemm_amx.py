"""The weight-only AMX-BF16 GEMMs (ops/cpu_qgemm_amx.c) against their float32 twin, on the int8 and int4
panels the GEMVs read."""
import pytest
import torch

from tokenmill.ops import cpu_qgemm_amx, cpu_qgemv
from tokenmill.quantization.awq_format import dequantize_w4, quantize_w4, unpack_int4

pytestmark = pytest.mark.skipif(not cpu_qgemm_amx.available(), reason="needs a CPU with AMX-BF16")


def assert_bf16_close(y, ref):
    """y is ref rounded once to bfloat16, up to the float32 summation order: within one bf16 ulp."""
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), ref.float(), rtol=2 ** -7, atol=1e-6 * ref.abs().max().item())


@pytest.mark.parametrize("m", [1, 9, 16, 33, 70])
@pytest.mark.parametrize("n, k, group", [(32, 64, 32), (64, 256, 64), (96, 384, 128), (160, 4864, 128)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_int4_gemm_matches_twin(m, n, k, group, with_bias):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    w = torch.randn(n, k, generator=g)
    qweight, qzeros, scales = quantize_w4(w, group)
    q, z = unpack_int4(qweight).t(), unpack_int4(qzeros)
    x = torch.randn(m, k, generator=g).bfloat16()
    bias = torch.randn(n, generator=g) if with_bias else None
    y = cpu_qgemm_amx.gemm_int4(x, *cpu_qgemv.pack_int4(q, scales, z, group), group, bias)
    assert_bf16_close(y, cpu_qgemm_amx.twin(x, q, scales.float().t(), z.t(), group, bias))
    # the twin itself is the AWQ product: (q - z) * s applied in float32
    dense = x.float() @ dequantize_w4(qweight, qzeros, scales, group).t() + (0 if bias is None else bias)
    torch.testing.assert_close(y.float(), dense, rtol=2 ** -7, atol=1e-5 * dense.abs().max().item())


@pytest.mark.parametrize("m", [1, 9, 16, 33, 70])
@pytest.mark.parametrize("n, k", [(32, 32), (64, 896), (160, 4864)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_int8_gemm_matches_twin(m, n, k, with_bias):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    q = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)  # -128 too: exact in bfloat16
    s = torch.rand(n, generator=g) * 0.01
    x = torch.randn(m, k, generator=g).bfloat16()
    bias = torch.randn(n, generator=g) if with_bias else None
    y = cpu_qgemm_amx.gemm_int8(x, cpu_qgemv.pack_int8(q), s, bias)
    assert_bf16_close(y, cpu_qgemm_amx.twin(x, q, s[:, None], None, k, bias))


def test_int4_group_scales_apply_after_each_groups_dot_product():
    """Groups whose scales differ by 2^20: a weight rounded to bfloat16 before the product, or one scale for
    the whole row, would lose the small group entirely."""
    n, k, group = 32, 128, 32
    q = torch.randint(0, 16, (n, k), dtype=torch.int32)
    z = torch.full((k // group, n), 8, dtype=torch.int32)
    scales = torch.tensor([1.0, 2.0 ** -20, 1.0, 2.0 ** -20])[:, None].expand(k // group, n).half()
    x = torch.zeros(2, k)
    x[0, group:2 * group] = 1.0  # only the tiny group contributes to row 0
    x[1] = torch.randn(k)
    x = x.bfloat16()
    y = cpu_qgemm_amx.gemm_int4(x, *cpu_qgemv.pack_int4(q, scales, z, group), group)
    ref = cpu_qgemm_amx.twin(x, q, scales.float().t(), z.t(), group)
    assert_bf16_close(y, ref)
    assert (y[0] != 0).any()
