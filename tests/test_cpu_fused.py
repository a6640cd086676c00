"""The fused small-op kernels (ops/cpu_fused.c) against their torch twins: bit-identical in bfloat16,
within float32 rounding in float32."""
import pytest
import torch
import torch.nn.functional as F

from tokenmill.ops import cpu_fused
from tokenmill.layers.rotary import RotaryEmbedding, apply_rotary

pytestmark = pytest.mark.skipif(cpu_fused._library() is None, reason="needs gcc and an x86-64 CPU with AVX2 + FMA")
DTYPES = [torch.float32, torch.bfloat16]


def close(a, b, dtype):
    if dtype == torch.bfloat16:
        assert torch.equal(a, b)
    else:
        torch.testing.assert_close(a, b, atol=2e-6, rtol=2e-6)


def rmsnorm_twin(x, residual, w, eps):
    if residual is not None:
        x = x + residual
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype), x


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 9])
def test_add_rmsnorm(dtype, rows):
    g = torch.Generator().manual_seed(rows)
    x, r = (torch.randn(rows, 896, generator=g).to(dtype) for _ in range(2))
    w = torch.randn(896, generator=g).to(dtype)
    ref, ref_sum = rmsnorm_twin(x, r, w, 1e-6)
    r2 = r.clone()
    close(cpu_fused.add_rmsnorm(x, r2, w, 1e-6), ref, dtype)
    close(r2, ref_sum, dtype)  # the residual, updated in place
    close(cpu_fused.add_rmsnorm(x, None, w, 1e-6), rmsnorm_twin(x, None, w, 1e-6)[0], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul(dtype):
    gu = (torch.randn(5, 2 * 704) * 4).to(dtype)
    close(cpu_fused.silu_mul(gu), F.silu(gu[:, :704]) * gu[:, 704:], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_in_place_leaves_other_heads(dtype):
    rot = RotaryEmbedding(64, 512, 1e6, None, dtype)
    cos, sin = rot.cos_sin(torch.tensor([0, 7, 300]))
    qkv = torch.randn(3, 18 * 64).to(dtype)
    ref = apply_rotary(qkv[:, :16 * 64].view(-1, 16, 64), cos, sin)
    out = qkv.clone()
    cpu_fused.rotary_(out, cos, sin, 16, 64)
    close(out[:, :16 * 64].view(-1, 16, 64), ref, dtype)
    assert torch.equal(out[:, 16 * 64:], qkv[:, 16 * 64:])  # v heads untouched


def test_unsupported_inputs_fall_back():
    assert not cpu_fused.usable(torch.randn(2, 40))  # last dim not a multiple of 16
    assert not cpu_fused.usable(torch.randn(2, 64).half())
    assert not cpu_fused.usable(torch.randn(64, 2).t())  # not contiguous
