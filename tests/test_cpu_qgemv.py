"""The quantized batch-1 GEMV kernels (ops/cpu_qgemv.c) against their dequantizing twins."""
import pytest
import torch

from tokenmill.ops import cpu_qgemv
from tokenmill.quantization.awq_format import dequantize_w4, quantize_w4, unpack_int4
from tokenmill.quantization.int8 import w8a16_linear_ref

pytestmark = pytest.mark.skipif(not cpu_qgemv.available(), reason="needs gcc and an AVX512-BF16 CPU")


@pytest.mark.parametrize("n, k", [(16, 8), (48, 100), (1024, 896)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_int8_gemv_matches_twin(n, k, dtype, with_bias):
    g = torch.Generator().manual_seed(n + k)
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    s = torch.rand(n, generator=g) * 0.01
    x = torch.randn(1, k, generator=g).to(dtype)
    bias = torch.randn(n, generator=g) if with_bias else None
    y = cpu_qgemv.gemv_int8(x, cpu_qgemv.pack_int8(q), s, bias)
    ref = w8a16_linear_ref(x.float(), q, s, bias)
    assert y.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(y.float(), ref, atol=tol * ref.abs().max().item(), rtol=0)


@pytest.mark.parametrize("n, k, group", [(16, 64, 32), (48, 128, 64), (512, 896, 128)])
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


def test_unsupported_shapes_are_declined():
    assert not cpu_qgemv.supports(40, 64)  # rows come in panels of 16
    assert not cpu_qgemv.supports(32, 100, 64)  # K must split into whole groups
