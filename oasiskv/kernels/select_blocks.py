"""Triton selection with the HBM fetch cap, one program per (row, kv head) (``select_blocks``).

The policy is ``kv/selection.py``'s ``plan_selection`` (its torch form is the reference): the top-K
blocks by score are wanted; wanted blocks already resident are hits (their slots' stamps refreshed);
the other wanted blocks are misses, admitted highest score first, at most ``cap`` of them, each into
an empty slot or else the least recently selected slot that holds no wanted block. This kernel does
all of it in one launch instead of some 80 small torch kernels per layer.

Per program, with the row's M scores in registers:
1. top-K without sorting: scores map to int32 keys with the same order, a 33-step bisection finds
   the K-th largest key T, and ties at T go to the lowest block indices (cumsum);
2. the scores row (a scratch the caller hands over) is rewritten to keep only wanted blocks, so the
   K slots can look their blocks up with a gather load; hits are then erased from it too, leaving
   exactly the misses;
3. ``cap`` rounds of (best remaining miss, least recently selected free slot) admit the misses;
4. the slot tables are written back, the admitted blocks' host ids (from the block table) and slots
   go out, and hit/miss/admitted counts are added to ``counters`` atomically.
Step 2's rewrites of the scores row are separated from the reads around them by barriers (the
threads of a program hold overlapping copies of small vectors).

Does not know: what a score means or where blocks live on the host (``kv/`` owns that).
"""
import torch
import triton
import triton.language as tl

_EMPTY_FIRST = -(2 ** 62)  # LRU keys: empty slots first, hit slots never (stamps are step counts)
_PROTECTED = 2 ** 62


@triton.jit
def _select_kernel(
    scores_ptr, ws_map_ptr, ws_last_ptr, slots_ptr, block_tables_ptr, now_ptr, counters_ptr,
    src_ptr, dst_ptr,
    num_blocks, k, cap,
    stride_sn, stride_sh, stride_ms, stride_mh, stride_ls, stride_lh,
    stride_bt, stride_on, stride_oh,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    EMPTY_FIRST: tl.constexpr, PROTECTED: tl.constexpr,
):
    row = tl.program_id(0)
    head = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < num_blocks
    k_mask = offs_k < k
    now = tl.load(now_ptr)
    score_row = scores_ptr + row.to(tl.int64) * stride_sn + head * stride_sh

    # 1. wanted = top-k valid blocks by (score desc, index asc)
    s = tl.load(score_row + offs_m, mask=m_mask, other=float("-inf"))
    valid = s > float("-inf")
    bits = tl.where(s == 0.0, 0.0, s).to(tl.int32, bitcast=True).to(tl.int64)  # (-0.0 is 0.0)
    # a negative float's magnitude bits flipped: float order
    key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    key = tl.where(valid, key, -2147483648)
    lo = tl.full((), -2147483648, tl.int64)
    hi = tl.full((), 2147483647, tl.int64)
    for _ in range(33):  # largest T with count(key >= T) >= k
        mid = lo + (hi - lo + 1) // 2
        enough = tl.sum((key >= mid).to(tl.int32), 0) >= k
        lo = tl.where(enough, mid, lo)
        hi = tl.where(enough, hi, mid - 1)
    above = key > lo
    tie = key == lo
    tie_rank = tl.cumsum(tie.to(tl.int32), 0)
    want = valid & (above | (tie & (tie_rank <= k - tl.sum(above.to(tl.int32), 0))))
    tl.store(score_row + offs_m, tl.where(want, s, float("-inf")), mask=m_mask)
    tl.debug_barrier()

    # 2. hits: slots whose block is wanted; erase them from the scores, which leaves the misses
    slot = tl.load(slots_ptr + row).to(tl.int64)
    map_row = ws_map_ptr + slot * stride_ms + head * stride_mh
    last_row = ws_last_ptr + slot * stride_ls + head * stride_lh
    blk = tl.load(map_row + offs_k, mask=k_mask, other=-1)
    last = tl.load(last_row + offs_k, mask=k_mask, other=0)
    resident = k_mask & (blk >= 0) & (blk < num_blocks)
    hit = resident & (tl.load(score_row + blk, mask=resident, other=float("-inf")) > float("-inf"))
    tl.debug_barrier()  # every thread has read its slots' scores before any is erased
    tl.store(score_row + blk, float("-inf"), mask=hit)
    tl.debug_barrier()
    misses = tl.load(score_row + offs_m, mask=m_mask, other=float("-inf"))
    num_misses = tl.sum((misses > float("-inf")).to(tl.int32), 0)
    victim_key = tl.where(blk < 0, EMPTY_FIRST, tl.where(hit, PROTECTED, last))
    victim_key = tl.where(k_mask, victim_key, PROTECTED)
    last = tl.where(hit, now, last)

    # 3. admit the best misses into the least recently selected free slots, cap at most
    out_row = row.to(tl.int64) * stride_on + head * stride_oh
    bt_row = block_tables_ptr + row.to(tl.int64) * stride_bt
    for j in range(cap):
        best = tl.argmax(misses, 0)
        ok = j < num_misses  # misses are admitted best first: round j has one iff j < num_misses
        victim = tl.argmin(victim_key, 0)
        take = (offs_k == victim) & ok
        blk = tl.where(take, best, blk)
        last = tl.where(take, now, last)
        victim_key = tl.where(take, PROTECTED, victim_key)
        misses = tl.where((offs_m == best) & ok, float("-inf"), misses)
        host_id = tl.load(bt_row + best, mask=ok, other=-1)
        tl.store(src_ptr + out_row + j, tl.where(ok, host_id.to(tl.int64), -1))
        tl.store(dst_ptr + out_row + j, tl.where(ok, victim.to(tl.int64), -1))

    # 4. tables and counts
    tl.store(map_row + offs_k, blk, mask=k_mask)
    tl.store(last_row + offs_k, last, mask=k_mask)
    num_hits = tl.sum(hit.to(tl.int64), 0)
    tl.atomic_add(counters_ptr, num_hits)
    tl.atomic_add(counters_ptr + 1, num_misses.to(tl.int64))
    tl.atomic_add(counters_ptr + 2, tl.minimum(num_misses, cap).to(tl.int64))


def select_blocks(scores: torch.Tensor, ws_map: torch.Tensor, ws_last: torch.Tensor,
                  slots: torch.Tensor, block_tables: torch.Tensor, k: int, cap: int,
                  now: torch.Tensor, counters: torch.Tensor,
                  num_warps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Plan one layer's capped selection for rows ``slots`` and update the residency tables in
    place.

    scores: float32 ``[N, Hk, M]`` (last-dim stride 1), -inf for blocks that do not exist; used as
    scratch (overwritten). ws_map: int32 ``[S, Hk, W]``, W >= k, logical block per slot (-1 empty;
    columns >= k are neither read nor written). ws_last: int64 ``[S, Hk, k]`` last-selected stamps.
    slots: ``[N]`` sequence slot of each row, distinct, except rows whose scores are all -inf (graph
    padding): those write their slot's tables back as they read them, so they may share a slot only
    with each other. block_tables: int32 ``[N, >= M]`` (last-dim stride 1) host block id of each
    logical block. now: int64 0-d device tensor, the step's stamp. counters: int64 ``[>= 3]``; hits,
    misses and admitted blocks (summed over rows and heads) are added to entries 0-2. Returns
    (src_block, dst_slot), int64 ``[N, Hk, cap]``: host block to copy and the slot it lands in,
    admitted misses in score order, -1 past them. No host sync; CUDA-graph capturable (the grid
    depends on shapes only). ``num_warps``: per program (default by M; benchmarks sweep it).
    """
    n, heads, m = scores.shape
    assert scores.dtype == torch.float32 and scores.stride(2) == 1
    assert ws_map.dtype == torch.int32 and ws_map.shape[1] == heads and ws_map.shape[2] >= k
    assert ws_map.stride(2) == 1 and block_tables.stride(1) == 1
    assert (ws_last.dtype == torch.int64 and ws_last.shape[1:] == (heads, k)
            and ws_last.stride(2) == 1)
    assert (1 <= cap <= k and slots.shape == (n,) and block_tables.shape[0] == n
            and block_tables.shape[1] >= m)
    assert now.dim() == 0 and counters.dtype == torch.int64
    src = torch.full((n, heads, cap), -1, dtype=torch.long, device=scores.device)
    dst = torch.full_like(src, -1)
    if n == 0 or m == 0:
        return src, dst
    block_m = triton.next_power_of_2(m)
    _select_kernel[(n, heads)](
        scores, ws_map, ws_last, slots.contiguous(), block_tables, now, counters, src, dst,
        m, k, cap,
        scores.stride(0), scores.stride(1), ws_map.stride(0), ws_map.stride(1), ws_last.stride(0),
        ws_last.stride(1), block_tables.stride(0), src.stride(0), src.stride(1),
        BLOCK_M=block_m, BLOCK_K=triton.next_power_of_2(k), EMPTY_FIRST=_EMPTY_FIRST,
        PROTECTED=_PROTECTED,
        num_warps=num_warps or (4 if block_m <= 2048 else 8 if block_m <= 8192 else 16),
    )
    return src, dst
