"""The W8A8 passes and the AMX GEMM (ops/cpu_w8a8.c) against their torch twins, bit for bit."""
import pytest
import torch

from tokenmill.ops import cpu_w8a8
from tokenmill.quantization.awq_format import quantize_w8
from tokenmill.quantization.int8 import quantize_rows, w8a8_linear_ref

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


amx = pytest.mark.skipif(not cpu_w8a8.amx_available(), reason="needs a CPU with AMX-INT8")


@amx
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m, k, n, bias", [(1, 64, 32, False), (5, 128, 96, True), (33, 896, 64, True),
                                           (700, 896, 32, False), (200, 4864, 64, True)])
def test_amx_w8a8_matches_the_twin(dtype, m, k, n, bias):
    """Exact int32 accumulation and the twin's float order: bit-identical, across the row chunks of a prefill
    (700 rows at K = 896 and 200 at K = 4864 take two and three chunks) and odd row-block counts."""
    g = torch.Generator().manual_seed(m + k + n)
    w = torch.randn(n, k, generator=g) * 0.05
    x = (torch.randn(m, k, generator=g) * torch.rand(m, 1, generator=g) * 4).to(dtype)
    q, s = quantize_w8(w)
    s = s.float()
    b = torch.randn(n, generator=g) if bias else None
    packed = cpu_w8a8.pack_amx(q)
    assert torch.equal(cpu_w8a8.unpack_amx(packed), q)
    xq, t = cpu_w8a8.quantize_rows_u8(x, cpu_w8a8.amx_rows(m), 127, 0)
    y = cpu_w8a8.w8a8_amx(xq.view(torch.int8), t, packed, s, b, dtype)
    assert torch.equal(y, w8a8_linear_ref(x, q, s, b))


@amx
def test_w8a8_layers_take_the_amx_kernel():
    from tokenmill.layers.linear import Linear, LoadContext
    from tokenmill.quantization.int8 import Int8LinearMethod

    layer = Linear(128, 96, bias=True, method=Int8LinearMethod(from_checkpoint=False, activations=True))
    layer.weight.data.normal_()
    layer.bias.data.normal_()
    w, b = layer.weight.data.clone(), layer.bias.data.clone()
    layer.method.process_after_loading(layer, LoadContext(device="cpu", dtype=torch.float32, cpu_kernel="auto"))
    assert layer.amx_panels is not None and layer.qweight.numel() == 0  # one copy of the codes
    x = torch.randn(3, 128)
    q, s = quantize_w8(w)
    assert torch.equal(layer.method.apply(layer, x), w8a8_linear_ref(x, q, s.float(), b))
