"""Triton computation of block summaries: element-wise max and min of a block's keys
(``block_minmax``).

Summaries of one layer: ``[num_host_blocks, Hk, 2, D]`` indexed by host block id;
row 0 = element-wise max, row 1 = element-wise min over the block's B post-RoPE keys
(``block_scores`` turns them into a center and a radius). The source is any 4-D view
``[I0, I1, B, D]`` whose last two dims are contiguous: one layer of the host store
(``host_k[:, layer]``: I0 = host block, I1 = kv head; pinned memory is read through UVA) or the
local slots of a working set (``ws_k[:, :, W-1]``: I0 = sequence slot, I1 = kv head), so a block
completed in HBM is summarized without a copy.

Kernel grid ``(M,)``: one program per item reduces one ``[B, D]`` block over its tokens in fp32 and
writes the two rows. Grid depends on shapes only: CUDA-graph capturable.

Does not know: which blocks are complete or where they live (``kv/`` decides and passes indices).
"""
import torch
import triton
import triton.language as tl

from oasiskv.kernels.fp8 import FP8, FP8_MAX, MIN_AMAX, check_scale
from oasiskv.kernels.store_kv import _round_to_e4m3


@triton.jit
def _block_minmax_kernel(
    src_ptr, idx0_ptr, idx1_ptr, summaries_ptr, dst_block_ptr, dst_head_ptr, num_tokens_ptr,
    scale_ptr, out_scale_ptr,
    stride_s0, stride_s1, stride_st, stride_sb, stride_sh, stride_sr, stride_c0, stride_c1,
    stride_o0, stride_o1,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_NUM_TOKENS: tl.constexpr, QUANT: tl.constexpr, OUT_QUANT: tl.constexpr,
    FP8_MAX: tl.constexpr, MIN_AMAX: tl.constexpr,
):
    """Max and min over the tokens of block ``src[idx0[i], idx1[i]]`` into
    ``summaries[dst_block[i], dst_head[i]]``."""
    i = tl.program_id(0)
    dst_block = tl.load(dst_block_ptr + i).to(tl.int64)
    dst_head = tl.load(dst_head_ptr + i).to(tl.int64)
    i0 = tl.load(idx0_ptr + i).to(tl.int64)
    i1 = tl.load(idx1_ptr + i).to(tl.int64)
    offs_t = tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_D)
    live = dst_block >= 0
    t_mask = offs_t < BLOCK_SIZE
    if HAS_NUM_TOKENS:
        n_tok = tl.load(num_tokens_ptr + i)
        live = live & (n_tok > 0)
        t_mask = t_mask & (offs_t < n_tok)
    d_mask = offs_d < HEAD_DIM
    valid = live & t_mask[:, None] & d_mask[None, :]
    x = tl.load(src_ptr + i0 * stride_s0 + i1 * stride_s1 + offs_t[:, None] * stride_st
                + offs_d[None, :], mask=valid, other=0.0).to(tl.float32)
    if QUANT:  # FP8 rows times their scales: the keys attention sees
        x = x * tl.load(scale_ptr + i0 * stride_c0 + i1 * stride_c1 + offs_t,
                        mask=live & t_mask, other=0.0)[:, None]
    hi = tl.max(tl.where(valid, x, float("-inf")), 0)
    lo = tl.min(tl.where(valid, x, float("inf")), 0)
    dst = summaries_ptr + tl.maximum(dst_block, 0) * stride_sb + dst_head * stride_sh + offs_d
    if OUT_QUANT:  # each row quantised on its own, as FP8 K/V rows are (IEEE divisions)
        hi, lo = tl.where(live & d_mask, hi, 0.0), tl.where(live & d_mask, lo, 0.0)  # (unstored)
        s_hi = tl.div_rn(tl.maximum(tl.max(tl.where(d_mask, tl.abs(hi), 0.0), 0), MIN_AMAX),
                         FP8_MAX)
        s_lo = tl.div_rn(tl.maximum(tl.max(tl.where(d_mask, tl.abs(lo), 0.0), 0), MIN_AMAX),
                         FP8_MAX)
        hi = _round_to_e4m3(tl.minimum(tl.maximum(tl.div_rn(hi, s_hi), -FP8_MAX), FP8_MAX))
        lo = _round_to_e4m3(tl.minimum(tl.maximum(tl.div_rn(lo, s_lo), -FP8_MAX), FP8_MAX))
        out_scale = out_scale_ptr + tl.maximum(dst_block, 0) * stride_o0 + dst_head * stride_o1
        tl.store(out_scale, s_hi, mask=live)
        tl.store(out_scale + 1, s_lo, mask=live)
    out_ty = summaries_ptr.dtype.element_ty
    tl.store(dst, hi.to(out_ty), mask=live & d_mask)
    tl.store(dst + stride_sr, lo.to(out_ty), mask=live & d_mask)


def block_minmax(src: torch.Tensor, idx0: torch.Tensor, idx1: torch.Tensor, summaries: torch.Tensor,
                 dst_block: torch.Tensor, dst_head: torch.Tensor,
                 num_tokens: torch.Tensor | None = None,
                 src_scale: torch.Tensor | None = None,
                 summary_scale: torch.Tensor | None = None) -> None:
    """Write the summary of block ``src[idx0[i], idx1[i]]`` to
    ``summaries[dst_block[i], dst_head[i]]``.

    src: ``[I0, I1, B, D]``, last two dims contiguous, strides of dims 0/1 free (e.g.
    ``host_k[:, layer]`` or ``ws_k[:, :, W-1]``); pinned CPU memory (UVA) or device memory on CUDA.
    idx0, idx1, dst_block, dst_head: int32/int64 ``[M]`` on the kernel's device. summaries:
    ``[num_host_blocks, Hk, 2, D]`` (last-dim stride 1): row 0 gets the element-wise max, row 1 the
    min, over the block's tokens, cast to summaries' dtype (rounded to nearest: exact when src has
    the same dtype; a narrower dtype may move the bounds inward by half an ulp). Items with
    ``dst_block[i] < 0`` are skipped. num_tokens: optional int32/int64 ``[M]``: reduce only the
    first ``min(num_tokens[i], B)`` tokens (0 skips the item); default all B (blocks passed are
    complete). An FP8 ``src`` comes with ``src_scale``, float32 ``[I0, I1, B]`` (last-dim stride
    1): the summary is of the dequantized keys. FP8 ``summaries`` come with ``summary_scale``,
    float32 ``[num_host_blocks, Hk, 2]`` (last-dim stride 1): each row is stored as FP8 K/V rows
    are (``kernels/fp8.py``: its absolute maximum over 448 is its scale). Returns once launched: no
    host sync, CUDA-graph capturable. Duplicate destinations leave an unspecified one of them.
    """
    _, _, block_size, head_dim = src.shape
    assert src.stride(3) == 1, "src needs last-dim stride 1"
    assert summaries.dim() == 4 and summaries.shape[2] == 2 and summaries.shape[3] == head_dim, (
        f"summaries {tuple(summaries.shape)} do not fit src {tuple(src.shape)}")
    assert summaries.stride(3) == 1
    m = dst_block.shape[0]
    assert idx0.shape == idx1.shape == dst_block.shape == dst_head.shape == (m,)
    idx0, idx1, dst_block, dst_head = (x.contiguous() for x in (idx0, idx1, dst_block, dst_head))
    assert num_tokens is None or num_tokens.shape == (m,)
    scale = check_scale(src_scale, src, idx0.device)
    out_scale = check_scale(summary_scale, summaries, idx0.device)
    if m == 0:
        return
    _block_minmax_kernel[(m,)](
        src, idx0, idx1, summaries, dst_block, dst_head,
        dst_block if num_tokens is None else num_tokens, scale, out_scale,
        src.stride(0), src.stride(1), src.stride(2),
        summaries.stride(0), summaries.stride(1), summaries.stride(2),
        scale.stride(0), scale.stride(1), out_scale.stride(0), out_scale.stride(1),
        BLOCK_SIZE=block_size, HEAD_DIM=head_dim, BLOCK_T=triton.next_power_of_2(block_size),
        BLOCK_D=triton.next_power_of_2(head_dim), HAS_NUM_TOKENS=num_tokens is not None,
        QUANT=src_scale is not None, OUT_QUANT=summaries.dtype == FP8, FP8_MAX=FP8_MAX,
        MIN_AMAX=MIN_AMAX,
    )
