"""8-bit KV storage (``kernels/fp8.py``): every kernel that writes or reads e4m3 or int8 rows with
their per-row scales vs its torch reference, on random inputs with NaN wherever nothing may be read
(int8 rows: NaN scales, and -128, which no writer stores).

Writers quantise exactly like ``quantize_rows`` (bit-identical values and scales); readers equal
their references on the same 8-bit rows and the dense computation on the dequantized rows. CPU runs
use the Triton interpreter and tiny shapes. FP8 summaries are e4m3 whatever the KV storage."""
import math

import pytest
import torch

from oasiskv.kernels.fp8 import (FP8, FP8_MAX, INT8, OpenBlocks, dequantize, quantize_rows,
                                 stored_v, v_rows)
from oasiskv.kernels.block_scores import block_scores
from oasiskv.kernels.paged_decode import paged_decode_attention
from oasiskv.kernels.reference import (block_minmax_ref, block_scores_ref, gather_blocks_ref,
                                       paged_decode_ref, sparse_decode_ref, store_kv_ref)
from oasiskv.kernels.sparse_decode import sparse_decode_attention
from oasiskv.kernels.store_kv import store_kv
from oasiskv.kernels.summaries import block_minmax
from oasiskv.kernels.uva_gather import gather_blocks
from tests.kernels.test_paged_decode import _case, _dense
from tests.kernels.test_sparse_kernels import (NUM_BLOCKS, ROWS, _dense_sparse, _host_case,
                                               _scores_case, _scores_float64, _ws_case)

NAN = float("nan")
KV_DTYPES = pytest.mark.parametrize("kv", [FP8, INT8], ids=["fp8", "int8"])


def quantized(cache, kv=FP8):
    """A ``kv`` copy of a float cache ``[..., D]`` and its scales ``[...]`` (NaN rows keep NaN
    scales)."""
    return quantize_rows(cache, kv)


def quantized_v(cache, kv=FP8):
    """``quantized`` for value rows: the ``kv`` copy in the V layout (``fp8.v_rows``)."""
    values, scale = quantize_rows(cache, kv)
    return stored_v(values), scale


def blank(shape, kv, device="cpu"):
    """A ``kv`` tensor no writer could have written: NaN (e4m3), -128 (int8)."""
    if kv == FP8:
        return torch.full(shape, NAN, device=device).to(FP8)
    return torch.full(shape, -128, dtype=kv, device=device)


def is_blank(x):
    return x.float().isnan() if x.dtype == FP8 else x == -128


def bits(x):
    return x.view(torch.uint8) if x.dtype == FP8 else x


def test_quantize_rows_round_trip_and_range():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 128, generator=gen) * torch.logspace(-4, 3, 64)[:, None]
    x[3] = 0.0
    q, scale = quantize_rows(x)
    assert q.dtype == FP8 and scale.dtype == torch.float32 and scale.shape == (64,)
    assert q.float().abs().amax(-1)[torch.arange(64) != 3].eq(FP8_MAX).all(), "rows use the range"
    err = (dequantize(q, scale) - x).abs()
    assert (err <= x.abs().amax(-1, keepdim=True) * 2**-4).all()  # 3 mantissa bits
    assert dequantize(q, scale)[3].eq(0).all()


def test_scale_search_leaves_each_row_no_more_error_than_the_plain_scale():
    """e4m3 rows with the searched scale: within one octave above amax / 448 (so no value
    saturates), never more squared error than the plain scale's (which is the first candidate),
    on average much less; int8 rows are not searched."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(512, 64, generator=gen) * torch.logspace(-4, 3, 512)[:, None]
    x[:8] *= torch.rand(8, 64, generator=gen) < 0.1  # sparse rows
    x[8] = 0.0
    plain_q, plain_s = quantize_rows(x)
    q, s = quantize_rows(x, search=True)
    assert ((s >= plain_s) & (s < 2 * plain_s)).all() and q.float().abs().le(FP8_MAX).all()

    def sq_err(q, s):
        return (dequantize(q, s).double() - x.double()).square().sum(-1)

    assert (sq_err(q, s) <= sq_err(plain_q, plain_s)).all()
    assert sq_err(q, s).sum() < 0.8 * sq_err(plain_q, plain_s).sum()
    assert torch.equal(s[8], plain_s[8]) and dequantize(q, s)[8].eq(0).all()
    assert all(torch.equal(a, b) for a, b in zip(quantize_rows(x, INT8, search=True),
                                                 quantize_rows(x, INT8)))


def test_the_v_layout_keeps_each_blocks_bytes_token_minor():
    """Value (t, d) of a block of 8-bit V storage ``[..., B, D]`` is its byte ``d * B + t``:
    ``stored_v`` writes rows so and ``v_rows`` reads them back."""
    rows = torch.randint(-127, 128, (3, 2, 16, 8), dtype=torch.int8)
    stored = stored_v(rows)
    assert stored.shape == rows.shape and stored.is_contiguous()
    for t, d in ((0, 0), (5, 3), (15, 7), (1, 6)):
        assert stored[2, 1].flatten()[d * 16 + t] == rows[2, 1, t, d]
    assert torch.equal(v_rows(stored), rows)


@pytest.mark.parametrize("fn, device", [
    (store_kv, "cpu"), (store_kv_ref, "cpu"),
    pytest.param(store_kv, "cuda", marks=pytest.mark.gpu)], ids=["triton", "ref", "compiled"])
def test_store_kv_e4m3_scale_search_many_rows(fn, device, request):
    """Many rows of very different magnitudes: the kernel (interpreted or compiled, where the
    GPU's own e4m3 conversion and fused multiply-adds run) and its reference store exactly
    ``quantize_rows(..., search=True)``'s values and scales (computed on the CPU)."""
    if device == "cuda":
        request.getfixturevalue("cuda_device")
    gen = torch.Generator().manual_seed(5)
    n, heads, block, dim = 96, 4, 16, 64
    k, v = (torch.randn(n, heads, dim, generator=gen)
            * torch.logspace(-3, 3, n * heads).view(n, heads, 1) for _ in range(2))
    k[:4, :, 1::3] *= 1e-7  # values that round to 0, -0 among them: stored as their signs say
    slots = torch.randperm(n)
    k_cache, v_cache = (blank((n // block, heads, block, dim), FP8, device) for _ in range(2))
    scales = tuple(torch.full((n // block, heads, block), NAN, device=device) for _ in range(2))
    fn(k.to(device), v.to(device), k_cache, v_cache, slots.to(device), scales=scales)
    for x, cache, scale in ((k, k_cache, scales[0]), (v, v_rows(v_cache), scales[1])):
        want_q, want_s = quantize_rows(x, FP8, search=True)
        stored = cache.cpu().transpose(1, 2).reshape(n, heads, dim)[slots]
        assert torch.equal(bits(stored), bits(want_q))
        assert torch.equal(scale.cpu().transpose(1, 2).reshape(n, heads)[slots], want_s)


def test_quantize_rows_int8_round_trip_and_range():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 128, generator=gen) * torch.logspace(-4, 3, 64)[:, None]
    q, scale = quantize_rows(x, INT8)
    assert q.dtype == INT8 and q.abs().amax(-1).eq(127).all(), "rows use the range"
    err = (dequantize(q, scale) - x).abs()
    assert (err <= scale[:, None] * 0.5 * (1 + 1e-6)).all()  # half a step of the row's grid


@pytest.mark.parametrize("fn", [store_kv, store_kv_ref], ids=["triton", "ref"])
def test_store_kv_int8_rounds_ties_to_even(fn):
    """A row whose largest value is 127 has scale 1: its halves are ties, stored as the even
    neighbour (as ``torch.round``)."""
    row = torch.tensor([127.0, 2.5, -3.5, 0.5, -0.5, 1.5, 126.5, -1.49])
    k = row.view(1, 1, 8)
    k_cache, v_cache = (blank((1, 1, 2, 8), INT8) for _ in range(2))
    scales = tuple(torch.full((1, 1, 2), NAN) for _ in range(2))
    fn(k, k.clone(), k_cache, v_cache, torch.tensor([1]), scales=scales)
    assert k_cache[0, 0, 1].tolist() == [127, 2, -4, 0, 0, 2, 126, -1]
    assert scales[0][0, 0, 1].item() == 1.0 and is_blank(k_cache[0, 0, 0]).all()


@KV_DTYPES
@pytest.mark.parametrize("block", [16, 32])  # (32: a dense 8-bit pool's default)
@pytest.mark.parametrize("v_layout", [True, False], ids=["v-layout", "v-rows"])
@pytest.mark.parametrize("fn", [store_kv, store_kv_ref], ids=["triton", "ref"])
def test_store_kv_8_bit_writes_quantised_rows_and_scales(fn, v_layout, block, kv):
    """Rows quantised with their scales, V in the V layout (a dense pool's) or in token order as
    K (``v_layout=False``: the tiered store's); nothing else written."""
    gen = torch.Generator().manual_seed(1)
    n, heads, dim, blocks = 7, 2, 32, 3
    mags = torch.logspace(-3, 2, n * heads).view(n, heads, 1)
    k, v = (torch.randn(n, heads, dim, generator=gen) * mags for _ in range(2))
    slots = torch.tensor([0, 17, -1, 5, 47, 18, 33])
    k_cache = blank((blocks, heads, block, dim), kv)
    v_cache = k_cache.clone()
    scales = tuple(torch.full((blocks, heads, block), NAN) for _ in range(2))
    fn(k, v, k_cache, v_cache, slots, scales=scales, v_layout=v_layout)
    keep = slots >= 0
    b, o = slots[keep] // block, slots[keep] % block
    for x, cache, scale in ((k, k_cache, scales[0]),
                            (v, v_rows(v_cache) if v_layout else v_cache, scales[1])):
        want_q, want_s = quantize_rows(x[keep], kv, search=True)
        assert torch.equal(bits(cache[b, :, o]), bits(want_q))
        assert torch.equal(scale[b, :, o], want_s)
        written = torch.zeros(blocks * block, dtype=torch.bool)
        written[slots[keep]] = True
        assert is_blank(cache.transpose(1, 2).reshape(-1, heads, dim)[~written]).all()
        assert scale.transpose(1, 2).reshape(-1, heads)[~written].isnan().all()


@pytest.mark.parametrize("kv", [FP8, INT8, torch.bfloat16], ids=["fp8", "int8", "bf16"])
@pytest.mark.parametrize("fn", [store_kv, store_kv_ref], ids=["triton", "ref"])
def test_store_kv_copies_rows_to_their_open_blocks_in_the_same_launch(fn, kv):
    """With ``open_block`` the cache gets the same bytes as without, and each row with an open
    slot >= 0 also lands, unquantised, in that slot (a row with no cache slot too); nothing else
    of the open blocks changes."""
    gen = torch.Generator().manual_seed(4)
    n, heads, dim, blocks, block, open_slots = 6, 2, 32, 3, 16, 4
    k, v = ((torch.randn(n, heads, dim, generator=gen) * 5).bfloat16() for _ in range(2))
    slots = torch.tensor([0, 17, -1, 5, 47, 18])
    rows = torch.tensor([3, -1, 18, 33, 63, 0])  # (slot * block + offset, -1: none)
    quant = kv in (FP8, INT8)
    caches = [[blank((blocks, heads, block, dim), kv) if quant else
               torch.full((blocks, heads, block, dim), NAN, dtype=kv) for _ in range(2)]
              for _ in range(2)]
    scales = [tuple(torch.full((blocks, heads, block), NAN) for _ in range(2)) if quant else None
              for _ in range(2)]
    open_k, open_v = (torch.full((open_slots, heads, block, dim), NAN, dtype=torch.bfloat16)
                      for _ in range(2))
    fn(k, v, *caches[0], slots, scales=scales[0], open_block=(open_k, open_v, rows))
    fn(k, v, *caches[1], slots, scales=scales[1])
    for got, want in zip(caches[0] + list(scales[0] or ()), caches[1] + list(scales[1] or ())):
        torch.testing.assert_close(bits(got), bits(want), rtol=0, atol=0, equal_nan=True)
    keep = rows >= 0
    for x, opened in ((k, open_k), (v, open_v)):
        flat = opened.transpose(1, 2).reshape(-1, heads, dim)
        assert torch.equal(flat[rows[keep]], x[keep])
        written = torch.zeros(open_slots * block, dtype=torch.bool)
        written[rows[keep]] = True
        assert flat[~written].isnan().all()


@pytest.mark.parametrize("kv", [FP8, INT8, torch.bfloat16], ids=["fp8", "int8", "bf16"])
@pytest.mark.parametrize("fn, device", [
    (store_kv, "cpu"), (store_kv_ref, "cpu"),
    pytest.param(store_kv, "cuda", marks=pytest.mark.gpu)], ids=["triton", "ref", "compiled"])
def test_store_kv_mirror_writes_the_same_rows_into_a_second_cache(fn, device, kv, request):
    """``mirror``: one launch leaves the cache and the mirror (strided views of other shapes: a
    host-store layer, local blocks) bit for bit as two stores of the reference would, values and
    scales, V in token order; a row stored in one of them only (a negative slot in the other)
    too."""
    if device == "cuda":
        request.getfixturevalue("cuda_device")
    gen = torch.Generator().manual_seed(6)
    n, heads, dim, block = 6, 2, 32, 16
    k, v = ((torch.randn(n, heads, dim, generator=gen) * 3).bfloat16() for _ in range(2))
    slots = torch.tensor([0, 17, -1, 5, 47, 18])
    local = torch.tensor([3, -1, 20, 33, 1, 46])
    quant = kv != torch.bfloat16

    def caches(blocks, on="cpu"):  # layer 1 of [blocks, 2 layers, heads, block, dim], unwritten
        def one():
            shape = (blocks, 2, heads, block, dim)
            return (blank(shape, kv, on) if quant
                    else torch.full(shape, NAN, dtype=kv, device=on))[:, 1]
        scales = (tuple(torch.full((blocks, 2, heads, block), NAN, device=on)[:, 1]
                        for _ in range(2)) if quant else None)
        return one(), one(), scales

    (host_k, host_v, host_s), (local_k, local_v, local_s) = caches(4, device), caches(3, device)
    fn(k.to(device), v.to(device), host_k, host_v, slots.to(device), scales=host_s,
       v_layout=False, mirror=(local_k, local_v, local.to(device), local_s))
    for got_k, got_v, got_s, at in ((host_k, host_v, host_s, slots),
                                    (local_k, local_v, local_s, local)):
        want_k, want_v, want_s = caches(got_k.shape[0])
        store_kv_ref(k, v, want_k, want_v, at, scales=want_s, v_layout=False)
        for got, want in zip((got_k, got_v, *(got_s or ())), (want_k, want_v, *(want_s or ()))):
            torch.testing.assert_close(bits(got).cpu(), bits(want), rtol=0, atol=0,
                                       equal_nan=True)


@pytest.mark.parametrize("lens,group", [([5, 40, 0, 17], 2), ([64, 33], 4)])
@pytest.mark.parametrize("block", [16, 32])  # (32: a dense 8-bit pool's default)
@KV_DTYPES
def test_paged_decode_8_bit_equals_reference_and_dequantized_dense(lens, group, block, kv):
    q, k_cache, v_cache, tables, ctx = _case(lens, num_kv_heads=2, group=group, head_dim=32,
                                             block_size=block, dtype=torch.float32, seed=3)
    (kq, ks), (vq, vs) = quantized(k_cache, kv), quantized_v(v_cache, kv)
    scale = 1 / math.sqrt(32)
    out = torch.full_like(q, NAN)
    got = paged_decode_attention(q, kq, vq, tables, ctx, scale, out=out, num_splits=2,
                                 scales=(ks, vs))
    ref = paged_decode_ref(q, kq, vq, tables, ctx, scale, scales=(ks, vs))
    dense = _dense(q, dequantize(kq, ks), dequantize(v_rows(vq), vs), tables, ctx, scale)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ref.double(), dense, rtol=1e-4, atol=1e-4)
    # and close to attention over the unquantised cache: FP8 moves outputs a few percent at most
    plain = paged_decode_ref(q, k_cache, v_cache, tables, ctx, scale)
    assert (got - plain).abs().max() < 0.1


@pytest.mark.parametrize("q_dtype,split", [
    (torch.float32, {}), (torch.bfloat16, {}), (torch.bfloat16, dict(num_splits=3)),
    (torch.bfloat16, dict(blocks_per_split=3)), (torch.bfloat16, dict(blocks_per_split=10))],
    ids=["fp32", "bf16", "bf16-3-splits", "bf16-3-blocks", "bf16-10-blocks"])
@KV_DTYPES
def test_paged_decode_8_bit_over_many_tiles(q_dtype, split, kv):
    """Contexts of several 128-token tiles: the tiles before a split's last are read unmasked and
    the last one masked (a partly written block, NaN past its end; splits of whole tiles, of fewer
    blocks than a tile, and of a tile and a part), equal to the reference."""
    q, k_cache, v_cache, tables, ctx = _case([300, 129, 0, 17, 256], num_kv_heads=2, group=2,
                                             head_dim=32, block_size=16, dtype=torch.float32,
                                             seed=21)
    (kq, ks), (vq, vs) = quantized(k_cache, kv), quantized_v(v_cache, kv)
    q = q.to(q_dtype)
    scale = 1 / math.sqrt(32)
    got = paged_decode_attention(q, kq, vq, tables, ctx, scale, out=torch.full_like(q, NAN),
                                 scales=(ks, vs), **split)
    ref = paged_decode_ref(q.float(), kq, vq, tables, ctx, scale, scales=(ks, vs))
    assert got.isfinite().all()
    if q_dtype == torch.float32:
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    else:
        _close_per_head(got, ref, 4e-3)


@KV_DTYPES
def test_paged_decode_8_bit_ending_on_a_tile_of_zero_value_rows(kv):
    """A 16-bit query over long rows of large values whose last tile holds only zero rows (their
    scales are ~1e-33): the fp16 P.V keeps its accumulator's unit within 2**-40 of the largest
    scale seen, so the sum does not overflow when the unit drops to that tile's."""
    q, k_cache, v_cache, tables, ctx = _case([2053, 2053], num_kv_heads=1, group=2, head_dim=32,
                                             block_size=16, dtype=torch.float32, seed=23)
    v_cache = v_cache + 1000  # (same sign: the sum grows with the tokens)
    for row in range(2):  # the last block holds tokens 2048..2052: zero value rows
        v_cache[tables[row, 128], :, :5] = 0
    (kq, ks), (vq, vs) = quantized(k_cache, kv), quantized_v(v_cache, kv)
    q = (q * 0.01).to(torch.bfloat16)  # flat attention: the sum is ~ tokens x 1000
    scale = 1 / math.sqrt(32)
    got = paged_decode_attention(q, kq, vq, tables, ctx, scale, num_splits=1, scales=(ks, vs))
    ref = paged_decode_ref(q.float(), kq, vq, tables, ctx, scale, scales=(ks, vs))
    assert got.isfinite().all()
    _close_per_head(got, ref, 4e-3)


def _open_case(lens, kv, q_dtype, device="cpu", heads=2, group=2, dim=32, seed=31, block=16):
    """A paged case over 8-bit rows whose rows' last blocks live in open blocks of q's dtype (each
    row's slot a random one, the pool's copy of those blocks blank, so reading it would give NaN)
    -> (q, 8-bit k, v, scales, tables, lens, OpenBlocks, the float keys and values attention must
    see)."""
    q, k_cache, v_cache, tables, ctx = _case(lens, num_kv_heads=heads, group=group, head_dim=dim,
                                             block_size=block, dtype=torch.float32, seed=seed)
    (kq, ks), (vq, vs) = quantized(k_cache, kv), quantized_v(v_cache, kv)
    seen_k, seen_v = dequantize(kq, ks), dequantize(v_rows(vq), vs)
    n = len(lens)
    slots = torch.randperm(n + 2, generator=torch.Generator().manual_seed(seed))[:n].int()
    open_k, open_v = (torch.full((n + 2, heads, block, dim), NAN, dtype=q_dtype)
                      for _ in range(2))
    for row, length in enumerate(lens):
        if length:
            last = tables[row, (length - 1) // block]
            open_k[slots[row]], open_v[slots[row]] = k_cache[last], v_cache[last]
            seen_k[last], seen_v[last] = k_cache[last].to(q_dtype), v_cache[last].to(q_dtype)
            kq[last], vq[last] = blank(kq[last].shape, kv), blank(vq[last].shape, kv)
            ks[last], vs[last] = NAN, NAN
    dev = lambda *xs: [x.to(device) for x in xs]  # noqa: E731
    return (*dev(q.to(q_dtype), kq, vq), tuple(dev(ks, vs)), *dev(tables, ctx),
            OpenBlocks(*dev(open_k, open_v, slots)), (seen_k, seen_v))


@pytest.mark.parametrize("q_dtype,split,block", [
    (torch.float32, dict(num_splits=2), 16), (torch.bfloat16, {}, 16),
    (torch.bfloat16, dict(blocks_per_split=3), 16), (torch.bfloat16, dict(num_splits=4), 16),
    (torch.float32, dict(num_splits=2), 32), (torch.bfloat16, dict(blocks_per_split=3), 32)],
    ids=["fp32", "bf16", "bf16-3-blocks", "bf16-4-splits", "fp32-b32", "bf16-3-blocks-b32"])
@KV_DTYPES
def test_paged_decode_8_bit_reads_each_rows_last_block_from_its_open_block(q_dtype, split, block,
                                                                           kv):
    """With ``open_block`` each row's last block (a partly written one, one block exactly, the last
    of several tiles) comes from its open block in q's dtype and never from the 8-bit pool (blank
    there): equal to the reference, and to float64 attention over the dequantized rows with those
    blocks exact."""
    lens = [300, 129, 0, 17, 256, 16, 32]
    q, kq, vq, scales, tables, ctx, opened, (seen_k, seen_v) = _open_case(lens, kv, q_dtype,
                                                                          block=block)
    scale = 1 / math.sqrt(32)
    got = paged_decode_attention(q, kq, vq, tables, ctx, scale, out=torch.full_like(q, NAN),
                                 scales=scales, open_block=opened, **split)
    ref = paged_decode_ref(q.float(), kq, vq, tables, ctx, scale, scales=scales,
                           open_block=opened)
    dense = _dense(q.float(), seen_k, seen_v, tables, ctx, scale)
    assert got.isfinite().all()
    assert (got[ctx == 0] == 0).all()
    if q_dtype == torch.float32:
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    else:
        _close_per_head(got, ref, 4e-3)
    torch.testing.assert_close(ref.double(), dense, rtol=1e-4, atol=1e-4)
    # without the open blocks the pool's blank copies are read
    assert paged_decode_ref(q.float(), kq, vq, tables, ctx, scale, scales=scales).isnan().any()


@pytest.mark.parametrize("with_draft", [False, True])
@KV_DTYPES
def test_sparse_decode_8_bit_equals_reference(with_draft, kv):
    q, ws_k, ws_v, ws_map, seq_slots, local_lens = _ws_case(
        ROWS, num_kv_heads=2, group=2, head_dim=32, dtype=torch.float32, seed=4)
    (kq, ks), (vq, vs) = quantized(ws_k, kv), quantized(ws_v, kv)  # (V in token order too)
    extra = {}
    if with_draft:
        gen = torch.Generator().manual_seed(5)
        n = len(ROWS)
        draft_rows = torch.tensor([n, -1, n + 1, -1, n + 2, -1], dtype=torch.int32)
        q = torch.cat([q, torch.randn(3, q.shape[1], 32, generator=gen)])
        extra = dict(draft_rows=draft_rows, extra_k=torch.randn(n + 3, 2, 32, generator=gen),
                     extra_v=torch.randn(n + 3, 2, 32, generator=gen))
    scale = 1 / math.sqrt(32)
    out = torch.full_like(q, NAN)
    got = sparse_decode_attention(q, kq, vq, ws_map, seq_slots, local_lens, scale, out=out,
                                  num_splits=2, scales=(ks, vs), **extra)
    ref = sparse_decode_ref(q, kq, vq, ws_map, seq_slots, local_lens, scale, scales=(ks, vs),
                            **extra)
    dense = _dense_sparse(q, dequantize(kq, ks), dequantize(vq, vs), ws_map, seq_slots,
                          local_lens, scale, **extra)
    assert got.isfinite().all()
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ref.double(), dense, rtol=1e-4, atol=1e-4)


def _sparse_open_case(kv, q_dtype, device="cpu", heads=2, group=2, dim=32, num_slots=5, seed=41):
    """A working-set case (``ROWS``) over 8-bit slots whose local blocks live in open blocks of q's
    dtype (each sequence's a random one; slot W-1 of the 8-bit set blank, so reading it gives NaN),
    with a draft row for rows 0 and 4 -> (q, 8-bit k, v, scales, ws_map, seq_slots, local_lens,
    OpenBlocks, draft kwargs, the float working sets attention must see)."""
    q, ws_k, ws_v, ws_map, seq_slots, local_lens = _ws_case(
        ROWS, num_kv_heads=heads, group=group, head_dim=dim, dtype=torch.float32,
        num_slots=num_slots, seed=seed)
    (kq, ks), (vq, vs) = quantized(ws_k, kv), quantized(ws_v, kv)
    seen_k, seen_v = dequantize(kq, ks), dequantize(vq, vs)
    seqs = ws_k.shape[0]
    gen = torch.Generator().manual_seed(seed)
    of_seq = torch.randperm(seqs + 2, generator=gen)[:seqs].int()
    open_k, open_v = (torch.full((seqs + 2, heads, 16, dim), NAN, dtype=q_dtype) for _ in range(2))
    local_k, local_v = ws_k[:, :, -1].to(q_dtype), ws_v[:, :, -1].to(q_dtype)
    open_k[of_seq.long()], open_v[of_seq.long()] = local_k, local_v
    seen_k[:, :, -1], seen_v[:, :, -1] = local_k, local_v
    kq[:, :, -1], vq[:, :, -1] = blank(kq[:, :, -1].shape, kv), blank(vq[:, :, -1].shape, kv)
    ks[:, :, -1], vs[:, :, -1] = NAN, NAN
    n = len(ROWS)
    slots = of_seq[seq_slots.clamp(min=0).long()]
    q = torch.cat([q, torch.randn(2, q.shape[1], dim, generator=gen)])
    draft = dict(draft_rows=torch.tensor([n, -1, -1, -1, n + 1, -1], dtype=torch.int32),
                 extra_k=torch.randn(n + 2, heads, dim, generator=gen).to(q_dtype),
                 extra_v=torch.randn(n + 2, heads, dim, generator=gen).to(q_dtype))
    dev = lambda *xs: [x.to(device) for x in xs]  # noqa: E731
    return (*dev(q.to(q_dtype), kq, vq), tuple(dev(ks, vs)), *dev(ws_map, seq_slots, local_lens),
            OpenBlocks(*dev(open_k, open_v, slots)),
            {k: x.to(device) for k, x in draft.items()}, (seen_k, seen_v))


@pytest.mark.parametrize("with_draft", [False, True])
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
@KV_DTYPES
def test_sparse_decode_8_bit_reads_each_rows_local_block_from_its_open_block(with_draft, q_dtype,
                                                                             kv):
    """With ``open_block`` each row's local tokens come from its sequence's open block in q's dtype
    and never from slot W-1 of the 8-bit working set (blank there): equal to the reference, and
    to float64 attention over the dequantized slots with the local blocks exact."""
    q, kq, vq, scales, ws_map, seq_slots, local_lens, opened, draft, (seen_k, seen_v) = \
        _sparse_open_case(kv, q_dtype)
    if not with_draft:
        q, draft = q[:len(ROWS)], {}
    scale = 1 / math.sqrt(32)
    got = sparse_decode_attention(q, kq, vq, ws_map, seq_slots, local_lens, scale, num_splits=2,
                                  out=torch.full_like(q, NAN), scales=scales, open_block=opened,
                                  **draft)
    fdraft = {k: x.float() if x.is_floating_point() else x for k, x in draft.items()}
    ref = sparse_decode_ref(q.float(), kq, vq, ws_map, seq_slots, local_lens, scale,
                            scales=scales, open_block=opened, **fdraft)
    dense = _dense_sparse(q.float(), seen_k, seen_v, ws_map, seq_slots, local_lens, scale,
                          **fdraft)
    assert got.isfinite().all()
    if q_dtype == torch.float32:
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    else:
        _close_per_head(got, ref, 4e-3)
    torch.testing.assert_close(ref.double(), dense, rtol=1e-4, atol=1e-4)
    # without the open blocks the set's blank local slots are read
    assert sparse_decode_ref(q.float(), kq, vq, ws_map, seq_slots, local_lens, scale,
                             scales=scales, **fdraft).isnan().any()


@pytest.mark.parametrize("q_dtype,q_gain,v_spread", [
    (torch.bfloat16, 1.0, 0), (torch.float16, 1.0, 0), (torch.bfloat16, 3e5, 0),
    (torch.bfloat16, 1.0, 4)])
@KV_DTYPES
def test_decode_kernels_with_16_bit_queries_run_16_bit_dots_close_to_the_reference(
        q_dtype, q_gain, v_spread, kv):
    """A 16-bit q over FP8 rows takes the 16-bit dots (``fp16_dot``): Q.K exact, the softmax
    weights times each value row's scale over the tile's largest rounded to fp16 for P.V (11
    significant bits), so outputs stay within 16-bit rounding of the float32 reference, for the
    paged and the sparse kernel (with a draft row). A query beyond fp16's range (``q_gain``) is
    shifted by a power of two first; value rows whose magnitudes spread over ``10**±v_spread``
    (within and across tiles) keep that."""
    q, k_cache, v_cache, tables, ctx = _case([70, 33, 0, 16], num_kv_heads=2, group=4,
                                             head_dim=32, block_size=16, dtype=torch.float32,
                                             seed=11)
    gen = torch.Generator().manual_seed(14)
    v_cache = v_cache * 10 ** (v_spread * (2 * torch.rand(v_cache.shape[:-1] + (1,),
                                                            generator=gen) - 1))
    (kq, ks), (vq, vs) = quantized(k_cache, kv), quantized_v(v_cache, kv)
    q = (q * q_gain).to(q_dtype)
    scale = 1 / math.sqrt(32) / q_gain
    got = paged_decode_attention(q, kq, vq, tables, ctx, scale, num_splits=2, scales=(ks, vs))
    ref = paged_decode_ref(q.float(), kq, vq, tables, ctx, scale, scales=(ks, vs))
    tol = 4e-3  # fp16 weights (2**-11 relative) and the output stored in q's dtype (bf16: 2**-9)
    _close_per_head(got, ref, tol)
    cq, ws_k, ws_v, ws_map, seq_slots, local_lens = _ws_case(
        ROWS, num_kv_heads=2, group=2, head_dim=32, dtype=torch.float32, seed=12)
    ws_v = ws_v * 10 ** (v_spread * (2 * torch.rand(ws_v.shape[:-1] + (1,), generator=gen) - 1))
    (wk, wks), (wv, wvs) = quantized(ws_k, kv), quantized(ws_v, kv)
    n = len(ROWS)
    gen = torch.Generator().manual_seed(13)
    cq = (torch.cat([cq, torch.randn(1, cq.shape[1], 32, generator=gen)]) * q_gain).to(q_dtype)
    draft = dict(draft_rows=torch.tensor([-1, n, -1, -1, -1, -1], dtype=torch.int32),
                 extra_k=torch.randn(n + 1, 2, 32, generator=gen).to(q_dtype),
                 extra_v=torch.randn(n + 1, 2, 32, generator=gen).to(q_dtype))
    got = sparse_decode_attention(cq, wk, wv, ws_map, seq_slots, local_lens, scale, num_splits=2,
                                  scales=(wks, wvs), **draft)
    ref = sparse_decode_ref(cq.float(), wk, wv, ws_map, seq_slots, local_lens, scale,
                            scales=(wks, wvs), **{k: v.float() if v.is_floating_point() else v
                                                  for k, v in draft.items()})
    assert got.isfinite().all()
    _close_per_head(got, ref, tol)


def _close_per_head(got: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    """``got`` (stored in a 16-bit dtype) equals ``ref`` ``[rows, heads, D]`` within ``tol`` of each
    head's largest output (at least 1): rounding is relative to the values that were summed."""
    size = ref.abs().amax(-1, keepdim=True).clamp(min=1)
    torch.testing.assert_close(got.float() / size, ref / size, rtol=tol, atol=tol)


@pytest.mark.parametrize("fn", [gather_blocks, gather_blocks_ref], ids=["triton", "ref"])
@KV_DTYPES
def test_gather_blocks_moves_8_bit_slices_with_their_scales(fn, kv):
    host_k, host_v, ws_k, ws_v, src_block, src_head, dst_slot = _host_case(dtype=torch.float32,
                                                                           seed=6)
    (hk, hks), (hv, hvs) = quantized(host_k, kv), quantized(host_v, kv)
    wk, wv = ws_k.to(kv), ws_v.to(kv)
    wks, wvs = (torch.full(ws_k.shape[:-1], NAN) for _ in range(2))
    want = [x.clone() for x in (wk, wv, wks, wvs)]
    gather_blocks_ref(hk, hv, 1, want[0], want[1], src_block, src_head, dst_slot,
                      scales=(hks, hvs, want[2], want[3]))
    fn(hk, hv, 1, wk, wv, src_block, src_head, dst_slot, num_programs=2, items_per_iter=4,
       scales=(hks, hvs, wks, wvs))
    for got, exp in zip((wk, wv, wks, wvs), want):  # values bit for bit, scales NaN where unwritten
        torch.testing.assert_close(bits(got), bits(exp), rtol=0, atol=0, equal_nan=True)
    moved = int((src_block >= 0).sum())
    assert moved > 0 and int((~wks.isnan()).sum()) == moved * 16


@pytest.mark.parametrize("fn", [block_minmax, block_minmax_ref], ids=["triton", "ref"])
@KV_DTYPES
def test_block_minmax_of_8_bit_rows_is_of_the_dequantized_keys(fn, kv):
    host_k, _, _, _, _, _, _ = _host_case(dtype=torch.float32, seed=7)
    host_k[torch.isnan(host_k)] = 3.0
    kq, ks = quantized(host_k, kv)
    src, src_scale = kq[:, 1], ks[:, 1]
    idx0 = torch.tensor([3, 0, 11, 7], dtype=torch.int32)
    idx1 = torch.tensor([1, 0, 1, 0], dtype=torch.int64)
    dst_block = torch.tensor([3, 0, -1, 7], dtype=torch.int32)
    summaries = torch.full((12, 2, 2, 32), NAN)
    fn(src, idx0, idx1, summaries, dst_block, idx1, src_scale=src_scale)
    deq = dequantize(src, src_scale)
    for a, b, d in zip(idx0.tolist(), idx1.tolist(), dst_block.tolist()):
        if d >= 0:
            assert torch.equal(summaries[d, b, 0], deq[a, b].amax(0))
            assert torch.equal(summaries[d, b, 1], deq[a, b].amin(0))
    assert int((~summaries.isnan()).sum()) == 3 * 2 * 32



def test_fp8_summaries_store_each_row_as_quantize_rows_does():
    """FP8 summaries (``summary_scale``): the kernel writes the max and min rows bit for bit as the
    reference, which is ``quantize_rows`` of the float summary; unwritten rows stay as they were."""
    host_k, _, _, _, _, _, _ = _host_case(dtype=torch.float32, seed=8)
    host_k[torch.isnan(host_k)] = -2.0
    host_k[5] *= 1e-3  # a block of small keys: its scale follows it
    src = host_k[:, 1]
    idx0 = torch.tensor([3, 0, 11, 5, 7], dtype=torch.int32)
    idx1 = torch.tensor([1, 0, 1, 1, 0], dtype=torch.int64)
    dst_block = torch.tensor([3, 0, -1, 5, 9], dtype=torch.int32)
    outs = []
    for fn in (block_minmax, block_minmax_ref):
        summaries = torch.zeros((12, 2, 2, 32), dtype=torch.uint8).view(FP8)
        scale = torch.full((12, 2, 2), NAN)
        fn(src, idx0, idx1, summaries, dst_block, idx1, summary_scale=scale)
        outs.append((summaries, scale))
    (got, got_scale), (want, want_scale) = outs
    assert torch.equal(bits(got), bits(want))
    torch.testing.assert_close(got_scale, want_scale, rtol=0, atol=0, equal_nan=True)
    for a, b, d in zip(idx0.tolist(), idx1.tolist(), dst_block.tolist()):
        if d >= 0:
            exact = torch.stack([src[a, b].amax(0), src[a, b].amin(0)])
            values, scale = quantize_rows(exact)
            assert torch.equal(bits(got[d, b]), bits(values))
            assert torch.equal(got_scale[d, b], scale)
            # e4m3 keeps 3 mantissa bits: within 1/16 of the row's largest value
            assert (dequantize(got[d, b], got_scale[d, b]) - exact).abs().max() <= (
                exact.abs().amax(-1, keepdim=True) / 16).max()
    assert int((~got_scale.isnan()).sum()) == 4 * 2


@pytest.mark.parametrize("group,config", [(2, {}), (4, dict(block_b=8, tiles=3, num_stages=2))])
def test_block_scores_of_fp8_summaries(group, config):
    """Scores from FP8 summaries and their row scales equal the reference's and the float64 scores
    of the dequantized summaries (NaN summaries no row uses: never read)."""
    q, _, summaries, tables, num_blocks = _scores_case(NUM_BLOCKS, num_kv_heads=2, group=group,
                                                       head_dim=32, seed=6)
    poisoned = summaries.isnan().any(-1).any(-1).any(-1)
    values, scale = quantize_rows(torch.where(summaries.isnan(), 0.0, summaries))
    scale[poisoned] = NAN
    out = torch.full((4, 2, tables.shape[1]), NAN)
    got = block_scores(q, values, tables, num_blocks, 0.5, out=out, summary_scale=scale,
                       **config)
    ref = block_scores_ref(q, values, tables, num_blocks, 0.5, summary_scale=scale)
    want = _scores_float64(q, dequantize(values, scale), tables, num_blocks, 0.5)
    assert got is out
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ref.double(), want, rtol=1e-5, atol=1e-5)


def cpu(*xs):
    return [None if x is None else tuple(cpu(*x)) if isinstance(x, tuple) else x.cpu() for x in xs]


@pytest.mark.gpu
@KV_DTYPES
def test_8_bit_kernels_compiled_at_a_real_shape_equal_their_references(cuda_device, kv):
    """Qwen3-8B-like heads (Hk 8, G 4, D 128, B 16), bf16 queries: the compiled store (with open
    blocks), paged and sparse decode, UVA gather from pinned memory and summaries on FP8 rows vs
    the references (run on CPU copies)."""
    torch.manual_seed(0)
    dev, heads, group, dim, block = cuda_device, 8, 4, 128, 16
    # store_kv: quantise 200 tokens into a pool of 32 blocks
    k, v = (torch.randn(200, heads, dim, device=dev, dtype=torch.bfloat16) * 3 for _ in range(2))
    slots = torch.randperm(32 * block, device=dev)[:200]
    kc, vc = (blank((32, heads, block, dim), kv, dev) for _ in range(2))
    sc = tuple(torch.full((32, heads, block), NAN, device=dev) for _ in range(2))
    kr, vr, sr = cpu(kc.clone(), vc.clone(), tuple(x.clone() for x in sc))
    # (with each row's copy into an open block, as decode stores them: every 3rd row has none)
    ok, ov = (torch.full((200, heads, block, dim), NAN, device=dev, dtype=torch.bfloat16)
              for _ in range(2))
    rows = torch.arange(200, device=dev) * block + torch.arange(200, device=dev) % block
    rows[::3] = -1
    okr, ovr = cpu(ok.clone(), ov.clone())
    store_kv(k, v, kc, vc, slots, scales=sc, open_block=(ok, ov, rows))
    store_kv_ref(*cpu(k, v), kr, vr, slots.cpu(), scales=sr, open_block=(okr, ovr, rows.cpu()))
    assert torch.equal(bits(kc).cpu(), bits(kr)) and torch.equal(bits(vc).cpu(), bits(vr))
    torch.testing.assert_close(cpu(*sc), list(sr), rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(cpu(ok, ov), [okr, ovr], rtol=0, atol=0, equal_nan=True)
    # paged decode over the quantised pool (rows never written made readable: zeros)
    for cache in (kc, vc):
        bits(cache)[is_blank(cache)] = 0
    sc = tuple(torch.nan_to_num(s) for s in sc)
    lens = torch.tensor([150, 37, 200, 1], dtype=torch.int32, device=dev)
    tables = (slots // block).unique()[None].expand(4, -1).to(torch.int32).contiguous()
    q = torch.randn(4, heads * group, dim, device=dev, dtype=torch.bfloat16)
    got = paged_decode_attention(q, kc, vc, tables, lens, dim ** -0.5, scales=sc)
    ref = paged_decode_ref(*cpu(q, kc, vc, tables, lens), dim ** -0.5, scales=cpu(*sc))
    torch.testing.assert_close(got.float().cpu(), ref.float(), rtol=2e-2, atol=2e-2)
    # sparse decode over an FP8 working set
    cq, ws_k, ws_v, ws_map, seq_slots, local_lens = _ws_case(
        ROWS, num_kv_heads=heads, group=group, head_dim=dim, dtype=torch.float32, num_slots=9,
        seed=8, device=dev)
    (wk, wks), (wv, wvs) = quantized(ws_k.cpu(), kv), quantized(ws_v.cpu(), kv)
    got = sparse_decode_attention(cq.bfloat16(), wk.to(dev), wv.to(dev), ws_map, seq_slots,
                                  local_lens, dim ** -0.5, scales=(wks.to(dev), wvs.to(dev)))
    ref = sparse_decode_ref(*cpu(cq.bfloat16()), wk, wv, *cpu(ws_map, seq_slots, local_lens),
                            dim ** -0.5, scales=(wks, wvs))
    assert got.isfinite().all()
    torch.testing.assert_close(got.float().cpu(), ref.float(), rtol=2e-2, atol=2e-2)
    # gather from a pinned FP8 host store, then summaries of what is stored there
    host_k, host_v, ws_k, ws_v, src_block, src_head, dst_slot = _host_case(
        num_kv_heads=heads, head_dim=dim, dtype=torch.float32, m=64, num_host_blocks=40,
        num_slots=9, device=dev, seed=9)
    (hk, hks), (hv, hvs) = quantized(host_k, kv), quantized(host_v, kv)
    hk, hv, hks, hvs = (x.pin_memory() for x in (hk, hv, hks, hvs))
    wk, wv = ws_k.to(kv), ws_v.to(kv)
    wks, wvs = (torch.full(ws_k.shape[:-1], NAN, device=dev) for _ in range(2))
    want = cpu(wk.clone(), wv.clone(), wks.clone(), wvs.clone())
    gather_blocks(hk, hv, 1, wk, wv, src_block, src_head, dst_slot, num_programs=8,
                  items_per_iter=4, scales=(hks, hvs, wks, wvs))
    gather_blocks_ref(hk, hv, 1, *want[:2], *cpu(src_block, src_head, dst_slot),
                      scales=(hks, hvs, *want[2:]))
    for got, exp in zip((wk, wv, wks, wvs), want):
        torch.testing.assert_close(bits(got).cpu(), bits(exp), rtol=0, atol=0, equal_nan=True)
    table = torch.full((40, heads, 2, dim), NAN, device=dev, dtype=torch.bfloat16)
    want = table.cpu()
    blocks = src_block.clamp(min=0)
    block_minmax(hk[:, 1], blocks, src_head, table, src_block, src_head, src_scale=hks[:, 1])
    block_minmax_ref(hk[:, 1], *cpu(blocks, src_head), want, *cpu(src_block, src_head),
                     src_scale=hks[:, 1])
    torch.testing.assert_close(table.cpu(), want, rtol=0, atol=0, equal_nan=True)


@pytest.mark.gpu
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float32])
@KV_DTYPES
def test_decode_with_open_blocks_compiled_at_a_real_shape(cuda_device, kv, q_dtype):
    """Qwen3-8B-like heads (Hk 8, G 4, D 128, B 16): the compiled paged kernel reads each row's
    last block from its open block (the pool's copy is blank), the sparse one each row's local
    block (slot W-1 blank), equal to the references on CPU copies."""
    lens = [3000, 1000, 17, 0, 16, 2048, 129]
    q, kq, vq, scales, tables, ctx, opened, _ = _open_case(lens, kv, q_dtype, cuda_device,
                                                          heads=8, group=4, dim=128)
    scale = 128 ** -0.5
    got = paged_decode_attention(q, kq, vq, tables, ctx, scale, scales=scales, open_block=opened)
    ref = paged_decode_ref(*cpu(q.float(), kq, vq, tables, ctx), scale, scales=cpu(*scales),
                           open_block=OpenBlocks(*cpu(opened.k, opened.v, opened.slots)))
    assert got.isfinite().all()
    tol = 4e-3 if q_dtype == torch.bfloat16 else 1e-4
    _close_per_head(got.float().cpu(), ref, tol)
    # sparse decode: each row's local block from its open block (slot W-1 blank), with drafts
    q, kq, vq, scales, ws_map, seq_slots, local_lens, opened, draft, _ = _sparse_open_case(
        kv, q_dtype, cuda_device, heads=8, group=4, dim=128, num_slots=9)
    got = sparse_decode_attention(q, kq, vq, ws_map, seq_slots, local_lens, scale, scales=scales,
                                  open_block=opened, **draft)
    ref = sparse_decode_ref(*cpu(q.float(), kq, vq, ws_map, seq_slots, local_lens), scale,
                            scales=cpu(*scales),
                            open_block=OpenBlocks(*cpu(opened.k, opened.v, opened.slots)),
                            **{k: x.cpu().float() if x.is_floating_point() else x.cpu()
                               for k, x in draft.items()})
    assert got.isfinite().all()
    _close_per_head(got.float().cpu(), ref, tol)


@pytest.mark.gpu
def test_fp8_summaries_compiled_at_a_real_shape_equal_their_references(cuda_device):
    """Qwen3-8B-like heads (Hk 8, G 4, D 128, B 16): compiled ``block_minmax`` writes FP8
    summaries bit for bit as its reference, and ``block_scores`` over them (128 rows x 300 blocks)
    equals the reference's scores."""
    torch.manual_seed(1)
    dev, heads, dim = cuda_device, 8, 128
    keys = torch.randn(512, heads, 16, dim, device=dev, dtype=torch.bfloat16) * 2
    idx0 = torch.arange(512, device=dev).repeat_interleave(heads)
    idx1 = torch.arange(heads, device=dev).repeat(512)
    got, want = [(torch.zeros((512, heads, 2, dim), dtype=torch.uint8, device=dev).view(FP8),
                  torch.full((512, heads, 2), NAN, device=dev)) for _ in range(2)]
    block_minmax(keys, idx0, idx1, got[0], idx0, idx1, summary_scale=got[1])
    block_minmax_ref(keys, idx0, idx1, want[0], idx0, idx1, summary_scale=want[1])
    assert torch.equal(bits(got[0]), bits(want[0])) and torch.equal(got[1], want[1])
    q = torch.randn(128, heads * 4, dim, device=dev, dtype=torch.bfloat16)
    tables = torch.randint(0, 512, (128, 300), device=dev, dtype=torch.int32)
    num_blocks = torch.randint(0, 301, (128,), device=dev, dtype=torch.int32)
    scores = block_scores(q, got[0], tables, num_blocks, 1.0, summary_scale=got[1])
    ref = block_scores_ref(q, got[0], tables, num_blocks, 1.0, summary_scale=got[1])
    torch.testing.assert_close(scores, ref, rtol=1e-4, atol=1e-3)
