"""Triton kernel that writes new tokens' K/V rows into the paged KV cache (``store_kv``).

Cache layout (shared with ``paged_decode``): ``[num_blocks, num_kv_heads, block_size, head_dim]``; a
token's slot is ``block_id * block_size + offset``. The caches may also be strided views whose last
two dims ``[block_size, head_dim]`` are contiguous, e.g. one layer ``host_k[:, layer]`` of the
tiered host store ``[num_host_blocks, num_layers, Hk, B, D]`` (block stride
``num_layers * Hk * B * D``).
"""
import os

import torch
import triton
import triton.language as tl

from oasiskv.kernels.fp8 import (FP8, INT8, MIN_AMAX, QUANT_MAX, SCALE_STEPS, check_scales,
                                 scale_steps)

#: compiled for a GPU, not run by Triton's CPU interpreter (which lacks exact fp8 conversions, fused
#: multiply-adds and inline PTX)
COMPILED = tl.constexpr(os.environ.get("TRITON_INTERPRET") != "1")


@triton.jit
def _round_to_e4m3(x):
    """float32 ``x`` (|x| <= 448) rounded to the nearest e4m3 value, ties to even, still float32:
    the final cast is then exact on every backend (the interpreter's own fp8 rounding is not)."""
    bits = x.to(tl.int32, bitcast=True)
    sign = bits & -2147483648  # 0x80000000
    biased = (bits >> 23) & 0xFF
    mant = bits & 0x7FFFFF
    # mantissa bits below the e4m3 grid: 20 down to 2^-6 (normal e4m3), then one more per halving
    # (the grid stays 2^-9); at 23 only the implicit leading bit is kept
    drop = tl.minimum(20 + tl.maximum(121 - biased, 0), 23)
    lsb = ((mant | 0x800000) >> drop) & 1
    rounded = (bits + ((1 << (drop - 1)) - 1 + lsb)) & ~((1 << drop) - 1)
    # [2^-10, 2^-9): 2^-9 above the tie, 0 at it (even); below: 0
    tiny = tl.where((biased == 117) & (mant > 0), sign | (118 << 23), sign)
    return tl.where(biased < 118, tiny, rounded).to(tl.float32, bitcast=True)


@triton.jit
def _round_to_integer(x):
    """float32 ``x`` rounded to the nearest integer, ties to even (as ``torch.round``), still
    float32: the cast to int8 after it is exact (a cast alone truncates)."""
    r = tl.floor(x + 0.5)
    tie_to_odd = (r - x == 0.5) & (r - 2.0 * tl.floor(r * 0.5) == 1.0)
    return tl.where(tie_to_odd, r - 1.0, r)


@triton.jit
def _to_e4m3(y):
    """float32 ``y`` (|y| <= 448) -> the nearest e4m3 value, ties to even: compiled, the GPU's
    conversion (an e4m3 tensor, two values per instruction); interpreted, ``_round_to_e4m3``
    (float32; the interpreter's own fp8 rounding is not exact). Both store the same bytes."""
    if COMPILED:
        return y.to(tl.float8e4nv)
    else:
        return _round_to_e4m3(y)


@triton.jit
def _searched_e4m3(x, base, steps_ptr, QMAX: tl.constexpr, STEPS: tl.constexpr):
    """float32 rows ``x`` ``[BLOCK_H, BLOCK_D]`` with their plain scales ``base`` ``[BLOCK_H]`` ->
    (e4m3 values, scales): every candidate scale ``s = base * steps[j]`` is tried at once
    (``[BLOCK_H, STEPS, BLOCK_D]``, values ``x * (1 / s)``) and each row keeps the first of those
    with the least squared error, as ``quantize_rows(..., search=True)``. Each error ``q * s - x``
    is exact in float32 (q has 4 significant bits: the difference needs at most 24), so compiled
    it is one fused multiply-add (interpreted, float64, whose product is exact too); the squares
    sum in float64, where they are exact, so the order of the sum barely matters."""
    j = tl.arange(0, STEPS)
    scales = base[:, None] * tl.load(steps_ptr + j)[None, :]  # [BLOCK_H, STEPS]
    inverse = tl.div_rn(tl.full(scales.shape, 1.0, tl.float32), scales)
    x3 = x[:, None, :]
    q = _to_e4m3(tl.minimum(tl.maximum(x3 * inverse[:, :, None], -QMAX), QMAX)).to(tl.float32)
    if COMPILED:
        err = tl.fma(q, scales[:, :, None], -x3).to(tl.float64)
    else:
        err = q.to(tl.float64) * scales[:, :, None].to(tl.float64) - x3.to(tl.float64)
    best = tl.argmin(tl.sum(err * err, 2), 1, tie_break_left=True)  # [BLOCK_H]
    pick = j[None, :] == best[:, None]
    # the chosen candidate's values again, from its inverse (a float sum over the candidates would
    # turn a value rounded to -0 into +0)
    chosen = tl.sum(tl.where(pick, inverse, 0.0), 1)
    q = _to_e4m3(tl.minimum(tl.maximum(x * chosen[:, None], -QMAX), QMAX))
    return q, tl.sum(tl.where(pick, scales, 0.0), 1)


@triton.jit
def _store_rows(x_ptr, steps_ptr, mask, cache_ptr, cache_off, scale_ptr, scale_off, row_mask,
                open_ptr, open_off, open_mask, mirror_ptr, mirror_off, mirror_scale_ptr,
                mirror_scale_off, mirror_mask, mirror_row_mask,
                QMAX: tl.constexpr, MIN_AMAX: tl.constexpr, QUANT: tl.constexpr,
                INT: tl.constexpr, STEPS: tl.constexpr, OPEN: tl.constexpr,
                MIRROR: tl.constexpr):
    """Store rows ``[BLOCK_H, BLOCK_D]`` (``mask``; ``row_mask`` ``[BLOCK_H, 1]``: the rows') into
    the cache: cast, or (QUANT) quantised per row to e4m3, or (INT) to int8, with QMAX the
    format's largest value, its scale written at ``scale_off`` ``[BLOCK_H, 1]``
    (``kernels/fp8.py``). STEPS > 1 (e4m3): the scale is searched among the STEPS multipliers at
    ``steps_ptr`` (``_searched_e4m3``). OPEN: the rows are also copied, cast to its dtype, to
    ``open_ptr + open_off`` where ``open_mask``. MIRROR: the stored values and scales also go to
    ``mirror_ptr + mirror_off`` where ``mirror_mask`` and ``mirror_scale_ptr + mirror_scale_off``
    where ``mirror_row_mask``."""
    x = tl.load(x_ptr, mask=mask | open_mask | mirror_mask, other=0.0)
    if OPEN:
        tl.store(open_ptr + open_off, x.to(open_ptr.dtype.element_ty), mask=open_mask)
    if QUANT:
        x = x.to(tl.float32)
        # IEEE divisions: the torch reference rounds the same way
        scale = tl.div_rn(tl.maximum(tl.max(tl.abs(x), 1), MIN_AMAX), QMAX)
        if STEPS > 1:
            x, scale = _searched_e4m3(x, scale, steps_ptr, QMAX, STEPS)
        else:
            x = tl.minimum(tl.maximum(tl.div_rn(x, scale[:, None]), -QMAX), QMAX)
            x = _round_to_integer(x) if INT else _round_to_e4m3(x)
        tl.store(scale_ptr + scale_off, scale[:, None], mask=row_mask)
        if MIRROR:
            tl.store(mirror_scale_ptr + mirror_scale_off, scale[:, None], mask=mirror_row_mask)
    stored = x.to(cache_ptr.dtype.element_ty)
    tl.store(cache_ptr + cache_off, stored, mask=mask)
    if MIRROR:
        tl.store(mirror_ptr + mirror_off, stored, mask=mirror_mask)


@triton.jit
def _slot_offsets(slot, heads, dims, stride_kb, stride_kh, stride_vb, stride_vh, stride_sb,
                  stride_sh, stride_t, BLOCK_SIZE: tl.constexpr, V_LAYOUT: tl.constexpr):
    """Offsets of token slot ``slot``'s rows ``[BLOCK_H, BLOCK_D]`` (``heads`` ``[BLOCK_H, 1]``,
    ``dims`` ``[1, BLOCK_D]``) in a K cache and a V cache of those block / head strides, whose
    tokens lie ``stride_t`` apart in a block (V in the V layout where V_LAYOUT: a block's bytes
    token-minor, ``kernels/fp8.py``), and of their scales ``[BLOCK_H, 1]``."""
    blk, off = slot // BLOCK_SIZE, slot % BLOCK_SIZE
    in_blk = off * stride_t + dims
    v_in_blk = off + dims * BLOCK_SIZE if V_LAYOUT else in_blk
    return (blk * stride_kb + heads * stride_kh + in_blk,
            blk * stride_vb + heads * stride_vh + v_in_blk,
            blk * stride_sb + heads * stride_sh + off)


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, slot_ptr, steps_ptr,
    open_k_ptr, open_v_ptr, open_slot_ptr,
    mirror_k_ptr, mirror_v_ptr, mirror_ks_ptr, mirror_vs_ptr, mirror_slot_ptr,
    stride_kn, stride_kh, stride_vn, stride_vh,
    stride_kcb, stride_kch, stride_vcb, stride_vch, stride_cs,
    stride_sb, stride_sh, stride_ob, stride_oh,
    stride_mkb, stride_mkh, stride_mvb, stride_mvh, stride_msb, stride_msh,
    num_heads, head_dim,
    BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    QMAX: tl.constexpr, MIN_AMAX: tl.constexpr, QUANT: tl.constexpr, INT: tl.constexpr,
    STEPS: tl.constexpr, OPEN: tl.constexpr, V_LAYOUT: tl.constexpr, MIRROR: tl.constexpr,
):
    """Program ``(token, h)`` copies the token's K and V rows of heads ``h * BLOCK_H`` ..
    ``(h + 1) * BLOCK_H - 1`` into its cache slot (QUANT: as 8-bit rows with their scales; V in
    the V layout where V_LAYOUT), with OPEN also, unquantised, into its slot of the open-block
    caches (``open_slot_ptr``), and with MIRROR the same stored rows and scales into its slot of
    the mirror caches (``mirror_slot_ptr``)."""
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    head_ok, dim_ok = heads < num_heads, dims < head_dim
    row_mask = head_ok & (slot >= 0)
    mask = row_mask & dim_ok
    k_off, v_off, scale_off = _slot_offsets(slot, heads, dims, stride_kcb, stride_kch, stride_vcb,
                                            stride_vch, stride_sb, stride_sh, stride_cs,
                                            BLOCK_SIZE, V_LAYOUT)
    if OPEN:  # (contiguous blocks of the cache's shape, unquantised: rows in token order)
        open_slot = tl.load(open_slot_ptr + tok).to(tl.int64)
        open_mask = head_ok & (open_slot >= 0) & dim_ok
        open_off, _, _ = _slot_offsets(open_slot, heads, dims, stride_ob, stride_oh, stride_ob,
                                       stride_oh, 0, 0, head_dim, BLOCK_SIZE, False)
    else:
        open_mask, open_off = mask & False, 0
    if MIRROR:
        m_slot = tl.load(mirror_slot_ptr + tok).to(tl.int64)
        m_k_off, m_v_off, m_scale_off = _slot_offsets(
            m_slot, heads, dims, stride_mkb, stride_mkh, stride_mvb, stride_mvh, stride_msb,
            stride_msh, stride_cs, BLOCK_SIZE, V_LAYOUT)
        m_row_mask = head_ok & (m_slot >= 0)
    else:
        m_k_off, m_v_off, m_scale_off, m_row_mask = 0, 0, 0, row_mask & False
    m_mask = m_row_mask & dim_ok
    _store_rows(k_ptr + tok * stride_kn + heads * stride_kh + dims, steps_ptr, mask,
                k_cache_ptr, k_off, k_scale_ptr, scale_off, row_mask, open_k_ptr, open_off,
                open_mask, mirror_k_ptr, m_k_off, mirror_ks_ptr, m_scale_off, m_mask,
                m_row_mask, QMAX, MIN_AMAX, QUANT, INT, STEPS, OPEN, MIRROR)
    _store_rows(v_ptr + tok * stride_vn + heads * stride_vh + dims, steps_ptr, mask,
                v_cache_ptr, v_off, v_scale_ptr, scale_off, row_mask, open_v_ptr, open_off,
                open_mask, mirror_v_ptr, m_v_off, mirror_vs_ptr, m_scale_off, m_mask,
                m_row_mask, QMAX, MIN_AMAX, QUANT, INT, STEPS, OPEN, MIRROR)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor,
             scales: tuple[torch.Tensor, torch.Tensor] | None = None,
             open_block: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
             v_layout: bool = True, mirror: tuple | None = None) -> None:
    """Write ``k[i]``/``v[i]`` into cache slot ``slot_mapping[i]``, in place; negative slots are
    skipped.

    k, v: ``[N, num_kv_heads, head_dim]``, any float dtype, last-dim stride 1 (other strides free).
    k_cache, v_cache: ``[num_blocks, num_kv_heads, block_size, head_dim]``, same shape/dtype, each
    with its last two dims contiguous (strides of dims 0 and 1 free, e.g. a layer view of the host
    store); values are cast to the cache dtype. slot_mapping: int32/int64 ``[N]``. Duplicate
    non-negative slots leave an unspecified one of the duplicates in the cache. 8-bit caches
    (``float8_e4m3fn``, ``int8``) come with ``scales``: float32 ``(k_scale, v_scale)``, the
    caches' shape without the last dim (same strides for both), last-dim stride 1: each row is
    quantised with its own scale (``kernels/fp8.py``; e4m3 rows with the searched one,
    ``quantize_rows(..., search=True)``), V in the V layout (``fp8.v_rows``: a dense pool's) or,
    ``v_layout=False``, in token order as K (the tiered store's, ``kernels/fp8.py``). ``open_block``
    ``(open_k, open_v, open_slots)``: the same rows also go, cast and unquantised, to slot
    ``open_slots[i]`` (``[N]``, negative: skipped) of ``open_k``/``open_v``, contiguous caches of
    the cache's block and head shape (an 8-bit pool's open blocks, ``kernels/fp8.py``), in the same
    launch. ``mirror`` ``(mirror_k, mirror_v, mirror_slots, mirror_scales)``: the stored rows (and
    8-bit rows' scales, ``mirror_scales`` as ``scales``, else None), bit for bit, also go to slot
    ``mirror_slots[i]`` (``[N]``, negative: skipped) of ``mirror_k``/``mirror_v``, caches of the
    cache's dtype, block and head shape (strides as the cache's), in the same launch: rows
    quantised once for two caches (the tiered store's host store and local blocks). Does not
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
    k_scale, v_scale = check_scales(scales, k_cache, k.device)
    assert k_scale.stride() == v_scale.stride()
    if open_block is not None:
        open_k, open_v, open_slots = open_block
        assert (open_k.shape == open_v.shape and open_k.shape[1:] == k_cache.shape[1:]
                and open_k.is_contiguous() and open_v.is_contiguous()), (
            f"open blocks {tuple(open_k.shape)} do not fit cache {tuple(k_cache.shape)}")
        assert open_slots.shape == (n,) and open_slots.dtype in (torch.int32, torch.int64)
        open_slots = open_slots.contiguous()
    else:
        open_k, open_v, open_slots = k_cache, v_cache, slot_mapping  # (never read)
    if mirror is not None:
        mirror_k, mirror_v, mirror_slots, mirror_scales = mirror
        for cache in (mirror_k, mirror_v):
            assert (cache.shape[1:] == k_cache.shape[1:] and cache.dtype == k_cache.dtype
                    and cache.stride(3) == 1 and cache.stride(2) == head_dim), (
                f"mirror {tuple(cache.shape)} {cache.dtype} does not fit cache "
                f"{tuple(k_cache.shape)} {k_cache.dtype}")
        assert mirror_slots.shape == (n,) and mirror_slots.dtype in (torch.int32, torch.int64)
        mirror_slots = mirror_slots.contiguous()
        mirror_ks, mirror_vs = check_scales(mirror_scales, mirror_k, k.device)
        assert mirror_ks.stride() == mirror_vs.stride()
    else:  # (never read)
        mirror_k, mirror_v, mirror_slots, mirror_ks, mirror_vs = (
            k_cache, v_cache, slot_mapping, k_scale, v_scale)
    if n == 0:
        return
    # e4m3: the scale search's candidates fill a program of one row each; else a token's rows
    steps = SCALE_STEPS if k_cache.dtype == FP8 else 1
    block_h = 1 if steps > 1 else triton.next_power_of_2(num_heads)
    _store_kv_kernel[(n, triton.cdiv(num_heads, block_h))](
        k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping, scale_steps(k.device),
        open_k, open_v, open_slots, mirror_k, mirror_v, mirror_ks, mirror_vs, mirror_slots,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        k_cache.stride(2), k_scale.stride(0), k_scale.stride(1), open_k.stride(0), open_k.stride(1),
        mirror_k.stride(0), mirror_k.stride(1), mirror_v.stride(0), mirror_v.stride(1),
        mirror_ks.stride(0), mirror_ks.stride(1),
        num_heads, head_dim,
        BLOCK_SIZE=k_cache.shape[2], BLOCK_H=block_h, BLOCK_D=triton.next_power_of_2(head_dim),
        QMAX=QUANT_MAX.get(k_cache.dtype, 1.0), MIN_AMAX=MIN_AMAX, QUANT=scales is not None,
        INT=k_cache.dtype == INT8, STEPS=steps, OPEN=open_block is not None,
        V_LAYOUT=scales is not None and v_layout, MIRROR=mirror is not None,
    )
