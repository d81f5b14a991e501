"""Fused mixture-of-experts MLP (``fused_moe``): each token's k routed experts, two grouped GEMMs.

A (token, expert) *pair* is one of a token's k routes. ``align_pairs`` sorts the pairs by expert and
pads each expert's run to whole blocks of ``BLOCK_M`` rows, so one program of ``_moe_gemm_kernel``
multiplies a block of rows that all go to one expert by that expert's weight tile: the first GEMM
``x[token] @ w13[e]^T`` (``[P, 2I]``, rounded to x's dtype), ``silu_mul`` (``fused_ops``), the
second ``h @ w2[e]^T`` times the routing weight (fp32 ``[P, H]``), then the k rows of each token are
summed in fp32. Shapes depend on T, k, E only (the padded length is ``P + E * (BLOCK_M - 1)``,
rounded up), never on the routing, and nothing syncs the host: CUDA-graph capturable. Padding
blocks (past every expert's run) find expert -1 and skip their K loop. Only the experts a step
routes to are read, once per block of their rows.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from oasiskv.kernels.fused_ops import silu_mul

# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages). Decode routes few rows to each expert: small M.
_LAUNCH = (16, 64, 64, 4, 3)


@triton.jit
def _moe_gemm_kernel(a_ptr, b_ptr, c_ptr, pair_ids_ptr, block_expert_ptr, weights_ptr,
                     num_pairs, N, K, stride_am, stride_be, stride_bn, stride_cm,
                     A_ROW_DIV: tl.constexpr, MUL_WEIGHT: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Rows ``pair_ids[pid(0) * BLOCK_M:][:BLOCK_M]`` (pairs; ``num_pairs`` = padding) times expert
    ``block_expert[pid(0)]``'s ``b`` ``[N, K]`` over columns ``pid(1) * BLOCK_N:``: row p reads
    ``a[p // A_ROW_DIV]`` and writes ``c[p]`` (times ``weights[p]`` when MUL_WEIGHT), fp32
    accumulation (float32 inputs at DOT_PRECISION)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(pair_ids_ptr + offs_m)
    valid = (pairs < num_pairs) & (expert >= 0)
    a_rows = (pairs // A_ROW_DIV).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    a_rows_ptr = a_ptr + a_rows * stride_am  # [BLOCK_M] row starts; column offsets stay int32
    b_base = b_ptr + tl.maximum(expert, 0).to(tl.int64) * stride_be
    offs_k = tl.arange(0, BLOCK_K)
    b_offs = offs_n[None, :] * stride_bn + offs_k[:, None]  # [BLOCK_K, BLOCK_N], within an expert
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    k_end = tl.where(expert >= 0, K, 0)
    for k0 in range(0, k_end, BLOCK_K):
        k_ok = k0 + offs_k < K
        a = tl.load(a_rows_ptr[:, None] + (k0 + offs_k)[None, :],
                    mask=valid[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_base + (b_offs + k0), mask=n_ok[None, :] & k_ok[:, None], other=0.0)
        acc += tl.dot(a, b, input_precision=DOT_PRECISION)
    if MUL_WEIGHT:
        acc = acc * tl.load(weights_ptr + pairs, mask=valid, other=0.0)[:, None]
    tl.store(c_ptr + pairs[:, None].to(tl.int64) * stride_cm + offs_n[None, :],
             acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & n_ok[None, :])


def align_pairs(topk_ids: torch.Tensor, num_experts: int,
                block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(pair_ids, block_expert) for ``topk_ids`` ``[T, k]``: int32 ``[L]`` pair indices (``t * k +
    j``) sorted by expert (stable), each expert's run padded with ``T * k`` to a multiple of
    ``block_m``, and int32 ``[L / block_m]`` the expert of each block (-1 past the last run);
    ``L = round_up(T * k + num_experts * (block_m - 1), block_m)``. Torch ops, no host sync."""
    flat = topk_ids.reshape(-1).long()
    pairs = flat.numel()
    counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)
    experts = flat[order]
    rank = torch.arange(pairs, device=flat.device) - (counts.cumsum(0) - counts)[experts]
    length = triton.cdiv(pairs + num_experts * (block_m - 1), block_m) * block_m
    pair_ids = torch.full((length,), pairs, dtype=torch.int32, device=flat.device)
    pair_ids[(ends - padded)[experts] + rank] = order.to(torch.int32)
    starts = torch.arange(0, length, block_m, device=flat.device)
    block_expert = torch.searchsorted(ends, starts, right=True)
    return pair_ids, torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)


def _gemm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, pair_ids: torch.Tensor,
          block_expert: torch.Tensor, weights: torch.Tensor | None, a_row_div: int) -> None:
    block_m, block_n, block_k, warps, stages = _LAUNCH
    experts, n, k = b.shape
    assert a.stride(1) == 1 and b.stride(2) == 1 and out.stride(1) == 1 and a.shape[1] == k
    grid = (block_expert.numel(), triton.cdiv(n, block_n))
    _moe_gemm_kernel[grid](
        a, b, out, pair_ids, block_expert, out if weights is None else weights,
        out.shape[0], n, k, a.stride(0), b.stride(0), b.stride(1), out.stride(0),
        A_ROW_DIV=a_row_div, MUL_WEIGHT=weights is not None, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=block_k, DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        num_warps=warps, num_stages=stages)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
    """MoE MLP of tokens ``x`` ``[T, H]``: ``w13`` ``[E, 2I, H]`` (each expert's gate rows, then its
    up rows), ``w2`` ``[E, H, I]``, ``topk_weights`` float32 ``[T, k]`` and ``topk_ids`` ``[T, k]``
    (experts in [0, E)) -> ``[T, H]`` in x's dtype: over each token's k experts j,
    ``sum_j w_j * (silu(x W_g^T) * (x W_u^T)) W_d^T`` (rounding as ``fused_moe_ref``)."""
    tokens, hidden = x.shape
    experts, two_i, _ = w13.shape
    top_k = topk_ids.shape[1]
    assert w13.shape[2] == hidden and w2.shape == (experts, hidden, two_i // 2)
    if tokens == 0:
        return torch.empty_like(x)
    pair_ids, block_expert = align_pairs(topk_ids, experts, _LAUNCH[0])
    gate_up = torch.empty(tokens * top_k, two_i, dtype=x.dtype, device=x.device)
    _gemm(x, w13, gate_up, pair_ids, block_expert, None, top_k)
    y = torch.empty(tokens * top_k, hidden, dtype=torch.float32, device=x.device)
    _gemm(silu_mul(gate_up), w2, y, pair_ids, block_expert,
          topk_weights.reshape(-1).float().contiguous(), 1)
    return y.view(tokens, top_k, hidden).sum(1).to(x.dtype)
