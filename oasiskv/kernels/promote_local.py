"""Triton promotion of filled local blocks into the working set (``promote_local``).

A sequence's local block (working-set slot W-1) fills as it decodes; when its last token is written
the block is complete and, per kv head, moves into a block slot of the working set: the first empty
slot (``ws_map`` < 0), else the least recently selected one (smallest ``ws_last``; ties to the
lowest slot), the paper's rule for newly generated blocks (no fetch, so no fetch cap). The slot then
holds logical block ``block[n]`` stamped ``now``; the local slot is free to fill again.

Kernel grid ``(N, Hk)``: one program per (row, kv head); rows that are not ``done`` return at once,
so a step costs one launch per layer whatever the batch, and moves only the blocks that completed.
Grid depends on shapes only: CUDA-graph capturable.

Does not know: summaries (the caller summarises the block first) or the host store.
"""
import torch
import triton
import triton.language as tl

from oasiskv.kernels.fp8 import as_bytes

_INT64_MIN = -(2 ** 63)
_INT64_MAX = 2 ** 63 - 1


@triton.jit
def _promote_kernel(
    ws_k_ptr, ws_v_ptr, k_scale_ptr, v_scale_ptr, map_ptr, last_ptr, slots_ptr, done_ptr,
    block_ptr, now_ptr,
    stride_ks, stride_kh, stride_kw, stride_vs, stride_vh, stride_vw,
    stride_ss, stride_sh, stride_sw, stride_ms, stride_mh, stride_ls, stride_lh,
    K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    QUANT: tl.constexpr, INT64_MIN: tl.constexpr, INT64_MAX: tl.constexpr,
):
    row = tl.program_id(0)
    head = tl.program_id(1)
    if tl.load(done_ptr + row) == 0:
        return
    slot = tl.load(slots_ptr + row).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    in_k = offs_k < K
    map_row = map_ptr + slot * stride_ms + head * stride_mh
    last_row = last_ptr + slot * stride_ls + head * stride_lh
    held = tl.load(map_row + offs_k, mask=in_k, other=0)
    last = tl.load(last_row + offs_k, mask=in_k, other=0)
    key = tl.where(held < 0, INT64_MIN, last)
    victim = tl.argmin(tl.where(in_k, key, INT64_MAX), 0)

    offs = tl.arange(0, BLOCK_SIZE * HEAD_DIM)  # a block's [B, D] rows are contiguous
    k_head = ws_k_ptr + slot * stride_ks + head * stride_kh
    v_head = ws_v_ptr + slot * stride_vs + head * stride_vh
    tl.store(k_head + victim * stride_kw + offs, tl.load(k_head + K * stride_kw + offs))
    tl.store(v_head + victim * stride_vw + offs, tl.load(v_head + K * stride_vw + offs))
    if QUANT:
        offs_t = tl.arange(0, BLOCK_SIZE)
        scale_head = slot * stride_ss + head * stride_sh
        tl.store(k_scale_ptr + scale_head + victim * stride_sw + offs_t,
                 tl.load(k_scale_ptr + scale_head + K * stride_sw + offs_t))
        tl.store(v_scale_ptr + scale_head + victim * stride_sw + offs_t,
                 tl.load(v_scale_ptr + scale_head + K * stride_sw + offs_t))
    tl.store(map_row + victim, tl.load(block_ptr + row).to(tl.int32))
    tl.store(last_row + victim, tl.load(now_ptr))


def promote_local(ws_k: torch.Tensor, ws_v: torch.Tensor,
                  scales: tuple[torch.Tensor, torch.Tensor] | None, ws_map: torch.Tensor,
                  ws_last: torch.Tensor, slots: torch.Tensor, done: torch.Tensor,
                  block: torch.Tensor, now: torch.Tensor) -> None:
    """Move the local block of each ``done`` row into a block slot of its working set, per head.

    ws_k, ws_v: one layer's working sets ``[S, Hk, W, B, D]`` (last two dims contiguous; slot W-1 is
    the local block); 8-bit ones come with ``scales`` (k, v) float32 ``[S, Hk, W, B]`` (last-dim
    stride 1), moved with their rows. ws_map: int32 ``[S, Hk, W]`` logical block per slot (-1
    empty), ws_last: int64 ``[S, Hk, W-1]`` step each slot was last selected (last-dim strides 1).
    slots: ``[N]`` each row's sequence slot; done: bool ``[N]``; block: ``[N]`` the logical index
    of each row's local block; now: 0-d int64, the stamp. Per (row n with ``done[n]``, head h): slot
    j = the first with ``ws_map[s, h, j] < 0``, else the one with the smallest ``ws_last`` (lowest j
    on ties); ``ws_k/ws_v[s, h, j] = ws_k/ws_v[s, h, W-1]``, ``ws_map[s, h, j] = block[n]``,
    ``ws_last[s, h, j] = now``. Rows not done change nothing. No host sync.
    """
    num_seqs, heads, width, block_size, head_dim = ws_k.shape
    assert ws_v.shape == ws_k.shape and ws_map.shape == (num_seqs, heads, width)
    assert ws_last.shape == (num_seqs, heads, width - 1) and ws_last.dtype == torch.int64
    for ws in (ws_k, ws_v):
        assert ws.stride(4) == 1 and ws.stride(3) == head_dim, "block rows must be contiguous"
    assert ws_map.stride(2) == 1 and ws_last.stride(2) == 1
    n = slots.shape[0]
    assert done.shape == (n,) and block.shape == (n,) and now.dim() == 0
    if n == 0:
        return
    k_scale, v_scale = scales if scales is not None else (ws_map, ws_map)  # placeholders
    if scales is not None:
        assert k_scale.stride() == v_scale.stride() and k_scale.stride(3) == 1
    _promote_kernel[(n, heads)](
        as_bytes(ws_k), as_bytes(ws_v), k_scale, v_scale, ws_map, ws_last, slots.contiguous(),
        done.contiguous(), block.contiguous(), now,
        ws_k.stride(0), ws_k.stride(1), ws_k.stride(2), ws_v.stride(0), ws_v.stride(1),
        ws_v.stride(2), k_scale.stride(0), k_scale.stride(1), k_scale.stride(2),
        ws_map.stride(0), ws_map.stride(1), ws_last.stride(0), ws_last.stride(1),
        K=width - 1, BLOCK_K=triton.next_power_of_2(max(width - 1, 1)), BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim, QUANT=scales is not None, INT64_MIN=_INT64_MIN, INT64_MAX=_INT64_MAX,
    )
