"""Triton kernel that writes new tokens' K/V rows into the paged KV cache (``store_kv``).

Cache layout (shared with ``paged_decode``): ``[num_blocks, num_kv_heads, block_size, head_dim]``; a
token's slot is ``block_id * block_size + offset``. The caches may also be strided views whose last
two dims ``[block_size, head_dim]`` are contiguous, e.g. one layer ``host_k[:, layer]`` of the
tiered host store ``[num_host_blocks, num_layers, Hk, B, D]`` (block stride
``num_layers * Hk * B * D``).
"""
import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kn, stride_kh, stride_vn, stride_vh,
    stride_kcb, stride_kch, stride_vcb, stride_vch, stride_cs,
    num_heads, head_dim,
    BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One program per token: copies its ``[num_heads, head_dim]`` K and V rows into the cache
    slot."""
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < num_heads) & (dims < head_dim) & (slot >= 0)
    blk, in_blk = slot // BLOCK_SIZE, (slot % BLOCK_SIZE) * stride_cs + dims
    k = tl.load(k_ptr + tok * stride_kn + heads * stride_kh + dims, mask=mask)
    tl.store(k_cache_ptr + blk * stride_kcb + heads * stride_kch + in_blk,
             k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    v = tl.load(v_ptr + tok * stride_vn + heads * stride_vh + dims, mask=mask)
    tl.store(v_cache_ptr + blk * stride_vcb + heads * stride_vch + in_blk,
             v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write ``k[i]``/``v[i]`` into cache slot ``slot_mapping[i]``, in place; negative slots are
    skipped.

    k, v: ``[N, num_kv_heads, head_dim]``, any float dtype, last-dim stride 1 (other strides free).
    k_cache, v_cache: ``[num_blocks, num_kv_heads, block_size, head_dim]``, same shape/dtype, each
    with its last two dims contiguous (strides of dims 0 and 1 free, e.g. a layer view of the host
    store); values are cast to the cache dtype. slot_mapping: int32/int64 ``[N]``. Duplicate
    non-negative slots leave an unspecified one of the duplicates in the cache. Does not
    synchronize; CUDA-graph capturable.
    """
    n, num_heads, head_dim = k.shape
    assert v.shape == k.shape, f"k {tuple(k.shape)} and v {tuple(v.shape)} differ"
    assert k_cache.shape == v_cache.shape and k_cache.dtype == v_cache.dtype
    assert k_cache.dim() == 4 and k_cache.shape[1] == num_heads and k_cache.shape[3] == head_dim, (
        f"cache {tuple(k_cache.shape)} does not fit k {tuple(k.shape)}")
    for cache in (k_cache, v_cache):
        assert cache.stride(3) == 1 and cache.stride(2) == head_dim, (
            f"cache {tuple(cache.shape)} with strides {cache.stride()}: "
            f"its last two dims must be contiguous")
    assert k.stride(2) == 1 and v.stride(2) == 1, "k/v need last-dim stride 1"
    assert slot_mapping.shape == (n,) and slot_mapping.dtype in (torch.int32, torch.int64)
    slot_mapping = slot_mapping.contiguous()  # read as a packed array
    if n == 0:
        return
    _store_kv_kernel[(n,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        k_cache.stride(2),
        num_heads, head_dim,
        BLOCK_SIZE=k_cache.shape[2],
        BLOCK_H=triton.next_power_of_2(num_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )
