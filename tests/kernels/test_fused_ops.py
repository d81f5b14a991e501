"""fused_ops (Triton) vs their torch references: rms_norm (+ residual), qk_norm_rope, silu_mul."""
import pytest
import torch

from oasiskv.config import RopeConfig
from oasiskv.kernels import fused_ops, reference
from oasiskv.layers.rotary import RotaryEmbedding

DTYPES = [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)]

@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(dtype, tol, with_residual):
    x = torch.randn(5, 48).to(dtype)
    w = (1 + 0.1 * torch.randn(48)).to(dtype)
    res = torch.randn(5, 48).to(dtype) if with_residual else None
    got = fused_ops.rms_norm(x, w, 1e-6, res)
    want = reference.rms_norm_ref(x, w, 1e-6, res)
    for g, r in zip(got if with_residual else [got], want if with_residual else [want]):
        torch.testing.assert_close(g.float(), r.float(), rtol=tol, atol=tol)

@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("with_norm", [False, True])
def test_qk_norm_rope_in_place_on_strided_views(dtype, tol, with_norm):
    t, hq, hk, d = 3, 4, 2, 32
    qkv = torch.randn(t, (hq + 2 * hk) * d).to(dtype)
    rope = RotaryEmbedding(d, 64, RopeConfig(10000.0))
    positions = torch.tensor([0, 17, 63])
    weights = (((1 + 0.1 * torch.randn(d)).to(dtype), (1 + 0.1 * torch.randn(d)).to(dtype))
               if with_norm else (None, None))

    def split(buf):
        q, k, _ = buf.split([hq * d, hk * d, hk * d], dim=-1)
        return q.view(t, hq, d), k.view(t, hk, d)

    ref_buf, got_buf = qkv.clone(), qkv.clone()
    reference.qk_norm_rope_ref(*split(ref_buf), positions, rope.cos_sin, *weights, 1e-6)
    fused_ops.qk_norm_rope(*split(got_buf), positions, rope.cos_sin, *weights, 1e-6)
    torch.testing.assert_close(got_buf.float(), ref_buf.float(), rtol=tol, atol=tol)
    assert torch.equal(got_buf[:, (hq + hk) * d:], qkv[:, (hq + hk) * d:])  # v untouched

@pytest.mark.parametrize("dtype,tol", DTYPES)
def test_silu_mul(dtype, tol):
    x = torch.randn(4, 2 * 40).to(dtype)
    torch.testing.assert_close(fused_ops.silu_mul(x).float(), reference.silu_mul_ref(x).float(),
                               rtol=tol, atol=tol)

@pytest.mark.gpu
def test_fused_ops_gpu_realistic(cuda_device):
    t, hidden, hq, hk, d = 64, 4096, 32, 8, 128
    x = torch.randn(t, hidden, device=cuda_device, dtype=torch.bfloat16)
    res = torch.randn_like(x)
    w = torch.rand(hidden, device=cuda_device, dtype=torch.bfloat16) + 0.5
    for g, r in zip(fused_ops.rms_norm(x, w, 1e-6, res), reference.rms_norm_ref(x, w, 1e-6, res)):
        torch.testing.assert_close(g.float(), r.float(), rtol=1.6e-2, atol=1.6e-2)
    qkv = torch.randn(t, (hq + 2 * hk) * d, device=cuda_device, dtype=torch.bfloat16)
    rope = RotaryEmbedding(d, 40960, RopeConfig(1e6)).to(cuda_device)
    pos = torch.randint(0, 40960, (t,), device=cuda_device)
    nw = (torch.rand(d, device=cuda_device, dtype=torch.bfloat16) + 0.5,) * 2
    a, b = qkv.clone(), qkv.clone()
    for buf, fn in ((a, fused_ops.qk_norm_rope), (b, reference.qk_norm_rope_ref)):
        q, k, _ = buf.split([hq * d, hk * d, hk * d], dim=-1)
        fn(q.view(t, hq, d), k.view(t, hk, d), pos, rope.cos_sin, *nw, 1e-6)
    torch.testing.assert_close(a.float(), b.float(), rtol=1.6e-2, atol=1.6e-2)
    gu = torch.randn(t, 2 * 12288, device=cuda_device, dtype=torch.bfloat16)
    torch.testing.assert_close(fused_ops.silu_mul(gu).float(), reference.silu_mul_ref(gu).float(),
                               rtol=1.6e-2, atol=1.6e-2)
