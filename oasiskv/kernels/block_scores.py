"""Triton scoring of complete blocks from their summaries (``block_scores``) and the top-K pick
(``topk_blocks``) that turns the scores into a predicted working set.

Summaries of one layer: ``[num_host_blocks, Hk, 2, D]`` indexed by host block id; row 0 is the
element-wise max, row 1 the element-wise min of the block's post-RoPE keys. With c = (max + min) / 2
and r = (max - min) / 2, the score of block b for kv head h and query row n is

    score = sum over the G query heads g of kv head h of ( q_g . c + alpha * |q_g| . r )

(|q_g| element-wise): with alpha = 1 this is the Quest upper bound of sum_g q_g . k over every key k
in the block's box. Because the sum over g is linear, a program folds the G heads first into
``s = sum_g q_g`` and ``a = sum_g |q_g|``; and since
``c . s + alpha r . a = max . w_hi + min . w_lo`` with ``w_hi = (s + alpha a) / 2`` and
``w_lo = (s - alpha a) / 2``, a block's score is ``max . w_hi + min . w_lo``, no ``tl.dot``.

Kernel grid ``(N, Hk, cdiv(max_blocks, BLOCK_B * TILES))``: one program per (row, kv head, run of
TILES tiles of BLOCK_B consecutive block-table entries), looping over its tiles (software-pipelined
``num_stages`` deep). Entries ``b >= num_blocks[n]`` get -inf and neither they nor the
summaries they would point at are read. Grid depends on shapes only: CUDA-graph capturable.

Does not know: which blocks are resident, the fetch cap, or what a draft query is (``kv/`` owns
them).
"""
import torch
import triton
import triton.language as tl

from oasiskv.kernels.fp8 import check_scale

# Launch config: block-table entries per tile, tiles per program, warps, pipeline stages. Tuned on
# an H200 (128 rows x 2,048 blocks, 8 kv heads, D 128, bf16; `python -m oasiskv.bench.kernels
# --scores`): 3.98 TB/s, against 2.68 for the former 32 x 1 x 4 x 1; looping programs (4 or 16
# tiles, 2 or 3 stages) reached 3.0-3.94.
_BLOCK_B, _TILES, _NUM_WARPS, _NUM_STAGES = 64, 1, 2, 1


# sizes and strides that follow a context's length, and table slices at any offset, are not
# specialised on (divisibility by 16, == 1, alignment): calls at every length share one compiled
# kernel instead of compiling a variant, ~0.2 s each, in the middle of a served step
@triton.jit(do_not_specialize=["max_blocks", "stride_bt", "stride_on", "stride_oh"],
            do_not_specialize_on_alignment=["block_tables_ptr", "num_blocks_ptr"])
def _block_scores_kernel(
    q_ptr, summaries_ptr, scale_ptr, block_tables_ptr, num_blocks_ptr, out_ptr,
    alpha, max_blocks,
    stride_qn, stride_qh, stride_sb, stride_sh, stride_sr, stride_cb, stride_ch, stride_bt,
    stride_on, stride_oh,
    G: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_B: tl.constexpr,
    TILES: tl.constexpr, NUM_STAGES: tl.constexpr, QUANT: tl.constexpr,
):
    """Scores of block-table entries ``[pid(2) * BLOCK_B * TILES, +BLOCK_B * TILES)`` of row
    ``pid(0)``, kv head ``pid(1)``."""
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, HEAD_DIM)

    q = tl.load(q_ptr + row * stride_qn + (kv_head * G + offs_g)[:, None] * stride_qh
                + offs_d[None, :], mask=(offs_g < G)[:, None], other=0.0).to(tl.float32)
    q_sum = tl.sum(q, 0)           # sum_g q_g      [HEAD_DIM]
    q_abs = tl.sum(tl.abs(q), 0)   # sum_g |q_g|    [HEAD_DIM]
    w_hi = (q_sum + alpha * q_abs) * 0.5
    w_lo = (q_sum - alpha * q_abs) * 0.5

    n_blocks = tl.minimum(tl.load(num_blocks_ptr + row), max_blocks)
    table = block_tables_ptr + row.to(tl.int64) * stride_bt
    head = summaries_ptr + kv_head * stride_sh
    first = tl.program_id(2) * BLOCK_B * TILES
    for t in tl.range(0, TILES, num_stages=NUM_STAGES):
        offs_b = first + t * BLOCK_B + tl.arange(0, BLOCK_B)
        used = offs_b < n_blocks
        host_id = tl.load(table + offs_b, mask=used, other=0)
        base = head + host_id.to(tl.int64) * stride_sb
        hi = tl.load(base[:, None] + offs_d[None, :], mask=used[:, None], other=0.0)
        lo = tl.load(base[:, None] + stride_sr + offs_d[None, :], mask=used[:, None], other=0.0)
        if QUANT:  # FP8 rows times their scales
            scales = scale_ptr + host_id.to(tl.int64) * stride_cb + kv_head * stride_ch
            score = (tl.load(scales, mask=used, other=0.0)
                     * tl.sum(hi.to(tl.float32) * w_hi[None, :], 1)
                     + tl.load(scales + 1, mask=used, other=0.0)
                     * tl.sum(lo.to(tl.float32) * w_lo[None, :], 1))
        else:
            score = tl.sum(hi.to(tl.float32) * w_hi[None, :] + lo.to(tl.float32) * w_lo[None, :],
                           1)
        score = tl.where(used, score, float("-inf"))
        tl.store(out_ptr + row * stride_on + kv_head * stride_oh + offs_b, score,
                 mask=offs_b < max_blocks)


def block_scores(q: torch.Tensor, summaries: torch.Tensor, block_tables: torch.Tensor,
                 num_blocks: torch.Tensor, alpha: float, out: torch.Tensor | None = None,
                 summary_scale: torch.Tensor | None = None, *,
                 block_b: int = _BLOCK_B, tiles: int = _TILES, num_warps: int = _NUM_WARPS,
                 num_stages: int = _NUM_STAGES) -> torch.Tensor:
    """Summary score of every complete block of every row, per kv head; returns ``out``.

    q: ``[N, Hq, D]`` (last-dim stride 1), Hq = G * Hk; query head h belongs to kv head ``h // G``.
    summaries: ``[num_host_blocks, Hk, 2, D]`` (last-dim stride 1, any float dtype; row 0 max, row
    1 min; FP8 with ``summary_scale``, float32 ``[num_host_blocks, Hk, 2]``, a scale per row,
    last-dim stride 1). block_tables: int32 ``[N, max_blocks]`` (last-dim stride 1), host block id
    of each of a row's blocks. num_blocks: int32 ``[N]`` in ``0..max_blocks``, complete blocks of
    each row; only ``block_tables[n, :num_blocks[n]]`` and the summaries they name are read. alpha:
    weight of the radius term (1 = Quest upper bound). out: optional float32 ``[N, Hk,
    max_blocks]`` (last-dim stride 1). Result: ``out[n, h, b]`` = sum over the G heads g of kv head
    h of ``q_g . c + alpha * |q_g| . r`` for ``b < num_blocks[n]``, -inf past it. fp32 math. D a
    power of two. No host sync; CUDA-graph capturable. ``block_b`` (a power of two), ``tiles``,
    ``num_warps``, ``num_stages``: the launch config (the kernel benchmark sweeps them).
    """
    n, num_q_heads, head_dim = q.shape
    _, num_kv_heads, two, sum_dim = summaries.shape
    assert two == 2 and sum_dim == head_dim and num_q_heads % num_kv_heads == 0, (
        f"q {tuple(q.shape)} does not fit summaries {tuple(summaries.shape)}")
    assert head_dim & (head_dim - 1) == 0, "head_dim must be a power of two"
    assert q.stride(2) == 1 and summaries.stride(3) == 1
    assert block_tables.dim() == 2 and block_tables.shape[0] == n and block_tables.stride(1) == 1
    assert num_blocks.shape == (n,)
    num_blocks = num_blocks.contiguous()  # 1-D index arrays are read as packed
    scale = check_scale(summary_scale, summaries, q.device)
    max_blocks = block_tables.shape[1]
    if out is None:
        out = torch.empty((n, num_kv_heads, max_blocks), dtype=torch.float32, device=q.device)
    assert (out.shape == (n, num_kv_heads, max_blocks) and out.dtype == torch.float32
            and out.stride(2) == 1)
    if n == 0 or max_blocks == 0:
        return out
    group = num_q_heads // num_kv_heads
    block_b = min(block_b, triton.next_power_of_2(max_blocks))
    tiles = max(1, min(tiles, triton.cdiv(max_blocks, block_b)))
    _block_scores_kernel[(n, num_kv_heads, triton.cdiv(max_blocks, block_b * tiles))](
        q, summaries, scale, block_tables, num_blocks, out,
        float(alpha), max_blocks,
        q.stride(0), q.stride(1), summaries.stride(0), summaries.stride(1), summaries.stride(2),
        scale.stride(0), scale.stride(1), block_tables.stride(0), out.stride(0), out.stride(1),
        G=group, BLOCK_G=max(2, triton.next_power_of_2(group)), HEAD_DIM=head_dim, BLOCK_B=block_b,
        TILES=tiles, NUM_STAGES=num_stages, QUANT=summary_scale is not None,
        num_warps=num_warps,
    )
    return out


def topk_blocks(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` best-scoring blocks per (row, kv head): ``torch.topk`` along the last dim, sorted.

    scores: ``[N, Hk, max_blocks]`` from ``block_scores``; k is clamped to ``max_blocks`` (a shape,
    so the output shape never depends on values and the call stays CUDA-graph capturable; torch.topk
    is, and Triton has no top-k primitive worth re-implementing here). Returns (values, indices),
    each ``[N, Hk, min(k, max_blocks)]``; indices are block-table columns. A row with fewer than k
    complete blocks gets -inf values at the end, whose indices (columns past ``num_blocks``) are not
    blocks: the caller must drop entries with value -inf. Ties are broken arbitrarily.
    """
    return torch.topk(scores, min(k, scores.shape[-1]), dim=-1)
