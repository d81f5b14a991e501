"""Kernels of the sparse (tiered-KV) decode path vs their torch references vs independent float64 /
loop computations: sparse_decode_attention, block_scores (+ topk_blocks), gather_blocks,
block_minmax.

Inputs are random and non-zero; every place a correct kernel must not read is NaN (empty working-set
slots, the local slot past its length, sequence slots no row uses, host blocks not selected,
summaries past a row's num_blocks) and outputs are pre-filled with NaN. CPU runs use the Triton
interpreter and tiny shapes; ``-m gpu`` runs realistic Qwen3-8B shapes, CUDA-graph replays and
pinned-memory reads.
"""
import math

import pytest
import torch

from oasiskv.kernels import uva_gather
from oasiskv.kernels.block_scores import block_scores, topk_blocks
from oasiskv.kernels.reference import (block_minmax_ref, block_scores_ref, gather_blocks_ref,
                                       sparse_decode_ref)
from oasiskv.kernels.sparse_decode import sparse_decode_attention
from oasiskv.kernels.summaries import block_minmax
from oasiskv.kernels.uva_gather import gather_blocks
from tests.helpers import capture_graph

NAN = float("nan")


# ---------------------------------------------------------------- sparse_decode_attention


def _ws_case(rows, num_kv_heads, group, head_dim, dtype, num_seqs=4, num_slots=5, block_size=16,
             seed=0, device="cpu"):
    """Working set ``[S, Hk, W, B, D]`` with random ws_map (about a third of the slots empty, NaN),
    NaN local-slot tails past the longest local length of the sequence's rows, NaN sequence slots no
    row uses. ``rows``: list of (seq_slot, local_len). Sequence slot 1 holds no block at all.
    Returns (q, ws_k, ws_v, ws_map, seq_slots, local_lens)."""
    gen = torch.Generator().manual_seed(seed)
    shape = (num_seqs, num_kv_heads, num_slots, block_size, head_dim)
    ws_k = torch.randn(shape, generator=gen)
    ws_v = torch.randn(shape, generator=gen)
    ws_map = torch.randint(0, 100, shape[:3], generator=gen, dtype=torch.int32)
    ws_map[torch.rand(shape[:3], generator=gen) < 0.35] = -1
    ws_map[1] = -1
    empty = ws_map < 0
    empty[..., -1] = False  # the local slot ignores ws_map; its entry stays random garbage
    ws_k[empty] = NAN
    ws_v[empty] = NAN
    for s in range(num_seqs):
        lens = [n for seq, n in rows if seq == s]
        fill = max(lens) if lens else 0
        ws_k[s, :, -1, fill:] = NAN
        ws_v[s, :, -1, fill:] = NAN
        if not lens:
            ws_k[s] = NAN
            ws_v[s] = NAN
    q = torch.randn(len(rows), num_kv_heads * group, head_dim, generator=gen)
    seq_slots = torch.tensor([s for s, _ in rows], dtype=torch.int32)
    local_lens = torch.tensor([n for _, n in rows], dtype=torch.int32)
    return [t.to(device) for t in (q.to(dtype), ws_k.to(dtype), ws_v.to(dtype), ws_map, seq_slots,
                                   local_lens)]


def _dense_sparse(q, ws_k, ws_v, ws_map, seq_slots, local_lens, scale, draft_rows=None,
                  extra_k=None, extra_v=None):
    """Independent float64 attention: collect each (row, kv head)'s valid tokens one by one; a draft
    row (``draft_rows``) gets its row's tokens plus its own extra key/value."""
    q, ws_k, ws_v, ws_map = q.cpu().double(), ws_k.cpu().double(), ws_v.cpu().double(), ws_map.cpu()
    num_rows, num_q_heads, head_dim = q.shape
    _, num_kv_heads, num_slots, block_size, _ = ws_k.shape
    group = num_q_heads // num_kv_heads
    out = torch.zeros(num_rows, num_q_heads, head_dim, dtype=torch.float64)
    drafts = draft_rows.tolist() if draft_rows is not None else [-1] * len(seq_slots)
    for row, (s, local, draft) in enumerate(zip(seq_slots.tolist(), local_lens.tolist(), drafts)):
        if s < 0:
            continue
        for h in range(num_kv_heads):
            toks = [(j, t) for j in range(num_slots - 1) if ws_map[s, h, j] >= 0
                    for t in range(block_size)]
            toks += [(num_slots - 1, t) for t in range(local)]
            keys = [ws_k[s, h, j, t] for j, t in toks]
            values = [ws_v[s, h, j, t] for j, t in toks]
            targets = [(row, keys, values)]
            if draft >= 0:
                targets.append((draft, keys + [extra_k[draft, h].cpu().double()],
                                values + [extra_v[draft, h].cpu().double()]))
            for target, ks, vs in targets:
                if not ks:
                    continue
                k, v = torch.stack(ks), torch.stack(vs)
                for g in range(group):
                    p = torch.softmax(k @ q[target, h * group + g] * scale, dim=0)
                    out[target, h * group + g] = p @ v
    return out


# (seq slot, local len): two rows share sequence 0 (real + draft row), a padding row with a stale
# local length, a row with nothing to attend, a full local block, a row attending only its local
# block.
ROWS = [(0, 5), (0, 6), (-1, 3), (1, 0), (2, 16), (1, 7)]


def _run_sparse(case, num_splits, rtol, atol):
    q, ws_k, ws_v, ws_map, seq_slots, local_lens = case
    scale = 1.0 / math.sqrt(q.shape[-1])
    out = torch.full_like(q, NAN)
    got = sparse_decode_attention(q, ws_k, ws_v, ws_map, seq_slots, local_lens, scale, out=out,
                                  num_splits=num_splits)
    assert got is out and got.isfinite().all(), "output not fully written or not finite"
    ref = sparse_decode_ref(q, ws_k, ws_v, ws_map, seq_slots, local_lens, scale)
    dense = _dense_sparse(q, ws_k, ws_v, ws_map, seq_slots, local_lens, scale)
    torch.testing.assert_close(got.float(), ref.float(), rtol=rtol, atol=atol)
    torch.testing.assert_close(ref.double().cpu(), dense.to(q.dtype).double(), rtol=rtol, atol=atol)
    nothing = (seq_slots < 0) | ((local_lens == 0)
                                 & (ws_map[seq_slots.clamp(min=0).long(), :, :-1] < 0)
                                 .flatten(1).all(1))
    assert (got[nothing] == 0).all()
    return got


@pytest.mark.parametrize("group,head_dim", [(1, 32), (2, 64)])
@pytest.mark.parametrize("num_splits", [None, 2, 3],
                         ids=["default", "splits2", "splits3-one-empty"])
def test_sparse_decode_fp32(group, head_dim, num_splits):
    case = _ws_case(ROWS, num_kv_heads=2, group=group, head_dim=head_dim, dtype=torch.float32)
    _run_sparse(case, num_splits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("group", [1, 4, 8, 16])
@pytest.mark.parametrize("num_splits", [None, 1, 3])
def test_sparse_decode_draft_rows(group, num_splits):
    """Lookahead: draft rows ride in their row's program and add their own key/value; rows without a
    draft, a padding row's draft (zeros) and a draft whose row attends nothing else."""
    rows = [(0, 5), (-1, 3), (1, 0), (2, 16), (3, 1)]
    q, ws_k, ws_v, ws_map, seq_slots, local_lens = _ws_case(rows, num_kv_heads=2, group=group,
                                                            head_dim=32, dtype=torch.float32,
                                                            seed=4)
    gen = torch.Generator().manual_seed(5)
    draft_rows = torch.tensor([6, 5, 7, -1, 8], dtype=torch.int32)  # q rows 5..8, out of order
    q = torch.cat([q, torch.randn(4, *q.shape[1:], generator=gen)])
    extra_k, extra_v = torch.randn(2, 9, 2, 32, generator=gen)
    scale = 0.3
    out = torch.full_like(q, NAN)
    got = sparse_decode_attention(q, ws_k, ws_v, ws_map, seq_slots, local_lens, scale, out=out,
                                  num_splits=num_splits, draft_rows=draft_rows, extra_k=extra_k,
                                  extra_v=extra_v)
    assert got is out and got.isfinite().all()
    ref = sparse_decode_ref(q, ws_k, ws_v, ws_map, seq_slots, local_lens, scale,
                            draft_rows=draft_rows, extra_k=extra_k, extra_v=extra_v)
    dense = _dense_sparse(q, ws_k, ws_v, ws_map, seq_slots, local_lens, scale, draft_rows, extra_k,
                          extra_v)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ref.double(), dense, rtol=1e-5, atol=1e-5)
    assert (got[1] == 0).all() and (got[5] == 0).all()  # the padding row and its draft
    assert not (got[7] == 0).all()  # row 2 attends nothing, its draft attends itself
    plain = sparse_decode_attention(q[:5], ws_k, ws_v, ws_map, seq_slots, local_lens, scale,
                                    num_splits=num_splits)
    # real rows unchanged by drafts
    torch.testing.assert_close(got[:5], plain, rtol=1e-6, atol=1e-6)


def test_sparse_decode_split_invariance_block32_group4():
    """Block size 32 (2 slots per iteration), many splits (most of them empty): same result as one
    split."""
    case = _ws_case([(0, 31), (2, 1), (3, 32)], num_kv_heads=1, group=4, head_dim=32,
                    dtype=torch.float32, num_slots=6, block_size=32, seed=1)
    outs = [_run_sparse(case, s, rtol=1e-5, atol=1e-5) for s in (1, 8)]
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-6, atol=1e-6)


def test_sparse_decode_only_local_slot():
    """W = 1: the working set is just the local block."""
    case = _ws_case([(0, 9), (1, 0), (0, 16)], num_kv_heads=2, group=2, head_dim=32,
                    dtype=torch.float32, num_slots=1, seed=3)
    _run_sparse(case, None, rtol=1e-5, atol=1e-5)


def test_sparse_decode_bf16_noncontiguous_q_and_layer_view():
    """bf16 (the interpreter truncates fp32 -> bf16 on store: ~1 ulp); q a strided view; the working
    set one layer of a [L, S, Hk, W, B, D] buffer."""
    q, ws_k, ws_v, ws_map, seq_slots, local_lens = _ws_case(ROWS, num_kv_heads=2, group=2,
                                                            head_dim=64, dtype=torch.bfloat16,
                                                            seed=2)
    q_view = torch.cat([q, torch.zeros_like(q)], dim=-1)[..., :64]
    layers_k = torch.stack([torch.full_like(ws_k, NAN), ws_k])
    layers_v = torch.stack([torch.full_like(ws_v, NAN), ws_v])
    _run_sparse((q_view, layers_k[1], layers_v[1], ws_map, seq_slots, local_lens), 2, rtol=1e-2,
                atol=1e-2)


def test_sparse_decode_all_padding():
    q, ws_k, ws_v, ws_map, seq_slots, local_lens = _ws_case([(-1, 4), (-1, 0)], num_kv_heads=1,
                                                            group=2, head_dim=32,
                                                            dtype=torch.float32)
    for splits in (None, 2):
        out = sparse_decode_attention(q, ws_k, ws_v, ws_map, seq_slots, local_lens, 0.125,
                                      out=torch.full_like(q, NAN), num_splits=splits)
        assert (out == 0).all()


# ---------------------------------------------------------------- block_scores / topk_blocks


def _scores_case(num_blocks, num_kv_heads, group, head_dim, num_host_blocks=48, max_blocks=40,
                 seed=0, dtype=torch.float32, device="cpu"):
    """Keys of every host block, summaries computed from them (max/min over tokens), NaN summaries
    for host blocks no row uses, block-table entries past num_blocks pointing at those.
    Returns (q, keys ``[blocks, Hk, B, D]``, summaries, block_tables, num_blocks)."""
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(num_host_blocks, num_kv_heads, 16, head_dim, generator=gen).to(dtype)
    summaries = torch.stack([keys.amax(2), keys.amin(2)], dim=2)
    perm = torch.randperm(num_host_blocks, generator=gen)
    poison = perm[-6:]
    summaries[poison] = NAN
    tables = poison[torch.randint(len(poison), (len(num_blocks), max_blocks), generator=gen)]
    for row, n in enumerate(num_blocks):  # rows may share blocks (as forked sequences would)
        tables[row, :n] = perm[torch.randperm(num_host_blocks - 6, generator=gen)[:n]]
    q = torch.randn(len(num_blocks), num_kv_heads * group, head_dim, generator=gen).to(dtype)
    nb = torch.tensor(num_blocks, dtype=torch.int32)
    return [t.to(device) for t in (q, keys, summaries, tables.to(torch.int32), nb)]


def _scores_float64(q, summaries, tables, num_blocks, alpha):
    """Independent per-head float64 scores."""
    q, summaries, tables = q.cpu().double(), summaries.cpu().double(), tables.cpu()
    n, num_q_heads, _ = q.shape
    num_kv_heads = summaries.shape[1]
    group = num_q_heads // num_kv_heads
    out = torch.full((n, num_kv_heads, tables.shape[1]), float("-inf"), dtype=torch.float64)
    for row in range(n):
        for b in range(int(num_blocks[row])):
            hi, lo = summaries[tables[row, b], :, 0], summaries[tables[row, b], :, 1]
            c, r = (hi + lo) / 2, (hi - lo) / 2
            for h in range(num_kv_heads):
                qs = q[row, h * group:(h + 1) * group]
                out[row, h, b] = sum(qs[g] @ c[h] + alpha * qs[g].abs() @ r[h]
                                     for g in range(group))
    return out


# num_blocks: a multi-tile row (32 blocks per program), a row without complete blocks, a short row,
# a full one.
NUM_BLOCKS = [37, 0, 5, 40]


@pytest.mark.parametrize("group,alpha,config", [
    (1, 1.0, {}), (2, 1.0, {}), (4, 0.5, {}),
    (2, 1.0, dict(block_b=8, tiles=3, num_stages=2)),  # a program loops over 3 tiles
    (4, 0.5, dict(block_b=16, tiles=4, num_warps=2))])
def test_block_scores(group, alpha, config):
    q, keys, summaries, tables, num_blocks = _scores_case(NUM_BLOCKS, num_kv_heads=2, group=group,
                                                          head_dim=32)
    out = torch.full((4, 2, tables.shape[1]), NAN)
    got = block_scores(q, summaries, tables, num_blocks, alpha, out=out, **config)
    ref = block_scores_ref(q, summaries, tables, num_blocks, alpha)
    want = _scores_float64(q, summaries, tables, num_blocks, alpha)
    assert got is out and not got.isnan().any()
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ref.double(), want, rtol=1e-5, atol=1e-5)
    past = torch.arange(tables.shape[1]) >= num_blocks.long()[:, None]
    assert (got.transpose(1, 2)[past] == float("-inf")).all()
    assert got.transpose(1, 2)[~past].isfinite().all()


def test_block_scores_upper_bound_every_key():
    """With alpha = 1 and summaries from the real keys, the score bounds sum_g q_g . k for every key
    k of the block (the Quest bound: max over the box of q . k is q . c + |q| . r, per head)."""
    q, keys, summaries, tables, num_blocks = _scores_case(NUM_BLOCKS, num_kv_heads=2, group=2,
                                                          head_dim=32, seed=4)
    got = block_scores(q, summaries, tables, num_blocks, 1.0)
    q_sum = q.double().view(4, 2, 2, 32).sum(2)  # [N, Hk, D]
    for row, n in enumerate(num_blocks.tolist()):
        k = keys[tables[row, :n].long()].double()  # [n, Hk, B, D]
        actual = torch.einsum("hd,bhtd->hbt", q_sum[row], k)  # [Hk, n, B]
        assert (actual <= got[row, :, :n, None].double() + 1e-4).all()


def test_block_scores_bf16_summaries():
    q, _, summaries, tables, num_blocks = _scores_case(NUM_BLOCKS, num_kv_heads=2, group=2,
                                                       head_dim=64, dtype=torch.bfloat16, seed=5)
    got = block_scores(q, summaries, tables, num_blocks, 1.0, out=torch.full((4, 2, 40), NAN))
    torch.testing.assert_close(got, block_scores_ref(q, summaries, tables, num_blocks, 1.0),
                               rtol=1e-4, atol=1e-4)


def test_topk_blocks_clamps_k_and_orders():
    scores = torch.tensor([[[0.5, 3.0, float("-inf"), 1.0]],
                           [[2.0, float("-inf"), float("-inf"), float("-inf")]]])
    values, indices = topk_blocks(scores, 2)
    assert indices[0, 0].tolist() == [1, 3] and values[1, 0, 1] == float("-inf")
    values, indices = topk_blocks(scores, 10)
    assert values.shape == (2, 1, 4) and indices[0, 0].tolist() == [1, 3, 0, 2]
    assert topk_blocks(scores, 0)[0].shape == (2, 1, 0)


# ---------------------------------------------------------------- gather_blocks


def _host_case(num_host_blocks=12, num_layers=2, num_kv_heads=2, block_size=16, head_dim=32,
               num_seqs=4, num_slots=5, m=10, dtype=torch.bfloat16, index_dtype=torch.int32, seed=0,
               device="cpu", pin=False):
    """Host store with a few selected blocks (the rest NaN), NaN working set, and items reading the
    selected blocks at random heads into distinct random slots; about a quarter are padding (-1)."""
    gen = torch.Generator().manual_seed(seed)
    shape = (num_host_blocks, num_layers, num_kv_heads, block_size, head_dim)
    host_k = torch.randn(shape, generator=gen).to(dtype)
    host_v = torch.randn(shape, generator=gen).to(dtype)
    chosen = torch.randperm(num_host_blocks, generator=gen)[:max(1, num_host_blocks // 2)]
    unused = torch.ones(num_host_blocks, dtype=torch.bool)
    unused[chosen] = False
    host_k[unused] = NAN
    host_v[unused] = NAN
    if pin:
        host_k, host_v = host_k.pin_memory(), host_v.pin_memory()
    ws_shape = (num_seqs, num_kv_heads, num_slots, block_size, head_dim)
    ws_k = torch.full(ws_shape, NAN, dtype=dtype, device=device)
    ws_v = torch.full(ws_shape, NAN, dtype=dtype, device=device)
    src_block = chosen[torch.randint(len(chosen), (m,), generator=gen)]
    src_block[torch.rand(m, generator=gen) < 0.25] = -1
    src_head = torch.randint(num_kv_heads, (m,), generator=gen)
    dst_slot = torch.randperm(num_seqs * num_kv_heads * num_slots, generator=gen)[:m]
    idx = [t.to(index_dtype).to(device) for t in (src_block, src_head, dst_slot)]
    return host_k, host_v, ws_k, ws_v, *idx


def _loop_gather(host_k, host_v, layer, ws_k, ws_v, src_block, src_head, dst_slot):
    """Independent per-item copy."""
    block_size, head_dim = host_k.shape[-2:]
    for b, h, d in zip(src_block.tolist(), src_head.tolist(), dst_slot.tolist()):
        if b >= 0:
            ws_k.view(-1, block_size, head_dim)[d] = host_k[b, layer, h].to(ws_k.device)
            ws_v.view(-1, block_size, head_dim)[d] = host_v[b, layer, h].to(ws_v.device)


@pytest.mark.parametrize("fn", [gather_blocks, gather_blocks_ref], ids=["triton", "ref"])
@pytest.mark.parametrize("num_programs,items,index_dtype",
                         [(64, 1, torch.int32), (3, 1, torch.int64), (1, 1, torch.int32),
                          (2, 4, torch.int32), (1, 16, torch.int64)])
def test_gather_blocks(fn, num_programs, items, index_dtype):
    """Also tiles of several items per iteration, with a partial last tile (M = 10)."""
    host_k, host_v, ws_k, ws_v, src_block, src_head, dst_slot = _host_case(index_dtype=index_dtype)
    want_k, want_v = ws_k.clone(), ws_v.clone()
    _loop_gather(host_k, host_v, 1, want_k, want_v, src_block, src_head, dst_slot)
    fn(host_k, host_v, 1, ws_k, ws_v, src_block, src_head, dst_slot, num_programs=num_programs,
       items_per_iter=items)
    torch.testing.assert_close(ws_k, want_k, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(ws_v, want_v, rtol=0, atol=0, equal_nan=True)
    written = int((src_block >= 0).sum()) * 16 * 32
    assert 0 < written and int((~ws_k.isnan()).sum()) == written == int((~ws_v.isnan()).sum())


def test_gather_blocks_chunked_slices_and_empty(monkeypatch):
    """Slices larger than one load (forced small chunk): several loads per slice; M = 0 is a
    no-op."""
    monkeypatch.setattr(uva_gather, "_MAX_CHUNK", 256)
    host_k, host_v, ws_k, ws_v, src_block, src_head, dst_slot = _host_case(head_dim=64, m=6, seed=1)
    want_k, want_v = ws_k.clone(), ws_v.clone()
    gather_blocks_ref(host_k, host_v, 0, want_k, want_v, src_block, src_head, dst_slot)
    gather_blocks(host_k, host_v, 0, ws_k, ws_v, src_block, src_head, dst_slot, num_programs=4)
    torch.testing.assert_close(ws_k, want_k, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(ws_v, want_v, rtol=0, atol=0, equal_nan=True)
    gather_blocks(host_k, host_v, 0, ws_k, ws_v, src_block[:0], src_head[:0], dst_slot[:0])
    torch.testing.assert_close(ws_k, want_k, rtol=0, atol=0, equal_nan=True)


# ---------------------------------------------------------------- block_minmax


def _loop_minmax(src, idx0, idx1, summaries, dst_block, dst_head, num_tokens=None):
    """Independent per-item max/min in float64."""
    for i, (a, b, d, h) in enumerate(zip(idx0.tolist(), idx1.tolist(), dst_block.tolist(),
                                         dst_head.tolist())):
        n = src.shape[2] if num_tokens is None else int(num_tokens[i])
        if d >= 0 and n > 0:
            block = src[a, b, :n].double()
            summaries[d, h, 0] = block.max(0).values.to(summaries.dtype)
            summaries[d, h, 1] = block.min(0).values.to(summaries.dtype)


@pytest.mark.parametrize("fn", [block_minmax, block_minmax_ref], ids=["triton", "ref"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_minmax_from_host_layer_view(fn, dtype):
    host_k, _, _, _, _, _, _ = _host_case(dtype=dtype, seed=2)
    # every block readable here; the unused items below are skipped
    host_k[torch.isnan(host_k)] = 3.0
    src = host_k[:, 1]  # [blocks, Hk, B, D], block stride L * Hk * B * D
    assert not src.is_contiguous()
    idx0 = torch.tensor([3, 0, 11, 7, 5], dtype=torch.int32)
    idx1 = torch.tensor([1, 0, 1, 0, 1], dtype=torch.int64)
    dst_block = torch.tensor([3, 0, -1, 7, 9], dtype=torch.int32)  # item 2 is padding
    summaries = torch.full((12, 2, 2, 32), NAN, dtype=dtype)
    want = summaries.clone()
    _loop_minmax(src, idx0, idx1, want, dst_block, idx1)
    fn(src, idx0, idx1, summaries, dst_block, idx1)
    torch.testing.assert_close(summaries, want, rtol=0, atol=0, equal_nan=True)
    assert int((~summaries.isnan()).sum()) == 4 * 2 * 32


@pytest.mark.parametrize("fn", [block_minmax, block_minmax_ref], ids=["triton", "ref"])
def test_block_minmax_from_local_slots_with_num_tokens(fn):
    """src = the local slots ``ws_k[:, :, W-1]`` of a working set; num_tokens limits the reduction
    (0 skips)."""
    _, _, ws_k, _, _, _, _ = _host_case(seed=3, dtype=torch.float32)
    ws_k.normal_()
    tokens = torch.tensor([16, 5, 0, 1, 16])
    seq = torch.tensor([0, 1, 2, 3, 3])
    head = torch.tensor([1, 0, 1, 1, 0])
    # tails past num_tokens must not be read: +-1e4 there would move max or min
    for i in range(5):
        tail = ws_k[seq[i], head[i], -1, tokens[i]:]  # (NaN would not do: max/min may skip NaN)
        tail.copy_(1e4 * torch.randn(tail.shape).sign())
    src = ws_k[:, :, -1]
    dst_block = torch.tensor([10, 2, 4, 0, 6])
    summaries = torch.full((12, 2, 2, 32), NAN)
    want = summaries.clone()
    _loop_minmax(src, seq, head, want, dst_block, head, tokens)
    fn(src, seq, head, summaries, dst_block, head, num_tokens=tokens)
    torch.testing.assert_close(summaries, want, rtol=0, atol=0, equal_nan=True)
    assert int((~summaries.isnan()).sum()) == 4 * 2 * 32 and summaries[4].isnan().all()


# ------------------------------------------------------------ GPU (compiled) tests: Qwen3-8B shapes

HQ, HK, D, B, K_SLOTS = 32, 8, 128, 16, 128


def _gpu_ws_case(device, seed, num_rows=64, num_seqs=40):
    gen = torch.Generator().manual_seed(seed)
    rows = [(int(s), int(n))
            for s, n in zip(torch.randint(0, num_seqs - 4, (num_rows,), generator=gen),
                            torch.randint(0, B + 1, (num_rows,), generator=gen))]
    rows[5] = (-1, 3)
    return _ws_case(rows, num_kv_heads=HK, group=HQ // HK, head_dim=D, dtype=torch.bfloat16,
                    num_seqs=num_seqs, num_slots=K_SLOTS + 1, block_size=B, seed=seed,
                    device=device)


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [None, 1, 4, 40])
def test_sparse_decode_gpu_realistic(cuda_device, num_splits):
    q, ws_k, ws_v, ws_map, seq_slots, local_lens = _gpu_ws_case(cuda_device, seed=6)
    scale = 1.0 / math.sqrt(D)
    out = sparse_decode_attention(q, ws_k, ws_v, ws_map, seq_slots, local_lens, scale,
                                  out=torch.full_like(q, NAN), num_splits=num_splits)
    ref = sparse_decode_ref(q, ws_k, ws_v, ws_map, seq_slots, local_lens, scale)
    torch.cuda.synchronize()
    assert out.isfinite().all() and (out[5] == 0).all()
    torch.testing.assert_close(out.float(), ref.float(), rtol=1e-2, atol=2e-3)


@pytest.mark.gpu
def test_sparse_decode_cuda_graph_replay(cuda_device):
    """Capture once, then change q, ws_map, seq_slots, local_lens and the working set's contents and
    replay: the graph's fixed grid must give the reference answer each time."""
    q, ws_k, ws_v, ws_map, seq_slots, local_lens = _gpu_ws_case(cuda_device, seed=7)
    scale, out = 1.0 / math.sqrt(D), torch.full_like(q, NAN)

    def step():
        sparse_decode_attention(q, ws_k, ws_v, ws_map, seq_slots, local_lens, scale, out=out)

    graph = capture_graph(step)
    for seed in (8, 9, 10):
        new = _gpu_ws_case(cuda_device, seed=seed)
        for static, fresh in zip((q, ws_k, ws_v, ws_map, seq_slots, local_lens), new):
            static.copy_(fresh)
        out.fill_(NAN)
        graph.replay()
        ref = sparse_decode_ref(q, ws_k, ws_v, ws_map, seq_slots, local_lens, scale)
        torch.cuda.synchronize()
        assert out.isfinite().all() and (out[5] == 0).all()
        torch.testing.assert_close(out.float(), ref.float(), rtol=1e-2, atol=2e-3)


@pytest.mark.gpu
def test_block_scores_gpu_realistic(cuda_device):
    gen = torch.Generator().manual_seed(11)
    num_blocks = torch.randint(0, 2049, (64,), generator=gen).tolist()
    q, _, summaries, tables, nb = _scores_case(num_blocks, num_kv_heads=HK, group=HQ // HK,
                                               head_dim=D, num_host_blocks=4096, max_blocks=2048,
                                               dtype=torch.bfloat16, seed=11, device=cuda_device)
    got = block_scores(q, summaries, tables, nb, 1.0,
                       out=torch.full((64, HK, 2048), NAN, device=cuda_device))
    ref = block_scores_ref(q, summaries, tables, nb, 1.0)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-2)
    values, indices = topk_blocks(got, K_SLOTS)
    assert indices.shape == (64, HK, K_SLOTS)


def _pinned_case(device, seed, m=4096):
    return _host_case(num_host_blocks=512, num_layers=4, num_kv_heads=HK, block_size=B, head_dim=D,
                      num_seqs=8, num_slots=K_SLOTS + 1, m=m, seed=seed, device=device, pin=True)


@pytest.mark.gpu
@pytest.mark.parametrize("num_programs", [1, 32, 64, 132, 4096])
def test_gather_blocks_gpu_pinned(cuda_device, num_programs):
    host_k, host_v, ws_k, ws_v, src_block, src_head, dst_slot = _pinned_case(cuda_device, seed=12)
    assert host_k.is_pinned()
    want_k, want_v = ws_k.clone(), ws_v.clone()
    gather_blocks_ref(host_k, host_v, 2, want_k, want_v, src_block, src_head, dst_slot)
    gather_blocks(host_k, host_v, 2, ws_k, ws_v, src_block, src_head, dst_slot,
                  num_programs=num_programs)
    torch.cuda.synchronize()
    torch.testing.assert_close(ws_k, want_k, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(ws_v, want_v, rtol=0, atol=0, equal_nan=True)


@pytest.mark.gpu
def test_gather_blocks_cuda_graph_reads_pinned_memory_at_replay(cuda_device):
    """Capture a gather from pinned host memory, then rewrite the host store and the index lists on
    the host side and replay: the working set must hold the data as it was at replay time."""
    host_k, host_v, ws_k, ws_v, src_block, src_head, dst_slot = _pinned_case(cuda_device, seed=13)

    def step():
        gather_blocks(host_k, host_v, 1, ws_k, ws_v, src_block, src_head, dst_slot, num_programs=64)

    graph = capture_graph(step)
    for seed in (14, 15):
        torch.cuda.synchronize()
        new = _pinned_case(cuda_device, seed=seed)
        host_k.copy_(new[0])
        host_v.copy_(new[1])
        for static, fresh in zip((src_block, src_head, dst_slot), new[4:]):
            static.copy_(fresh)
        ws_k.fill_(NAN)
        ws_v.fill_(NAN)
        graph.replay()
        want_k, want_v = torch.full_like(ws_k, NAN), torch.full_like(ws_v, NAN)
        gather_blocks_ref(host_k, host_v, 1, want_k, want_v, src_block, src_head, dst_slot)
        torch.cuda.synchronize()
        torch.testing.assert_close(ws_k, want_k, rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(ws_v, want_v, rtol=0, atol=0, equal_nan=True)


@pytest.mark.gpu
def test_block_minmax_gpu_pinned_and_device_sources(cuda_device):
    host_k, _, ws_k, _, _, _, _ = _pinned_case(cuda_device, seed=16)
    host_k[host_k.isnan()] = 1.0
    ws_k.normal_()
    gen = torch.Generator().manual_seed(16)
    m = 1024
    for src, (i0_max, i1_max) in ((host_k[:, 3], (512, HK)), (ws_k[:, :, -1], (8, HK))):
        idx0 = torch.randint(i0_max, (m,), generator=gen).to(cuda_device)
        idx1 = torch.randint(i1_max, (m,), generator=gen).to(cuda_device)
        dst_block = torch.randperm(4096, generator=gen)[:m].to(cuda_device)
        dst_block[::9] = -1
        got = torch.full((4096, HK, 2, D), NAN, dtype=torch.bfloat16, device=cuda_device)
        want = got.clone()
        block_minmax(src, idx0, idx1, got, dst_block, idx1)
        block_minmax_ref(src, idx0, idx1, want, dst_block, idx1)
        torch.cuda.synchronize()
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


def test_gather_blocks_reads_expanded_index_views_correctly():
    """Index lists may arrive as stride-0 expanded views (one block for every head): the wrapper
    must not read them as packed arrays."""
    from oasiskv.kernels.reference import gather_blocks_ref
    from oasiskv.kernels.uva_gather import gather_blocks
    host_k, host_v = torch.randn(4, 2, 3, 16, 32), torch.randn(4, 2, 3, 16, 32)
    got_k, got_v = (torch.full((2, 3, 5, 16, 32), float("nan")),
                    torch.full((2, 3, 5, 16, 32), float("nan")))
    want_k, want_v = got_k.clone(), got_v.clone()
    src = torch.tensor([2]).expand(3)          # stride 0
    heads, dst = torch.arange(3), torch.tensor([4, 9, 14])
    assert src.stride(0) == 0
    gather_blocks(host_k, host_v, 1, got_k, got_v, src, heads, dst)
    gather_blocks_ref(host_k, host_v, 1, want_k, want_v, src, heads, dst)
    torch.testing.assert_close(got_k, want_k, equal_nan=True)
    torch.testing.assert_close(got_v, want_v, equal_nan=True)
