"""The W8A8 activation passes (ops/cpu_w8a8.c) against their torch twins, bit for bit."""
import pytest
import torch

from tokenmill.ops import cpu_w8a8
from tokenmill.quantization.int8 import quantize_rows

pytestmark = pytest.mark.skipif(cpu_w8a8._library() is None, reason="needs gcc and an x86-64 CPU with AVX2 + FMA")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qmax", [127, 63])
@pytest.mark.parametrize("m, rows, k", [(1, 1, 64), (5, 8, 72), (40, 40, 896)])
def test_quantize_rows_u8_matches_the_twin(dtype, qmax, m, rows, k):
    g = torch.Generator().manual_seed(m * k + qmax)
    x = (torch.randn(m, k, generator=g) * torch.rand(m, 1, generator=g) * 10).to(dtype)
    x[0, 3] = 0.5 * x[0].abs().max()  # exact halves after scaling: round half to even
    if m > 2:
        x[2] = 0  # an all-zero row: the scale floor, codes 0
    xq, t_ref = quantize_rows(x, qmax)
    xu, t = cpu_w8a8.quantize_rows_u8(x, rows, qmax, qmax + 1)
    assert torch.equal(t, t_ref)
    assert torch.equal(xu[:m].to(torch.int16) - (qmax + 1), xq.to(torch.int16))
    assert (xu[m:] == qmax + 1).all()  # padding rows are the zero point
    xs, _ = cpu_w8a8.quantize_rows_u8(x, rows, qmax, 0)  # signed codes, as bits
    assert torch.equal(xs.view(torch.int8)[:m], xq) and (xs[m:] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_rescale_rows_matches_the_twin(dtype, bias):
    g = torch.Generator().manual_seed(7)
    y = torch.randn(8, 40, generator=g) * 1000  # 8 rows from oneDNN, 5 of them real
    t = torch.rand(5, generator=g) / 100
    b = torch.randn(40, generator=g) if bias else None
    ref = y[:5].clone().mul_(t[:, None])
    if b is not None:
        ref += b
    assert torch.equal(cpu_w8a8.rescale_rows(y, t, b, dtype), ref.to(dtype))
