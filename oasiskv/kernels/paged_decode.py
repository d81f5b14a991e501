"""Triton split-K paged attention for decode: one query token per sequence
(``paged_decode_attention``).

Kernel 1 (``_decode_split_kernel``), grid ``(B, num_kv_heads, num_splits)``: a program owns the G
query heads of one kv head and a run of ``blocks_per_split`` consecutive KV blocks of one sequence,
so each K/V tile is loaded once for all G heads (heads padded to 16 rows for ``tl.dot``). It runs an
online softmax in fp32 over its blocks and, with one split, writes the normalized output directly;
with several it writes a partial (running max, sum of exps, unnormalized accumulator) to a
workspace, and the program that finishes last among a (row, kv head)'s splits, as an atomic counter
tells it, merges them into the output (``_store_split``): one launch, no reduce kernel.
The grid and workspace depend only on tensor shapes, never on values, so the call is CUDA-graph
capturable. By default each row divides *its own* context into ``num_splits`` runs (a row much
shorter than the block table's width still uses every split); a fixed ``blocks_per_split`` can be
forced instead. Splits past a sequence's end write a neutral partial (max=-inf, sum=0, acc=0).
"""
import torch
import triton
import triton.language as tl

from oasiskv.kernels.fp8 import OpenBlocks, check_scales, quantized
from oasiskv.kernels.store_kv import COMPILED

_LOG2E = 1.4426950408889634
#: fp16 P.V (``_accumulate``): a tile's value-scale unit is at least this share of the largest scale
#: seen
_NORM_FLOOR = tl.constexpr(2.0 ** -40)
# Launch config: (KV tokens per inner-loop iteration (several blocks per tile when block_size is
# small), warps, pipeline stages, register cap). 16-bit caches: 64-token tiles, 4 warps, 2 stages
# (tuned on an H200, head_dim 128, block 16). 8-bit caches, paged and sparse decode alike: 32-token
# tiles, one warp per program, 3 stages; each tile's block ids and scales load one iteration ahead
# (INDEX_AHEAD), which lets 3 stages pipeline. With 8-bit V stored token-minor (``fp8.v_rows``) and
# 32-token blocks, one warp per program reads faster than 64-token tiles of 2 warps: 0.507 against
# 0.523 ms per layer at 22 x 32K on an H100 (3.00 TB/s, the copy bandwidth; 8 programs per SM
# instead of 4, so the split heuristic's wave doubles), and the engine's dense FP8 step 3.4%
# faster (docs/benchmarks.md §36). Sparse decode over the FP8 working sets of the 128 x 32K tiered
# point: 37% faster than 128 / 4 / 3 (§29).
# The fourth entry caps the registers per thread (ptxas ``maxnreg``; 0: the compiler's choice),
# which sets how many programs an SM holds.
_LAUNCH = (64, 4, 2, 0)
_LAUNCH_8BIT = (32, 1, 3, 0)
# Split heuristic: the number of programs the GPU runs at once ("a wave") is measured from the
# compiled kernel's registers and shared memory (``_wave_size``; 512, about 4 per SM on a 132-SM
# H200, before the first compile). The split count fills whole waves (a last, partly empty wave
# idles SMs), never splits a sequence into pieces shorter than _MIN_TOKENS_PER_SPLIT nor into more
# than _MAX_SPLITS.
_DEFAULT_WAVE = 512
_MIN_TOKENS_PER_SPLIT = 256
_MAX_SPLITS = 64


@triton.jit
def _load_q(q_ptr, q_rows, stride_qb, stride_qh, q_heads, g_mask, offs_d):
    """Query head ``q_heads[g]`` of row ``q_rows[g]`` for each of the BLOCK_G program rows, as
    float32 ``[BLOCK_G, HEAD_DIM]`` (masked rows 0)."""
    return tl.load(q_ptr + q_rows[:, None].to(tl.int64) * stride_qb + q_heads[:, None] * stride_qh
                   + offs_d[None, :], mask=g_mask[:, None], other=0.0).to(tl.float32)


@triton.jit
def _v_offsets(tile_off, offs_d, stride_t, BLOCK_SIZE: tl.constexpr, QUANT: tl.constexpr):
    """Offsets ``[TILE, HEAD_DIM]`` of value (token ``tile_off``, dim ``offs_d``) inside a block
    whose tokens lie ``stride_t`` apart; 8-bit (QUANT, a dense pool's): in the V layout
    (``fp8.v_rows``), where the tile loads token-minor, the order its dot reads."""
    if QUANT:
        offs = tile_off[:, None] + offs_d[None, :] * BLOCK_SIZE
    else:
        offs = tile_off[:, None] * stride_t + offs_d[None, :]
    return offs


@triton.jit
def _load_scales(scale_ptr, offs, valid, TILE: tl.constexpr, QUANT: tl.constexpr):
    """Per-token dequantization scales ``[TILE]`` of an 8-bit cache (QUANT), else ones."""
    if QUANT:
        return tl.load(scale_ptr + offs, mask=valid, other=0.0)
    return tl.full([TILE], 1.0, tl.float32)


@triton.jit
def _tile_index(bt_row, k_scale_ptr, v_scale_ptr, blk0, blk_end, ctx_len, tile_blk, tile_off,
                head_offset, stride_sb, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr,
                QUANT: tl.constexpr):
    """The tile of TILE tokens starting at table entry ``blk0``: (block ids ``[TILE]`` int64 (0 past
    ``blk_end``), valid tokens ``[TILE]``, key scales, value scales (``_load_scales``))."""
    blk = blk0 + tile_blk
    blk_ok = blk < blk_end
    valid = blk_ok & (blk * BLOCK_SIZE + tile_off < ctx_len)
    block_id = tl.load(bt_row + blk, mask=blk_ok, other=0).to(tl.int64)
    scale_offs = block_id * stride_sb + head_offset + tile_off
    return (block_id, valid, _load_scales(k_scale_ptr, scale_offs, valid, TILE, QUANT),
            _load_scales(v_scale_ptr, scale_offs, valid, TILE, QUANT))


@triton.jit
def _zero_denominator(BLOCK_G: tl.constexpr, TILE: tl.constexpr, FP16_DOT: tl.constexpr):
    """The softmax denominator's running state: per row ``[BLOCK_G]``, or with FP16_DOT per tile
    column ``[BLOCK_G, TILE]``: a row sum per tile is a reduction across the program's warps (shared
    memory and barriers), which the 8-bit tile, half the bytes of a 16-bit one, cannot hide; the
    columns are summed once, by ``_row_denominator``. (16-bit keeps the row: the extra registers
    cost it resident programs.)"""
    if FP16_DOT:
        state = tl.zeros([BLOCK_G, TILE], tl.float32)
    else:
        state = tl.zeros([BLOCK_G], tl.float32)
    return state


@triton.jit
def _row_denominator(l, FP16_DOT: tl.constexpr):
    """``_zero_denominator``'s state after the last tile -> the row sums ``[BLOCK_G]``."""
    if FP16_DOT:
        rows = tl.sum(l, 1)
    else:
        rows = l
    return rows


@triton.jit
def _exp_scores(s, valid, m_i):
    """Scores ``s`` ``[BLOCK_G, T]`` (log2 domain) of the tokens ``valid`` ``[T]``, against the
    running maxima ``m_i`` ``[BLOCK_G]`` -> (weights ``p``, the rescale ``alpha`` of what came
    before, the new maxima); while no valid token has been seen (max -inf) exp2 is kept away from
    NaN."""
    s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    return tl.exp2(s - m_use[:, None]), tl.exp2(m_i - m_use), m_new


@triton.jit
def _softmax_tile(q, kt, k_scale, valid, m_i, l_i, qk_scale, DOT_PRECISION: tl.constexpr,
                  FP16_DOT: tl.constexpr):
    """One tile of online softmax in the log2 domain: scores ``q @ kt`` times each key's
    dequantization scale ``k_scale`` ``[TILE]`` (``[BLOCK_G, TILE]``, -inf where not ``valid``) ->
    (p, alpha, m_new, l_new), ``l_i`` the denominator state of ``_zero_denominator``; the caller
    rescales its accumulator by alpha and adds the weighted values (``_accumulate``). FP16_DOT:
    ``q`` is
    ``_fp16_query``'s fp16 copy, ``qk_scale`` divided by its shift, and ``kt`` 8-bit: the dot runs
    on fp16 inputs (the 8-bit values convert exactly, ``_to_fp16``; the products are exact in the
    fp32 accumulator); else ``q`` is float32 and the dot runs at DOT_PRECISION."""
    if FP16_DOT:
        s = tl.dot(q, _to_fp16(kt))
    else:
        s = tl.dot(q, kt.to(tl.float32), input_precision=DOT_PRECISION)
    p, alpha, m_new = _exp_scores(s * (qk_scale * k_scale[None, :]), valid, m_i)
    if FP16_DOT:
        l_new = l_i * alpha[:, None] + p
    else:
        l_new = l_i * alpha + tl.sum(p, 1)
    return p, alpha, m_new, l_new


@triton.jit
def _to_fp16(x):
    """8-bit stored values (e4m3 or int8) as fp16, exactly. int8 on the GPU through the bits, four
    values per 32-bit register: u = x + 128 is x ^ 0x80 bytewise, fp16 ``0x64uu`` is 1024 + u, so
    subtracting 1152 leaves x (5 instructions per 4 values, where Triton's own conversion takes an
    int-to-float conversion per value and about as many byte moves)."""
    if x.dtype == tl.int8 and COMPILED:  # (inline PTX: not in the interpreter)
        return tl.inline_asm_elementwise(
            "{.reg .b32 t, c;\n"
            "xor.b32 t, $2, 0x80808080;\n"
            "prmt.b32 $0, t, 0x64646464, 0x4140;\n"
            "prmt.b32 $1, t, 0x64646464, 0x4342;\n"
            "mov.b32 c, 0x64806480;\n"
            "sub.f16x2 $0, $0, c;\n"
            "sub.f16x2 $1, $1, c;}",
            "=r,=r,r", [x], dtype=tl.float16, is_pure=True, pack=4)
    else:
        return x.to(tl.float16)


@triton.jit
def _fp16_query(q):
    """(q16, shift) for float32 query rows ``q`` ``[BLOCK_G, HEAD_DIM]`` that came from 16-bit
    storage: ``q16 = q * shift`` in fp16, exact (a bf16 value has 8 significant bits, fp16 11)
    unless a component is below fp16's normal range (6e-5 of the shifted scale: it keeps an
    absolute error under 3e-8, negligible in a dot with the others); ``shift`` is 1, or the power
    of two that brings ``max |q|`` under 2**14 (fp16's range ends at 65504)."""
    amax = tl.max(tl.max(tl.abs(q), 1), 0)
    shift = tl.where(amax > 16384.0, tl.exp2(-tl.ceil(tl.log2(amax / 16384.0))), 1.0)
    return (q * shift).to(tl.float16), shift


@triton.jit
def _accumulate(acc, acc_norm, v_max, alpha, p, v_scale, v, DOT_PRECISION: tl.constexpr,
                QUANT: tl.constexpr, FP16_DOT: tl.constexpr, INTERPRETED: tl.constexpr):
    """``acc * alpha + (p * v_scale) @ v`` -> (acc, acc_norm, v_max): float32
    ``[BLOCK_G, HEAD_DIM]`` for the running accumulator ``acc``, its rescale ``alpha``
    ``[BLOCK_G]``, softmax weights ``p`` ``[BLOCK_G, TILE]``, value rows ``v``
    ``[TILE, HEAD_DIM]`` and their dequantization scales ``[TILE]`` (used when QUANT). The scales
    go into the weights (``BLOCK_G`` rows, not the ``TILE x HEAD_DIM`` values).

    FP16_DOT: the dot runs on fp16 inputs, 8-bit values converted exactly (``_to_fp16``; e4m3 to
    bf16 takes three instructions per pair, to fp16 one) and the weights scaled by ``v_scale``
    over the tile's unit (its largest scale), so they stay in [0, 1] whatever the rows'
    magnitudes: 11 significant bits; a weight
    below fp16's normal range (6e-5 of the unit) loses bits, as a contribution under 1e-7 of the
    tile's largest row would. The accumulator is then in that unit, ``acc_norm`` (rescaled with
    ``alpha`` when the next tile's differs; ``_true_acc`` multiplies it back). The unit never
    falls below _NORM_FLOOR of ``v_max``, the largest scale seen (a tile of all-zero rows has
    scales of ~1e-33): the accumulator stays under 2**69 (2**20 tokens x 448 x 2**40) in any
    unit, where a unit that small would overflow it. Else the dot runs in float32 at
    DOT_PRECISION and ``acc_norm``, ``v_max`` are unused. INTERPRETED (Triton's CPU
    interpreter, whose dots on 16-bit inputs are not the GPU's): the same fp16 values widened to
    float32, whose products and sums match."""
    if FP16_DOT:
        tile_max = tl.max(v_scale, 0)
        v_max = tl.maximum(v_max, tile_max)
        norm = tl.maximum(tile_max, v_max * _NORM_FLOOR)
        norm = tl.where(norm > 0, norm, acc_norm)  # (nothing seen yet: the unit stays)
        w = (p * (v_scale / norm)[None, :]).to(tl.float16)
        v16 = _to_fp16(v)
        acc = acc * (alpha * (acc_norm / norm))[:, None]
        if INTERPRETED:
            acc += tl.dot(w.to(tl.float32), v16.to(tl.float32), input_precision="ieee")
        else:
            acc = tl.dot(w, v16, acc)
        return acc, norm, v_max
    if QUANT:
        p = p * v_scale[None, :]
    return acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision=DOT_PRECISION), \
        acc_norm, v_max


@triton.jit
def _true_acc(acc, acc_norm, FP16_DOT: tl.constexpr):
    """``_accumulate``'s accumulator in true scale."""
    if FP16_DOT:
        acc = acc * acc_norm
    return acc


@triton.jit
def _load_tile(kt_ptrs, v_ptrs, valid, MASKED: tl.constexpr):
    """(keys ``[HEAD_DIM, TILE]``, values ``[TILE, HEAD_DIM]``) of one tile; MASKED: the tokens not
    ``valid`` load as 0 (else all are read)."""
    if MASKED:
        kt = tl.load(kt_ptrs, mask=valid[None, :], other=0.0)
        v = tl.load(v_ptrs, mask=valid[:, None], other=0.0)
    else:
        kt = tl.load(kt_ptrs)
        v = tl.load(v_ptrs)
    return kt, v


@triton.jit
def _attend_tile(q, kt, v, k_scale, v_scale, valid, acc, acc_norm, v_max, m_i, l_i, qk_scale,
                 DOT_PRECISION: tl.constexpr, QUANT: tl.constexpr, FP16_DOT: tl.constexpr,
                 INTERPRETED: tl.constexpr, MASKED: tl.constexpr):
    """One tile of online softmax attention: keys ``kt`` ``[HEAD_DIM, TILE]`` and values ``v``
    ``[TILE, HEAD_DIM]`` (with their scales, ``_softmax_tile`` and ``_accumulate``) update the
    running ``acc``, ``acc_norm``, ``v_max``, ``m_i`` and ``l_i``; returns them. MASKED: the
    tokens not ``valid`` get no weight (else every token of the tile is read, which spares the
    masks their registers and instructions)."""
    if not MASKED:
        valid = tl.full(k_scale.shape, 1, tl.int1)
    p, alpha, m_new, l_new = _softmax_tile(q, kt, k_scale, valid, m_i, l_i, qk_scale,
                                           DOT_PRECISION, FP16_DOT)
    acc, acc_norm, v_max = _accumulate(acc, acc_norm, v_max, alpha, p, v_scale, v, DOT_PRECISION,
                                       QUANT, FP16_DOT, INTERPRETED)
    return acc, acc_norm, v_max, m_new, l_new


@triton.jit
def _attend_open(q, k_block, v_block, num_valid, acc, acc_norm, m_i, l_i, qk_scale, offs_t,
                 HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, DOT_PRECISION: tl.constexpr,
                 FP16_DOT: tl.constexpr):
    """A row's open block (``OpenBlocks``; paged and sparse decode): the first ``num_valid`` of
    the ``BLOCK_SIZE`` tokens at ``k_block`` / ``v_block`` (one kv head's ``[BLOCK_SIZE,
    HEAD_DIM]`` rows, contiguous, in the model's dtype, no scales) update the running state of the
    8-bit tiles (``_attend_tile``); returns (acc, m_i, l_i). The dots run on float32 inputs at
    DOT_PRECISION (tf32 holds a 16-bit value and ``_fp16_query``'s fp16 query exactly); the
    values' weights are divided by the accumulator's unit ``acc_norm`` (FP16_DOT), and the tile's
    row sums go into the first column of the denominator's per-column state."""
    offs_b, offs_d = tl.arange(0, BLOCK_SIZE), tl.arange(0, HEAD_DIM)
    valid = offs_b < num_valid
    kt = tl.load(k_block + offs_b[None, :] * HEAD_DIM + offs_d[:, None], mask=valid[None, :],
                 other=0.0)
    v = tl.load(v_block + offs_b[:, None] * HEAD_DIM + offs_d[None, :], mask=valid[:, None],
                other=0.0)
    s = tl.dot(q.to(tl.float32), kt.to(tl.float32), input_precision=DOT_PRECISION)
    p, alpha, m_new = _exp_scores(s * qk_scale, valid, m_i)
    if FP16_DOT:
        l_new = l_i * alpha[:, None] + tl.where(offs_t[None, :] == 0, tl.sum(p, 1)[:, None], 0.0)
    else:
        l_new = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p / acc_norm, v.to(tl.float32),
                                        input_precision=DOT_PRECISION)
    return acc, m_new, l_new


@triton.jit
def _store_split(acc, m_i, l_i, out_ptr, m_ws_ptr, l_ws_ptr, acc_ws_ptr, count_ptr, o_rows, split,
                 num_splits, num_q_heads, q_heads, g_mask, offs_d, stride_ob, stride_oh,
                 HEAD_DIM: tl.constexpr, DIRECT: tl.constexpr):
    """For program row g (query head ``q_heads[g]`` of output row ``o_rows[g]``), DIRECT (one
    split): normalise and write ``out``; else write the split's partial (m, l, acc) to the workspace
    ``[rows, num_q_heads, num_splits]`` and count it at ``count_ptr[pid(0) * num_programs(1) +
    pid(1)]``: the program that finishes its group's splits last (its count reaches
    ``num_splits``) merges them into ``out`` (``_merge_splits``) and sets the counter back to 0."""
    o_rows = o_rows.to(tl.int64)
    out_offs = o_rows[:, None] * stride_ob + q_heads[:, None] * stride_oh + offs_d[None, :]
    if DIRECT:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None])
    else:
        ws = (o_rows * num_q_heads + q_heads) * num_splits
        tl.store(m_ws_ptr + ws + split, m_i, mask=g_mask)
        tl.store(l_ws_ptr + ws + split, l_i, mask=g_mask)
        tl.store(acc_ws_ptr + (ws + split)[:, None] * HEAD_DIM + offs_d[None, :], acc,
                 mask=g_mask[:, None])
        tl.debug_barrier()  # every thread's partial, then the count (released at GPU scope)
        counter = count_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
        if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == num_splits - 1:
            tl.store(counter, 0)  # (zero for the next launch, which starts after this one ends)
            _merge_splits(m_ws_ptr, l_ws_ptr, acc_ws_ptr, out_ptr, ws, num_splits, out_offs,
                          g_mask, offs_d, HEAD_DIM)


@triton.jit
def _merge_splits(m_ws_ptr, l_ws_ptr, acc_ws_ptr, out_ptr, ws, num_splits, out_offs, g_mask,
                  offs_d, HEAD_DIM: tl.constexpr):
    """Write ``out + out_offs`` for the rows ``g_mask``: the merge of their ``num_splits``
    partials at workspace entries ``ws[g] + s`` (each split's accumulator weighted by ``exp2(m_s -
    max m)``, divided by the same weighting of the sums; a row whose splits are all empty gets
    zeros). The partials of other programs are read from L2 (``.cg``), never from a stale L1."""
    m_max = tl.full(ws.shape, float("-inf"), tl.float32)
    for s in range(num_splits):
        m_max = tl.maximum(m_max, tl.load(m_ws_ptr + ws + s, mask=g_mask, other=float("-inf"),
                                          cache_modifier=".cg"))
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)  # every split empty: padding row
    denom = tl.zeros(ws.shape, tl.float32)
    acc = tl.zeros([ws.shape[0], HEAD_DIM], tl.float32)
    for s in range(num_splits):
        m = tl.load(m_ws_ptr + ws + s, mask=g_mask, other=float("-inf"), cache_modifier=".cg")
        l = tl.load(l_ws_ptr + ws + s, mask=g_mask, other=0.0, cache_modifier=".cg")
        w = tl.exp2(m - m_max)
        denom += w * l
        part = tl.load(acc_ws_ptr + (ws + s)[:, None] * HEAD_DIM + offs_d[None, :],
                       mask=(g_mask & (l > 0))[:, None], other=0.0, cache_modifier=".cg")
        acc += part * w[:, None]
    out = acc / tl.where(denom > 0, denom, 1.0)[:, None]
    tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None])


@triton.jit
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_tables_ptr, context_lens_ptr,
    open_k_ptr, open_v_ptr, open_slots_ptr,
    out_ptr, m_ws_ptr, l_ws_ptr, acc_ws_ptr, count_ptr,
    qk_scale, blocks_per_split, num_splits,
    stride_qb, stride_qh, stride_ob, stride_oh,
    stride_cb, stride_ch, stride_cs, stride_bt, stride_sb, stride_sh,
    G: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCKS_PER_ITER: tl.constexpr, MIN_BLOCKS: tl.constexpr,
    DIRECT: tl.constexpr, DOT_PRECISION: tl.constexpr, QUANT: tl.constexpr,
    FP16_DOT: tl.constexpr, INTERPRETED: tl.constexpr, INDEX_AHEAD: tl.constexpr,
    OPEN: tl.constexpr,
):
    """Attention of the G query heads of kv head ``pid(1)`` of row ``pid(0)`` over split ``pid(2)``.

    ``qk_scale`` is ``scale * log2(e)``: scores live in the log2 domain (``exp2``), partial maxima
    too. Workspace (only used when not DIRECT, ``split_workspace``): m/l ``[B, num_q_heads,
    num_splits]``, acc ``[..., HEAD_DIM]``, a counter per (row, kv head). OPEN (8-bit caches,
    with INDEX_AHEAD): the row's last block is read from the open-block cache at block
    ``open_slots[row]`` (``_attend_open``), not from the 8-bit one.
    """
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    TILE: tl.constexpr = BLOCK_SIZE * BLOCKS_PER_ITER

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_t = tl.arange(0, TILE)
    tile_blk = offs_t // BLOCK_SIZE
    tile_off = offs_t % BLOCK_SIZE
    q_heads = kv_head * G + offs_g
    g_mask = offs_g < G

    rows = row + 0 * offs_g
    q = _load_q(q_ptr, rows, stride_qb, stride_qh, q_heads, g_mask, offs_d)
    if FP16_DOT:
        q, shift = _fp16_query(q)
        qk_scale = qk_scale / shift

    ctx_len = tl.load(context_lens_ptr + row)
    ctx_blocks = tl.cdiv(ctx_len, BLOCK_SIZE)
    # the tokens read from the 8-bit cache: with OPEN, those before the last block
    quant_len = (ctx_blocks - 1) * BLOCK_SIZE if OPEN else ctx_len
    # per row: this row's blocks over all splits, whole tiles, >= MIN_BLOCKS
    if blocks_per_split <= 0:
        per_split = tl.cdiv(tl.cdiv(ctx_blocks, num_splits), BLOCKS_PER_ITER) * BLOCKS_PER_ITER
        blocks_per_split = tl.maximum(per_split, MIN_BLOCKS)
    blk_start = split * blocks_per_split
    blk_end = tl.minimum(blk_start + blocks_per_split, ctx_blocks)
    bt_row = block_tables_ptr + row.to(tl.int64) * stride_bt
    # Per-token offset inside a block, transposed ([HEAD_DIM, TILE]) so K loads straight as K^T.
    kt_in_block = kv_head * stride_ch + tile_off[None, :] * stride_cs + offs_d[:, None]
    v_in_block = kv_head * stride_ch + _v_offsets(tile_off, offs_d, stride_cs, BLOCK_SIZE, QUANT)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = _zero_denominator(BLOCK_G, TILE, FP16_DOT)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
    acc_norm, v_max = 1.0, 0.0
    # INDEX_AHEAD (8-bit caches): a tile's block ids and scales are loaded one iteration ahead, so
    # the K/V loads (the pipelined ones) never wait on the block table or the small scale loads; and
    # every tile but the split's last is whole (all its tokens exist and are read), so the loop
    # loads and weighs them without masks, and the last one (the row's partly written last block,
    # blocks past the split's end), loaded ahead by the loop's last iteration, follows it, masked
    # token by token. Else every tile is masked in the loop (16-bit caches: either change costs
    # their pipelined loop more than it saves).
    head_offset = kv_head * stride_sh
    block_id, valid, k_scale, v_scale = _tile_index(
        bt_row, k_scale_ptr, v_scale_ptr, blk_start, blk_end, quant_len, tile_blk, tile_off,
        head_offset, stride_sb, BLOCK_SIZE, TILE, QUANT)
    last_tile = blk_start + tl.maximum(tl.cdiv(blk_end - blk_start, BLOCKS_PER_ITER) - 1, 0) \
        * BLOCKS_PER_ITER
    for blk0 in range(blk_start, last_tile if INDEX_AHEAD else blk_end, BLOCKS_PER_ITER):
        if not INDEX_AHEAD:
            block_id, valid, k_scale, v_scale = _tile_index(
                bt_row, k_scale_ptr, v_scale_ptr, blk0, blk_end, ctx_len, tile_blk, tile_off,
                head_offset, stride_sb, BLOCK_SIZE, TILE, QUANT)
        block_base = block_id * stride_cb
        kt, v = _load_tile(k_cache_ptr + block_base[None, :] + kt_in_block,
                           v_cache_ptr + block_base[:, None] + v_in_block, valid, not INDEX_AHEAD)
        if INDEX_AHEAD:
            next_id, next_valid, next_k_scale, next_v_scale = _tile_index(
                bt_row, k_scale_ptr, v_scale_ptr, blk0 + BLOCKS_PER_ITER, blk_end, quant_len,
                tile_blk, tile_off, head_offset, stride_sb, BLOCK_SIZE, TILE, QUANT)
        acc, acc_norm, v_max, m_i, l_i = _attend_tile(
            q, kt, v, k_scale, v_scale, valid, acc, acc_norm, v_max, m_i, l_i, qk_scale,
            DOT_PRECISION, QUANT, FP16_DOT, INTERPRETED, not INDEX_AHEAD)
        if INDEX_AHEAD:
            block_id, valid, k_scale, v_scale = next_id, next_valid, next_k_scale, next_v_scale
    if INDEX_AHEAD and blk_start < blk_end:
        block_base = block_id * stride_cb
        kt, v = _load_tile(k_cache_ptr + block_base[None, :] + kt_in_block,
                           v_cache_ptr + block_base[:, None] + v_in_block, valid, True)
        acc, acc_norm, v_max, m_i, l_i = _attend_tile(
            q, kt, v, k_scale, v_scale, valid, acc, acc_norm, v_max, m_i, l_i, qk_scale,
            DOT_PRECISION, QUANT, FP16_DOT, INTERPRETED, True)
    if OPEN and blk_start < blk_end and blk_end == ctx_blocks:  # this split ends the row
        # (the open blocks have the cache's layout: its block and head strides)
        open_base = (tl.load(open_slots_ptr + row).to(tl.int64) * stride_cb
                     + kv_head * stride_ch)
        acc, m_i, l_i = _attend_open(q, open_k_ptr + open_base, open_v_ptr + open_base,
                                     ctx_len - quant_len, acc, acc_norm, m_i, l_i, qk_scale,
                                     offs_t, HEAD_DIM, BLOCK_SIZE, DOT_PRECISION, FP16_DOT)

    _store_split(_true_acc(acc, acc_norm, FP16_DOT), m_i, _row_denominator(l_i, FP16_DOT), out_ptr,
                 m_ws_ptr, l_ws_ptr, acc_ws_ptr, count_ptr, rows, split, num_splits,
                 tl.num_programs(1) * G, q_heads, g_mask, offs_d, stride_ob, stride_oh, HEAD_DIM,
                 DIRECT)


def fp16_dot(q: torch.Tensor, cache: torch.Tensor) -> bool:
    """Whether decode over ``cache`` runs its dots on fp16 inputs (``_softmax_tile``,
    ``_accumulate``): an 8-bit cache read by 16-bit queries. A float32 query keeps the float32 dots
    (the exact path)."""
    return quantized(cache.dtype) and q.dtype in (torch.bfloat16, torch.float16)


def launch_config(launch: tuple[int, int, int, int] | None = None,
                  quantized: bool = False) -> tuple[int, int, int, int]:
    """(tokens per iteration, warps, stages, register cap or 0) for paged and sparse decode:
    ``launch`` when given (a kernel benchmark's sweep), else the tuned one (``quantized``: over an
    8-bit cache or working set)."""
    if launch:
        return launch
    return _LAUNCH_8BIT if quantized else _LAUNCH


def default_num_splits(batch: int, num_kv_heads: int, max_blocks: int, block_size: int,
                       wave: int = _DEFAULT_WAVE) -> int:
    """Split-K factor from shapes only (so a captured graph keeps one grid).

    The smallest split count s whose ``batch * num_kv_heads * s`` programs fill their waves of
    ``wave`` programs at least 95% (else the best fill found), with s <=
    ``max_blocks * block_size // _MIN_TOKENS_PER_SPLIT`` and <= ``_MAX_SPLITS``. With 8 kv heads and
    a 512-program wave: batch 64 -> 1, 32 -> 2, 48 -> 4, 24 -> 8, 1 with a 32K table -> 61. Each row
    divides its own context over the splits, so tables wider than the contexts waste no programs.
    """
    base = max(1, batch * num_kv_heads)
    limit = max(1, min(max_blocks * block_size // _MIN_TOKENS_PER_SPLIT, _MAX_SPLITS))
    best, best_fill = 1, 0.0
    for splits in range(1, limit + 1):
        programs = base * splits
        fill = programs / (-(-programs // wave) * wave)
        if fill > best_fill * 1.05:
            best, best_fill = splits, fill
        if fill >= 0.95:
            break
    return best


_waves: dict[tuple, int] = {}


def _wave_size(compiled, device: torch.device, num_warps: int) -> int | None:
    """Programs of ``compiled`` (``num_warps`` warps each) resident at once on the whole GPU, from
    its registers / shared memory."""
    n_regs = getattr(compiled, "n_regs", None)
    if not n_regs:
        return None
    props = torch.cuda.get_device_properties(device)
    threads = 32 * num_warps
    shared = getattr(compiled.metadata, "shared", 0) or 0
    smem_per_sm = getattr(props, "shared_memory_per_multiprocessor", 0) or 228 * 1024
    per_sm = min(props.max_threads_per_multi_processor // threads,
                 props.regs_per_multiprocessor // (n_regs * threads),
                 smem_per_sm // shared if shared else 32)
    return max(1, per_sm) * props.multi_processor_count


#: device -> the split counters of launches on it, every size made (``_split_counters``)
_counters: dict[torch.device, list[torch.Tensor]] = {}
_MIN_COUNTERS = 1 << 12


def _split_counters(device: torch.device, count: int) -> torch.Tensor:
    """int32 counters ``[>= count]`` for split launches on ``device``: zero between launches (the
    program that merges a group sets its counter back), so split launches on one device must not
    run at the same time (the engine launches them on one stream). Made outside CUDA-graph
    capture, by a warm-up launch (as every capture here has one): a tensor made during a capture
    would be zeroed only by that graph's replays and could share memory with other graphs'
    scratch. Never freed: captured graphs hold their addresses."""
    made = _counters.setdefault(device, [])
    if not made or made[-1].numel() < count:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("split decode's counters must be made outside CUDA-graph capture: "
                               "launch it once at this batch size before capturing it")
        size = max(_MIN_COUNTERS, triton.next_power_of_2(count))
        made.append(torch.zeros(size, dtype=torch.int32, device=device))
    return made[-1]


def split_workspace(out: torch.Tensor, num_splits: int, groups: int) -> tuple[torch.Tensor, ...]:
    """(m, l, acc, counters) for ``out`` ``[rows, Hq, D]`` split ``num_splits`` ways over
    ``groups`` programs per split: float32 partials ``[rows, Hq, num_splits]`` twice and ``[rows,
    Hq, num_splits, D]``, and ``_split_counters(out.device, groups)``, which every launch makes
    sure of, split or not (a warm-up may split fewer ways than its capture: the wave size is
    measured at the first compile). With one split the kernel writes ``out`` directly and never
    reads them: ``out`` stands in for all four."""
    counters = _split_counters(out.device, groups)
    if num_splits == 1:
        return out, out, out, out
    rows, heads, head_dim = out.shape
    m_ws = torch.empty((rows, heads, num_splits), dtype=torch.float32, device=out.device)
    return (m_ws, torch.empty_like(m_ws),
            torch.empty((rows, heads, num_splits, head_dim), dtype=torch.float32,
                        device=out.device), counters)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           out: torch.Tensor | None = None,
                           blocks_per_split: int | None = None,
                           num_splits: int | None = None,
                           scales: tuple[torch.Tensor, torch.Tensor] | None = None,
                           launch: tuple[int, int, int, int] | None = None,
                           open_block: OpenBlocks | None = None) -> torch.Tensor:
    """Decode attention of one query token per row over its paged KV cache; returns ``out``.

    q: ``[B, num_q_heads, head_dim]`` (last-dim stride 1), num_q_heads = G * num_kv_heads; query
    head ``h`` attends kv head ``h // G``. k_cache, v_cache: contiguous
    ``[num_blocks, num_kv_heads, block_size, head_dim]``; head_dim and block_size powers of two
    >= 16. block_tables: int32 ``[B, max_blocks]``; only its first
    ``ceil(context_lens[b] / block_size)`` entries of row b are read. context_lens: int32 ``[B]``,
    each <= max_blocks * block_size; rows with 0 get zeros. scale: softmax scale. out: optional
    ``[B, num_q_heads, head_dim]`` to write into, else allocated with q's dtype. An 8-bit
    ``v_cache`` holds its blocks in the V layout (``fp8.v_rows``). Splits: by default
    ``default_num_splits`` (from the measured wave size), each row dividing its own context among
    them; ``num_splits`` forces the count (still per row); ``blocks_per_split`` forces that many KV
    blocks per split instead. Math is fp32 with K/V upcast; with 16-bit q and caches the dots run as
    tf32 (exact for the 16-bit Q.K products; softmax weights are rounded to tf32 for P.V), with an
    fp32 q or cache as IEEE fp32; an 8-bit cache read by a 16-bit q as in ``fp16_dot``. ``launch``:
    forces ``launch_config``. ``open_block`` (8-bit caches only): each row's last block, the one
    its tokens are written into, is read from ``open_block``'s caches in the model's dtype
    (``OpenBlocks``), not from the 8-bit ones. No host sync; CUDA-graph capturable.
    """
    batch, num_q_heads, head_dim = q.shape
    _, num_kv_heads, block_size, cache_dim = k_cache.shape
    assert v_cache.shape == k_cache.shape and v_cache.dtype == k_cache.dtype
    assert k_cache.is_contiguous() and v_cache.is_contiguous(), "caches must be contiguous"
    assert cache_dim == head_dim and num_q_heads % num_kv_heads == 0, (
        f"q {tuple(q.shape)} does not fit cache {tuple(k_cache.shape)}")
    assert head_dim >= 16 and head_dim & (head_dim - 1) == 0, (
        "head_dim must be a power of two >= 16")
    assert block_size >= 16 and block_size & (block_size - 1) == 0, (
        "block_size must be a power of two >= 16")
    assert q.stride(2) == 1 and block_tables.stride(1) == 1
    assert (block_tables.dim() == 2 and block_tables.shape[0] == batch
            and context_lens.shape == (batch,))
    context_lens = context_lens.contiguous()  # 1-D index arrays are read as packed
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    assert out.shape == q.shape and out.stride(2) == 1
    if batch == 0:
        return out

    max_blocks = block_tables.shape[1]
    quant = scales is not None
    tokens, warps, stages, max_regs = launch_config(launch, quant)
    key = (q.device, q.dtype, k_cache.dtype, head_dim, block_size, num_q_heads // num_kv_heads,
           tokens, warps, stages, max_regs, open_block is not None)
    if blocks_per_split is None:
        num_splits = num_splits or default_num_splits(batch, num_kv_heads, max_blocks, block_size,
                                                      _waves.get(key, _DEFAULT_WAVE))
        # 0: each row splits its own context
        blocks_per_split = max_blocks if num_splits == 1 else 0
    else:
        assert blocks_per_split >= 1
        num_splits = max(1, triton.cdiv(max_blocks, blocks_per_split))
    group = num_q_heads // num_kv_heads
    direct = num_splits == 1
    workspace = split_workspace(out, num_splits, batch * num_kv_heads)
    fp32 = torch.float32 in (q.dtype, k_cache.dtype)
    k_scale, v_scale = check_scales(scales, k_cache, q.device)
    if open_block is not None:
        assert quant, "an open block in the model's dtype is kept only beside an 8-bit cache"
        open_block.check(k_cache, batch)
        open_args = (open_block.k, open_block.v, open_block.slots)
    else:
        open_args = (k_cache, v_cache, context_lens)  # (never read)

    compiled = _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, k_scale, v_scale, block_tables, context_lens, *open_args,
        out, *workspace,
        scale * _LOG2E, blocks_per_split, num_splits,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        k_scale.stride(0), k_scale.stride(1),
        G=group, BLOCK_G=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size, BLOCKS_PER_ITER=max(1, tokens // block_size),
        MIN_BLOCKS=max(1, _MIN_TOKENS_PER_SPLIT // block_size), DIRECT=direct,
        DOT_PRECISION="ieee" if fp32 else "tf32", QUANT=quant,
        FP16_DOT=fp16_dot(q, k_cache), INTERPRETED=not q.is_cuda, INDEX_AHEAD=quant,
        OPEN=open_block is not None, num_warps=warps, num_stages=stages, maxnreg=max_regs or None,
    )
    if key not in _waves and q.is_cuda:
        _waves[key] = _wave_size(compiled, q.device, warps) or _DEFAULT_WAVE
    return out
