"""store_kv (Triton) and store_kv_ref against each other and an explicit per-token loop."""
import pytest
import torch

from oasiskv.kernels.reference import store_kv_ref
from oasiskv.kernels.store_kv import store_kv


def _inputs(n, num_heads, head_dim, num_blocks, block_size, src_dtype, cache_dtype, slot_dtype,
            device="cpu", seed=0):
    """k/v as non-contiguous views into a fused qkv buffer, NaN-filled caches and a slot mapping
    with unique slots, about a quarter of them negative (padding)."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(n, 3 * num_heads * head_dim, generator=gen).to(src_dtype)
    k = qkv[:, num_heads * head_dim:2 * num_heads * head_dim].view(n, num_heads, head_dim)
    v = qkv[:, 2 * num_heads * head_dim:].view(n, num_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:n]
    slots[torch.rand(n, generator=gen) < 0.25] = -1
    slots[0] = -7
    shape = (num_blocks, num_heads, block_size, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=cache_dtype)
    v_cache = torch.full(shape, float("nan"), dtype=cache_dtype)
    return [t.to(device) for t in (k, v, k_cache, v_cache, slots.to(slot_dtype))]


def _loop_store(k, v, k_cache, v_cache, slots):
    """Independent per-token writer."""
    block_size = k_cache.shape[2]
    for i, slot in enumerate(slots.tolist()):
        if slot >= 0:
            k_cache[slot // block_size, :, slot % block_size] = k[i].to(k_cache.dtype)
            v_cache[slot // block_size, :, slot % block_size] = v[i].to(v_cache.dtype)


def _check(k, v, k_cache, v_cache, slots, rtol=0.0, atol=0.0):
    exp_k, exp_v = torch.full_like(k_cache, float("nan")), torch.full_like(v_cache, float("nan"))
    _loop_store(k, v, exp_k, exp_v, slots)
    # NaN positions (untouched slots) must match exactly; written ones to tolerance.
    torch.testing.assert_close(k_cache, exp_k, rtol=rtol, atol=atol, equal_nan=True)
    torch.testing.assert_close(v_cache, exp_v, rtol=rtol, atol=atol, equal_nan=True)
    written = int((slots >= 0).sum()) * k.shape[1] * k.shape[2]
    assert int((~k_cache.isnan()).sum()) == written and int((~v_cache.isnan()).sum()) == written


@pytest.mark.parametrize("fn", [store_kv, store_kv_ref], ids=["triton", "ref"])
@pytest.mark.parametrize("dtype,slot_dtype,block_size", [
    (torch.float32, torch.int64, 16),
    (torch.bfloat16, torch.int32, 32),
    (torch.float16, torch.int64, 16),
])
def test_store_kv_exact(fn, dtype, slot_dtype, block_size):
    k, v, k_cache, v_cache, slots = _inputs(12, 2, 64, 5, block_size, dtype, dtype, slot_dtype)
    fn(k, v, k_cache, v_cache, slots)
    _check(k, v, k_cache, v_cache, slots)


@pytest.mark.parametrize("fn", [store_kv, store_kv_ref], ids=["triton", "ref"])
def test_store_kv_casts_and_odd_shapes(fn):
    """fp32 -> bf16 cast (the interpreter truncates instead of rounding: allow one bf16 ulp),
    3 heads."""
    k, v, k_cache, v_cache, slots = _inputs(9, 3, 32, 3, 16, torch.float32, torch.bfloat16,
                                            torch.int64, seed=1)
    fn(k, v, k_cache, v_cache, slots)
    _check(k, v, k_cache, v_cache, slots, rtol=8e-3, atol=1e-6)


@pytest.mark.parametrize("fn", [store_kv, store_kv_ref], ids=["triton", "ref"])
def test_store_kv_into_host_store_layer_view(fn):
    """Caches that are one layer of the tiered host store ``[blocks, layers, Hk, B, D]`` (block
    stride layers * Hk * B * D, separate K and V stores): only that layer's written slots change."""
    num_layers, layer = 3, 1
    k, v, _, _, slots = _inputs(10, 2, 32, 4, 16, torch.bfloat16, torch.bfloat16, torch.int32,
                                seed=2)
    host_k = torch.full((4, num_layers, 2, 16, 32), float("nan"), dtype=torch.bfloat16)
    host_v = torch.full_like(host_k, float("nan"))
    k_view, v_view = host_k[:, layer], host_v[:, layer]
    assert not k_view.is_contiguous() and k_view.stride(0) == num_layers * 2 * 16 * 32
    fn(k, v, k_view, v_view, slots)
    _check(k, v, k_view, v_view, slots)
    for other in range(num_layers):
        if other != layer:
            assert host_k[:, other].isnan().all() and host_v[:, other].isnan().all()


def test_store_kv_all_padding_and_empty():
    k, v, k_cache, v_cache, slots = _inputs(4, 2, 16, 2, 16, torch.float32, torch.float32,
                                            torch.int64)
    store_kv(k, v, k_cache, v_cache, torch.full_like(slots, -1))
    store_kv(k[:0], v[:0], k_cache, v_cache, slots[:0])
    assert k_cache.isnan().all() and v_cache.isnan().all()


@pytest.mark.gpu
def test_store_kv_gpu(cuda_device):
    k, v, k_cache, v_cache, slots = _inputs(4096, 8, 128, 2048, 16, torch.bfloat16, torch.bfloat16,
                                            torch.int64, device=cuda_device)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    store_kv(k, v, k_cache, v_cache, slots)
    store_kv_ref(k, v, ref_k, ref_v, slots)
    torch.cuda.synchronize()
    torch.testing.assert_close(k_cache, ref_k, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(v_cache, ref_v, rtol=0, atol=0, equal_nan=True)


@pytest.mark.gpu
def test_store_kv_gpu_into_pinned_host_layer_view(cuda_device):
    """The kernel on CUDA writes straight into one layer of a pinned host store (UVA)."""
    k, v, _, _, slots = _inputs(512, 8, 128, 64, 16, torch.bfloat16, torch.bfloat16, torch.int64,
                                device=cuda_device, seed=3)
    host_k = torch.full((64, 4, 8, 16, 128), float("nan"), dtype=torch.bfloat16).pin_memory()
    host_v = torch.full_like(host_k, float("nan")).pin_memory()
    store_kv(k, v, host_k[:, 2], host_v[:, 2], slots)
    torch.cuda.synchronize()
    _check(k.cpu(), v.cpu(), host_k[:, 2], host_v[:, 2], slots.cpu())
    assert host_k[:, :2].isnan().all() and host_k[:, 3].isnan().all() and host_v[:, 3].isnan().all()
