"""Persistent Triton gather of (block, layer, kv-head) slices from the host store into the working
set (``gather_blocks``).

Host store, per K and V: ``[num_host_blocks, num_layers, Hk, B, D]``, pinned CPU memory on GPU
machines; one ``[B, D]`` slice is contiguous (4 KiB at B=16, D=128, bf16). A Triton kernel on CUDA
reads a pinned CPU tensor passed as an argument through unified virtual addressing (UVA), so the
copy needs no contiguous staging and no copy engine, and it can be captured in a CUDA graph (a
replay reads the host memory as it is at replay time). Working set, per layer: ``[S, Hk, W, B, D]``,
seen here flattened as ``[S * Hk * W, B, D]`` slots.

Why persistent: measured on an H200 (PCIe Gen5 x16, 55 GB/s for one large cudaMemcpy), a gather with
one program per slice takes every SM and does not overlap with model kernels on another stream; a
grid of 32-64 programs, each looping over slices ``i = pid, pid + P, ...``, still moves 50-51 GB/s
and overlaps almost perfectly. So the grid is ``min(num_programs, M)``, never M. Each iteration
moves a slice of K and of V with one (or a few) vectorized loads of B*D elements each.

Does not know: which slices to move or when a slot may be overwritten (``kv/`` orders that with
CUDA events: a slot is readable only after the gather that fills it has completed on its stream).
"""
import torch
import triton
import triton.language as tl

from oasiskv.kernels.fp8 import check_scales

_MAX_CHUNK = 4096  # elements per load/store; a B=16, D=128 slice (2048) moves in one
_NUM_WARPS = 4


# (the item count follows a context's length: not specialised on, see ``block_scores``)
@triton.jit(do_not_specialize=["num_items"])
def _gather_kernel(
    host_k_ptr, host_v_ptr, ws_k_ptr, ws_v_ptr, src_block_ptr, src_head_ptr, dst_slot_ptr,
    host_ks_ptr, host_vs_ptr, ws_ks_ptr, ws_vs_ptr,
    num_items, layer_off_k, layer_off_v,
    stride_kb, stride_kh, stride_vb, stride_vh, stride_wk, stride_wv,
    layer_off_s, stride_sb, stride_sh, stride_ws,
    SLICE: tl.constexpr, CHUNK: tl.constexpr, ITEMS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, QUANT: tl.constexpr,
):
    """Program ``pid`` copies tiles ``pid, pid + P, ...`` (P = number of programs) of ``ITEMS``
    consecutive items of the index lists; one tile's loads are all in flight together."""
    offs = tl.arange(0, CHUNK)
    offs_i = tl.arange(0, ITEMS)
    for start in range(tl.program_id(0) * ITEMS, num_items, tl.num_programs(0) * ITEMS):
        item = start + offs_i
        in_range = item < num_items
        block = tl.load(src_block_ptr + item, mask=in_range, other=-1).to(tl.int64)
        head = tl.load(src_head_ptr + item, mask=in_range, other=0).to(tl.int64)
        dst = tl.load(dst_slot_ptr + item, mask=in_range, other=0).to(tl.int64)
        live = block >= 0
        block = tl.maximum(block, 0)
        src_k = host_k_ptr + layer_off_k + block * stride_kb + head * stride_kh
        src_v = host_v_ptr + layer_off_v + block * stride_vb + head * stride_vh
        dst_k = ws_k_ptr + dst * stride_wk
        dst_v = ws_v_ptr + dst * stride_wv
        for c in tl.static_range(0, SLICE, CHUNK):
            mask = live[:, None] & (c + offs < SLICE)[None, :]
            k = tl.load(src_k[:, None] + c + offs[None, :], mask=mask)
            v = tl.load(src_v[:, None] + c + offs[None, :], mask=mask)
            tl.store(dst_k[:, None] + c + offs[None, :], k.to(ws_k_ptr.dtype.element_ty), mask=mask)
            tl.store(dst_v[:, None] + c + offs[None, :], v.to(ws_v_ptr.dtype.element_ty), mask=mask)
        if QUANT:  # the slices' B row scales, in flight with them
            offs_b = tl.arange(0, BLOCK_SIZE)
            src_s = (layer_off_s + block * stride_sb + head * stride_sh)[:, None] + offs_b[None, :]
            dst_s = (dst * stride_ws)[:, None] + offs_b[None, :]
            ks = tl.load(host_ks_ptr + src_s, mask=live[:, None])
            vs = tl.load(host_vs_ptr + src_s, mask=live[:, None])
            tl.store(ws_ks_ptr + dst_s, ks, mask=live[:, None])
            tl.store(ws_vs_ptr + dst_s, vs, mask=live[:, None])


def gather_blocks(host_k: torch.Tensor, host_v: torch.Tensor, layer: int, ws_k: torch.Tensor,
                  ws_v: torch.Tensor, src_block: torch.Tensor, src_head: torch.Tensor,
                  dst_slot: torch.Tensor, num_programs: int = 64, items_per_iter: int = 1,
                  scales: tuple[torch.Tensor, ...] | None = None) -> None:
    """Copy ``host[src_block[i], layer, src_head[i]]`` into working-set slot ``dst_slot[i]``,
    K and V.

    host_k, host_v: ``[num_host_blocks, num_layers, Hk, B, D]``, same shape, each ``[B, D]`` slice
    contiguous (other strides free); pinned CPU memory (read through UVA) or device memory on CUDA,
    any memory under the interpreter. layer: layer index. ws_k, ws_v: one layer's working set,
    ``[..., B, D]`` that flattens to ``[S * Hk * W, B, D]`` (e.g. contiguous ``[S, Hk, W, B, D]``);
    values are cast to its dtype. src_block, src_head, dst_slot: int32/int64 ``[M]`` on the kernel's
    device; items with ``src_block[i] < 0`` are skipped (padding), other indices must be in range
    and the destination slots distinct. num_programs: grid size bound
    (P = min(num_programs, cdiv(M, items_per_iter))); items_per_iter (a power of two): items one
    program moves per loop iteration, all loads in flight at once, so fewer programs keep PCIe busy.
    8-bit slices (``kernels/fp8.py``) travel with their row scales: ``scales`` = float32
    ``(host_k_scale, host_v_scale, ws_k_scale, ws_v_scale)``, the four tensors' shapes without the
    last dim (last-dim stride 1; K and V scales with the same strides), copied in the same loop.
    Returns once launched: no host sync, CUDA-graph capturable (the grid depends on M, a shape).
    """
    num_host_blocks, num_layers, num_kv_heads, block_size, head_dim = host_k.shape
    assert host_v.shape == host_k.shape, (
        f"host_k {tuple(host_k.shape)} and host_v {tuple(host_v.shape)} differ")
    for host in (host_k, host_v):
        assert host.stride(4) == 1 and host.stride(3) == head_dim, (
            "host store: [B, D] slices must be contiguous")
    assert 0 <= layer < num_layers, f"layer {layer} out of range 0..{num_layers - 1}"
    assert ws_k.shape == ws_v.shape and ws_k.shape[-2:] == (block_size, head_dim), (
        f"working set {tuple(ws_k.shape)} does not hold [{block_size}, {head_dim}] slices")
    flat_k = ws_k.view(-1, block_size, head_dim)  # raises unless the leading dims flatten
    flat_v = ws_v.view(-1, block_size, head_dim)
    for flat in (flat_k, flat_v):
        assert flat.stride(2) == 1 and flat.stride(1) == head_dim, (
            "working set: [B, D] slots must be contiguous")
    m = src_block.shape[0]
    # index lists are read as packed arrays (an expanded, stride-0 view would be read past its end)
    src_block, src_head, dst_slot = (src_block.contiguous(), src_head.contiguous(),
                                     dst_slot.contiguous())
    assert src_block.shape == src_head.shape == dst_slot.shape == (m,)
    assert num_programs >= 1 and items_per_iter >= 1 and items_per_iter & (items_per_iter - 1) == 0
    device = src_block.device
    host_ks, host_vs = check_scales(None if scales is None else scales[:2], host_k, device)
    ws_ks, ws_vs = check_scales(None if scales is None else scales[2:], ws_k, device)
    flat_ks, flat_vs = ws_ks.view(-1, ws_ks.shape[-1]), ws_vs.view(-1, ws_vs.shape[-1])
    assert host_ks.stride() == host_vs.stride() and flat_ks.stride() == flat_vs.stride()
    if m == 0:
        return
    slice_len = block_size * head_dim
    _gather_kernel[(min(num_programs, triton.cdiv(m, items_per_iter)),)](
        host_k, host_v, flat_k, flat_v, src_block, src_head, dst_slot,
        host_ks, host_vs, flat_ks, flat_vs,
        m, layer * host_k.stride(1), layer * host_v.stride(1),
        host_k.stride(0), host_k.stride(2), host_v.stride(0), host_v.stride(2),
        flat_k.stride(0), flat_v.stride(0),
        layer * host_ks.stride(1), host_ks.stride(0), host_ks.stride(2), flat_ks.stride(0),
        SLICE=slice_len, CHUNK=min(_MAX_CHUNK, triton.next_power_of_2(slice_len)),
        ITEMS=items_per_iter, BLOCK_SIZE=block_size, QUANT=scales is not None,
        num_warps=_NUM_WARPS,
    )
