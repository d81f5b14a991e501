"""Triton split-K decode attention over per-head working sets: the sparse (tiered-KV) decode path
(``sparse_decode_attention``).

Working set of one layer, per K and V: ``[S, Hk, W, B, D]`` (S sequence slots, W = K + 1 block slots
per (sequence, kv head), B tokens per block). ``ws_map`` int32 ``[S, Hk, W]`` names the logical
block held by each slot (-1 = empty); heads of one sequence may hold different blocks. Slot W-1 is
the *local block* (the sequence's last, still filling block): it is read up to each row's
``local_lens`` whatever ``ws_map`` says for it. Slots ``j < W-1`` are read in full when
``ws_map >= 0``. Keys carry RoPE already, so the order of the slots does not matter and no positions
are needed. Beside an 8-bit working set the local block may come from an *open block* in the
model's dtype instead (``kernels/fp8.py``): the split holding slot W-1 then reads it from there.

Lookahead: a row may carry a *draft row* (the guessed next token), which attends everything its row
attends plus one extra key/value, its own, passed in directly (it is never written to the working
set). The draft's G query heads ride in the same program as the row's (2G of the 16 padded
``tl.dot`` rows for G <= 8, the next power of two above), so each K/V tile is read once for both.

Kernel 1 (``_sparse_split_kernel``), grid ``(N, Hk, num_splits)``: a program owns the G query heads
of one kv head of one row and of its draft row (padded to 16 rows for ``tl.dot``) and a run of
``slots_per_split`` slots; it runs an online softmax in fp32 over the valid tokens of its slots,
``SLOTS_PER_ITER`` slots per iteration; the split holding the local slot adds the draft's own token.
With one split it writes the normalized output; with several it writes a partial (max, sum of exps,
unnormalized accumulator; neutral -inf/0/0 when the split holds no valid token) and the last of
a (row, kv head)'s splits to finish merges them, as in ``paged_decode`` (same workspace). Grid and
workspace depend only on shapes: the call is CUDA-graph capturable and never syncs the host.

Does not know: which blocks a slot holds or when they arrived (``kv/`` owns residency; a slot must
be readable, i.e. its copy complete, before this kernel runs on the stream).
"""
import torch
import triton
import triton.language as tl

from oasiskv.kernels.fp8 import OpenBlocks, check_scales
from oasiskv.kernels.paged_decode import (_DEFAULT_WAVE, _LOG2E, _accumulate, _attend_open,
                                          _fp16_query, _load_q, _load_scales, _row_denominator,
                                          _softmax_tile, _store_split, _true_acc, _wave_size,
                                          _zero_denominator, default_num_splits, fp16_dot,
                                          launch_config, split_workspace)

# The launch config (tokens per iteration, warps, stages, register cap), the split heuristic and
# its default wave are paged_decode's.


@triton.jit
def _slot_valid(map_row, slot, slot_end, local_slot, local_len, tile_off):
    """Which tokens of the tile's slots ``slot`` ``[TILE]`` attention reads: those of the run
    (before ``slot_end``) in held slots (map entry >= 0) and the first ``local_len`` of the local
    slot."""
    in_run = slot < slot_end
    held = tl.load(map_row + slot, mask=in_run & (slot < local_slot), other=-1)
    return in_run & tl.where(slot == local_slot, tile_off < local_len, held >= 0)


@triton.jit
def _sparse_split_kernel(
    q_ptr, ws_k_ptr, ws_v_ptr, k_scale_ptr, v_scale_ptr, ws_map_ptr, seq_slots_ptr, local_lens_ptr,
    draft_rows_ptr, extra_k_ptr, extra_v_ptr, open_k_ptr, open_v_ptr, open_slots_ptr,
    out_ptr, m_ws_ptr, l_ws_ptr, acc_ws_ptr, count_ptr,
    qk_scale, slots_per_split, num_splits, num_slots, num_q_heads,
    stride_qn, stride_qh, stride_on, stride_oh,
    stride_ks, stride_kh, stride_kw, stride_kt,
    stride_vs, stride_vh, stride_vw, stride_vt,
    stride_ms, stride_mh, stride_xkn, stride_xkh, stride_xvn, stride_xvh,
    stride_ss, stride_sh, stride_sw, stride_bs, stride_bh,
    G: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, SLOTS_PER_ITER: tl.constexpr,
    DIRECT: tl.constexpr, DOT_PRECISION: tl.constexpr, HAS_DRAFT: tl.constexpr,
    QUANT: tl.constexpr, FP16_DOT: tl.constexpr, INTERPRETED: tl.constexpr, OPEN: tl.constexpr,
):
    """Attention of the G query heads of kv head ``pid(1)`` of row ``pid(0)`` (and, HAS_DRAFT, of
    its draft row ``draft_rows[pid(0)]`` when >= 0, program rows G..2G-1) over the slots of split
    ``pid(2)``.

    ``qk_scale`` is ``scale * log2(e)`` (scores in the log2 domain). Workspace (not DIRECT): m/l
    ``[Nq, Hq, num_splits]``, acc ``[Nq, Hq, num_splits, HEAD_DIM]`` (Nq = rows of q). OPEN (8-bit
    working sets): the local block is read from block ``open_slots[row]`` of the open blocks
    ``[*, Hk, BLOCK_SIZE, HEAD_DIM]`` in the model's dtype (``paged_decode._attend_open``), not
    from slot W-1.
    """
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    TILE: tl.constexpr = BLOCK_SIZE * SLOTS_PER_ITER

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_t = tl.arange(0, TILE)
    tile_slot = offs_t // BLOCK_SIZE
    tile_off = offs_t % BLOCK_SIZE
    if HAS_DRAFT:
        draft = tl.load(draft_rows_ptr + row)
        is_draft = offs_g >= G
        q_rows = tl.where(is_draft, draft, row)
        q_heads = kv_head * G + tl.where(is_draft, offs_g - G, offs_g)
        g_mask = (offs_g < G) | (is_draft & (offs_g < 2 * G) & (draft >= 0))
    else:
        q_rows = row + 0 * offs_g
        q_heads = kv_head * G + offs_g
        g_mask = offs_g < G

    q = _load_q(q_ptr, q_rows, stride_qn, stride_qh, q_heads, g_mask, offs_d)
    q_dot, qk_dot = q, qk_scale
    if FP16_DOT:
        q_dot, shift = _fp16_query(q)
        qk_dot = qk_scale / shift

    seq = tl.load(seq_slots_ptr + row)
    local_len = tl.load(local_lens_ptr + row)
    local_quant = 0 * local_len if OPEN else local_len  # tokens of slot W-1 read from the set
    local_slot = num_slots - 1
    slot_start = split * slots_per_split
    slot_end = tl.minimum(slot_start + slots_per_split, num_slots)
    slot_end = tl.where(seq >= 0, slot_end, slot_start)  # padding row: nothing to read
    seq64 = tl.maximum(seq, 0).to(tl.int64)
    map_row = ws_map_ptr + seq64 * stride_ms + kv_head * stride_mh
    k_head = ws_k_ptr + seq64 * stride_ks + kv_head * stride_kh
    v_head = ws_v_ptr + seq64 * stride_vs + kv_head * stride_vh
    scale_head = seq64 * stride_ss + kv_head * stride_sh
    # Per-token offset inside a slot, K transposed ([HEAD_DIM, TILE]) so it loads straight as K^T.
    kt_in_slot = tile_off[None, :] * stride_kt + offs_d[:, None]
    # (8-bit V too in token order: the tiered store's, kernels/fp8.py)
    v_in_slot = tile_off[:, None] * stride_vt + offs_d[None, :]

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = _zero_denominator(BLOCK_G, TILE, FP16_DOT)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
    acc_norm, v_max = 1.0, 0.0
    for slot0 in range(slot_start, slot_end, SLOTS_PER_ITER):
        slot = slot0 + tile_slot
        valid = _slot_valid(map_row, slot, slot_end, local_slot, local_quant, tile_off)
        slot64 = slot.to(tl.int64)

        kt = tl.load(k_head + (slot64 * stride_kw)[None, :] + kt_in_slot, mask=valid[None, :],
                     other=0.0)
        scale_offs = scale_head + slot64 * stride_sw + tile_off
        k_scale = _load_scales(k_scale_ptr, scale_offs, valid, TILE, QUANT)
        # a tile may hold no valid token (empty slots): _softmax_tile keeps that finite
        p, alpha, m_new, l_i = _softmax_tile(q_dot, kt, k_scale, valid, m_i, l_i, qk_dot,
                                             DOT_PRECISION, FP16_DOT)
        v = tl.load(v_head + (slot64 * stride_vw)[:, None] + v_in_slot, mask=valid[:, None],
                    other=0.0)
        v_scale = _load_scales(v_scale_ptr, scale_offs, valid, TILE, QUANT)
        acc, acc_norm, v_max = _accumulate(acc, acc_norm, v_max, alpha, p, v_scale, v,
                                           DOT_PRECISION, QUANT, FP16_DOT, INTERPRETED)
        m_i = m_new
    if OPEN and slot_start <= local_slot and local_slot < slot_end:  # (slot_end: padding rows)
        open_base = tl.load(open_slots_ptr + row).to(tl.int64) * stride_bs + kv_head * stride_bh
        acc, m_i, l_i = _attend_open(q_dot, open_k_ptr + open_base, open_v_ptr + open_base,
                                     local_len, acc, acc_norm, m_i, l_i, qk_dot, offs_t, HEAD_DIM,
                                     BLOCK_SIZE, DOT_PRECISION, FP16_DOT)
    l_i = _row_denominator(l_i, FP16_DOT)
    acc = _true_acc(acc, acc_norm, FP16_DOT)

    # the draft's own key and value, once: in the split that holds the local slot
    if HAS_DRAFT:
        if ((draft >= 0) & (seq >= 0) & (slot_start <= local_slot)
                & (local_slot < slot_start + slots_per_split)):
            draft64 = tl.maximum(draft, 0).to(tl.int64)
            xk = tl.load(extra_k_ptr + draft64 * stride_xkn + kv_head * stride_xkh
                         + offs_d).to(tl.float32)
            xv = tl.load(extra_v_ptr + draft64 * stride_xvn + kv_head * stride_xvh
                         + offs_d).to(tl.float32)
            s_x = tl.where(is_draft & g_mask, tl.sum(q * xk[None, :], 1) * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, s_x)
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_use)
            p_x = tl.exp2(s_x - m_use)
            l_i = l_i * alpha + p_x
            acc = acc * alpha[:, None] + p_x[:, None] * xv[None, :]
            m_i = m_new

    _store_split(acc, m_i, l_i, out_ptr, m_ws_ptr, l_ws_ptr, acc_ws_ptr, count_ptr, q_rows, split,
                 num_splits, num_q_heads, q_heads, g_mask, offs_d, stride_on, stride_oh, HEAD_DIM,
                 DIRECT)


_waves: dict[tuple, int] = {}


def sparse_decode_attention(q: torch.Tensor, ws_k: torch.Tensor, ws_v: torch.Tensor,
                            ws_map: torch.Tensor, seq_slots: torch.Tensor, local_lens: torch.Tensor,
                            scale: float, out: torch.Tensor | None = None,
                            num_splits: int | None = None, draft_rows: torch.Tensor | None = None,
                            extra_k: torch.Tensor | None = None,
                            extra_v: torch.Tensor | None = None,
                            scales: tuple[torch.Tensor, torch.Tensor] | None = None,
                            open_block: OpenBlocks | None = None,
                            launch: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """Decode attention of one query token per row over its sequence's working set; returns
    ``out``.

    q: ``[Nq, Hq, D]`` (last-dim stride 1), Hq = G * Hk; query head h attends kv head ``h // G``.
    Rows ``0..N-1`` (N = len(seq_slots)) are the rows; without ``draft_rows`` Nq = N.
    ws_k, ws_v: ``[S, Hk, W, B, D]``, same shape and dtype, last two dims contiguous (other strides
    free, e.g. one layer of a ``[L, S, Hk, W, B, D]`` buffer); D and B powers of two >= 16; 8-bit
    values too in token order, as K (not in the dense pool's V layout, ``kernels/fp8.py``).
    ws_map: int32 ``[S, Hk, W]`` (last-dim stride 1), block held by each slot, -1 = empty; only
    entries ``j < W-1`` are read. seq_slots: int32 ``[N]``, the sequence slot of each row,
    -1 = padding row. local_lens: int32 ``[N]`` in ``0..B``, tokens of the local slot W-1 this row
    attends. Row n, kv head h attends every token of slots ``j < W-1`` with ``ws_map[s, h, j] >= 0``
    plus the first ``local_lens[n]`` tokens of slot W-1; no other entry of ws_k/ws_v is read.
    Padding rows and rows with nothing to attend get zeros.
    draft_rows: optional int32 ``[N]``: the q row (``>= N``) of row n's draft, -1 = none; each q row
    ``>= N`` must be named by exactly one row. A draft row attends what its row attends plus its own
    key/value ``extra_k/extra_v[draft, h]`` (``[Nq, Hk, D]``, last-dim stride 1); a padding row's
    draft gets zeros. (Programs then hold 2G query heads: 16 padded rows up to G = 8, more above.)
    scale: softmax scale. out: optional ``[Nq, Hq, D]`` target (last-dim stride 1), else allocated
    with q's dtype. num_splits: split-K factor over the W slots (default from
    ``paged_decode.default_num_splits`` with the measured wave size); each split covers whole
    iterations of slots, splits past the last slot write neutral partials. Math is fp32 with K/V
    upcast; dots as tf32 for 16-bit inputs, IEEE fp32 when q or the working set is fp32, and as
    in ``paged_decode.fp16_dot`` for an 8-bit working set read by a 16-bit q. An 8-bit working
    set (``float8_e4m3fn`` or ``int8``) comes with ``scales``: float32 ``(k_scale, v_scale)``
    ``[S, Hk, W, B]`` (last-dim stride 1, the same strides), one per stored row
    (``kernels/fp8.py``); the draft rows' own K/V are unscaled. ``open_block`` (8-bit working
    sets only): row n's local tokens are read from block ``open_block.slots[n]`` of its caches
    ``[*, Hk, B, D]`` in the model's dtype (``OpenBlocks``), not from slot W-1 (never read then).
    ``launch``: forces ``paged_decode.launch_config`` (a benchmark's sweep). No host sync;
    CUDA-graph capturable (grid and workspace depend on shapes only).
    """
    num_rows, num_q_heads, head_dim = q.shape
    n = seq_slots.shape[0]
    num_seqs, num_kv_heads, num_slots, block_size, cache_dim = ws_k.shape
    assert ws_v.shape == ws_k.shape and ws_v.dtype == ws_k.dtype
    assert cache_dim == head_dim and num_q_heads % num_kv_heads == 0, (
        f"q {tuple(q.shape)} does not fit working set {tuple(ws_k.shape)}")
    for ws in (ws_k, ws_v):
        assert ws.stride(4) == 1 and ws.stride(3) == head_dim, (
            "working set: last two dims must be contiguous")
    assert head_dim >= 16 and head_dim & (head_dim - 1) == 0, (
        "head_dim must be a power of two >= 16")
    assert block_size >= 16 and block_size & (block_size - 1) == 0, (
        "block_size must be a power of two >= 16")
    assert (num_slots >= 1 and ws_map.shape == (num_seqs, num_kv_heads, num_slots)
            and ws_map.stride(2) == 1)
    assert local_lens.shape == (n,) and q.stride(2) == 1
    group = num_q_heads // num_kv_heads
    has_draft = draft_rows is not None
    if has_draft:
        assert draft_rows.shape == (n,)
        assert extra_k is not None and extra_v is not None
        for extra in (extra_k, extra_v):
            assert extra.shape == (num_rows, num_kv_heads, head_dim) and extra.stride(2) == 1
        draft_rows = draft_rows.contiguous()
    else:
        assert num_rows == n, f"q has {num_rows} rows for {n} sequence slots and no draft rows"
        draft_rows, extra_k, extra_v = seq_slots, q, q  # placeholders: never read
    # read as packed arrays
    seq_slots, local_lens = seq_slots.contiguous(), local_lens.contiguous()
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    assert out.shape == q.shape and out.stride(2) == 1
    if n == 0:
        return out

    tokens, warps, stages, max_regs = launch_config(launch, scales is not None)
    slots_per_iter = max(1, tokens // block_size)
    key = (q.device, q.dtype, ws_k.dtype, head_dim, block_size, group, has_draft,
           open_block is not None, tokens, warps, stages, max_regs)
    if num_splits is None:
        num_splits = default_num_splits(n, num_kv_heads, num_slots, block_size,
                                        _waves.get(key, _DEFAULT_WAVE))
    assert num_splits >= 1
    slots_per_split = (triton.cdiv(triton.cdiv(num_slots, num_splits), slots_per_iter)
                       * slots_per_iter)
    direct = num_splits == 1
    # [Nq, Hq, ...]: draft rows have their own partials
    workspace = split_workspace(out, num_splits, n * num_kv_heads)
    fp32 = torch.float32 in (q.dtype, ws_k.dtype)
    k_scale, v_scale = check_scales(scales, ws_k, q.device)
    assert k_scale.stride() == v_scale.stride()
    if open_block is not None:
        assert scales is not None, "open blocks are kept only beside an 8-bit working set"
        open_block.check(ws_k[:, :, 0], n)
        open_args = (open_block.k, open_block.v, open_block.slots)
    else:
        open_args = (ws_k, ws_v, seq_slots)  # (never read)

    compiled = _sparse_split_kernel[(n, num_kv_heads, num_splits)](
        q, ws_k, ws_v, k_scale, v_scale, ws_map, seq_slots, local_lens, draft_rows, extra_k,
        extra_v, *open_args,
        out, *workspace,
        scale * _LOG2E, slots_per_split, num_splits, num_slots, num_q_heads,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        ws_k.stride(0), ws_k.stride(1), ws_k.stride(2), ws_k.stride(3),
        ws_v.stride(0), ws_v.stride(1), ws_v.stride(2), ws_v.stride(3),
        ws_map.stride(0), ws_map.stride(1),
        extra_k.stride(0), extra_k.stride(1), extra_v.stride(0), extra_v.stride(1),
        k_scale.stride(0), k_scale.stride(1), k_scale.stride(2),
        open_args[0].stride(0), open_args[0].stride(1),
        G=group, BLOCK_G=max(16, triton.next_power_of_2(group * (2 if has_draft else 1))),
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size, SLOTS_PER_ITER=slots_per_iter,
        DIRECT=direct, DOT_PRECISION="ieee" if fp32 else "tf32", HAS_DRAFT=has_draft,
        QUANT=scales is not None, FP16_DOT=fp16_dot(q, ws_k), INTERPRETED=not q.is_cuda,
        OPEN=open_block is not None, num_warps=warps, num_stages=stages, maxnreg=max_regs or None,
    )
    if key not in _waves and q.is_cuda:
        _waves[key] = _wave_size(compiled, q.device, warps) or _DEFAULT_WAVE
    return out
