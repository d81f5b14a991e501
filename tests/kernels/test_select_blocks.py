"""select_blocks (the capped selection in one Triton kernel) vs its reference (``kv.selection``'s
``plan_selection`` on per-row copies of the tables): same tables, plans and counts on random
residency and scores, including rows with nothing to select, fewer blocks than K, stale blocks past
the row's end, a K that is not a power of two, and rows naming a subset of the sequence slots out of
order. Scores are distinct (the kernel breaks ties by block index; torch.topk leaves their order
open), so a separate test checks ties against the policy's invariants only. CPU runs use the Triton
interpreter; ``-m gpu`` repeats the comparison at the Qwen3-8B shape inside a CUDA graph.
"""
import pytest
import torch

from oasiskv.kernels.reference import select_blocks_ref
from oasiskv.kernels.select_blocks import select_blocks
from tests.helpers import capture_graph


def _case(n=5, num_seqs=7, heads=2, k=6, m=11, seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    ws_map = torch.full((num_seqs, heads, k + 1), -1, dtype=torch.int32)
    for s in range(num_seqs):
        for h in range(heads):
            filled = int(torch.randint(0, k + 1, (1,), generator=gen))
            # some past the row's end
            ws_map[s, h, torch.randperm(k, generator=gen)[:filled]] = \
                torch.randperm(m + 3, generator=gen)[:filled].to(torch.int32)
    ws_map[:, :, k] = 99  # the local slot's column: never read or written
    ws_last = torch.randint(0, 50, (num_seqs, heads, k), generator=gen)
    slots = torch.randperm(num_seqs, generator=gen)[:n]
    complete = torch.randint(0, m + 1, (n,), generator=gen)
    complete[0] = 0  # a row with nothing to select
    complete[1] = m
    # distinct scores
    scores = torch.randperm(n * heads * m, generator=gen).float().view(n, heads, m) / 7 - 20
    scores[torch.arange(m)[None, None, :].expand(n, heads, m)
           >= complete[:, None, None]] = float("-inf")
    block_tables = torch.randint(0, 1000, (n, m + 2), generator=gen, dtype=torch.int32)
    now = torch.tensor(100)
    return [t.to(device) for t in (scores, ws_map, ws_last, slots, block_tables, now)]


def _compare(case, k, cap):
    scores, ws_map, ws_last, slots, block_tables, now = case
    want_map, want_last, want_counters = (ws_map.clone(), ws_last.clone(),
                                          torch.zeros(3, dtype=torch.long, device=ws_map.device))
    want = select_blocks_ref(scores.clone(), want_map, want_last, slots, block_tables, k, cap, now,
                             want_counters)
    counters = torch.zeros_like(want_counters)
    got = select_blocks(scores.clone(), ws_map, ws_last, slots, block_tables, k, cap, now, counters)
    torch.testing.assert_close(ws_map, want_map, rtol=0, atol=0)
    torch.testing.assert_close(ws_last, want_last, rtol=0, atol=0)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)
    torch.testing.assert_close(counters, want_counters, rtol=0, atol=0)
    return counters


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("k,m,cap", [(6, 11, 2), (6, 11, 6), (4, 3, 1), (8, 40, 3), (1, 5, 1),
                                     (40, 300, 7)])
def test_select_blocks_matches_reference(seed, k, m, cap):
    counters = _compare(_case(k=k, m=m, seed=seed), k, cap)
    assert counters[0] + counters[1] > 0  # something was wanted


def test_select_blocks_ties_keep_the_policy():
    """All scores equal: exactly min(K, blocks) wanted, the lowest block indices; the cap and empty
    slots first still hold."""
    scores, ws_map, ws_last, slots, block_tables, now = _case(n=2, k=4, m=9, seed=1)
    scores = torch.zeros_like(scores)
    ws_map[slots] = -1
    counters = torch.zeros(3, dtype=torch.long)
    src, dst = select_blocks(scores, ws_map, ws_last, slots, block_tables, 4, 4, now, counters)
    for r in range(2):
        for h in range(2):
            assert sorted(ws_map[slots[r], h, :4].tolist()) == [0, 1, 2, 3]
            # best (lowest index) first
            assert src[r, h].tolist() == block_tables[r, :4].long().tolist()
            assert dst[r, h].tolist() == [0, 1, 2, 3]
    assert counters.tolist() == [0, 16, 16]


@pytest.mark.parametrize("seed", range(3))
def test_select_blocks_top_k_with_many_ties_is_exact(seed):
    """Scores from a handful of values, either sign, some blocks missing: the K wanted blocks are
    exactly the first K by (score desc, block index asc), whatever the search's probes land on."""
    gen = torch.Generator().manual_seed(seed)
    n, heads, m, k = 3, 2, 517, 50
    values = torch.tensor([-3.5e4, -1.0, -0.0, 0.0, 0.0, 2.5e-30, 7.0, 7.000001, 3e38])
    scores = values[torch.randint(0, len(values), (n, heads, m), generator=gen)]
    scores[torch.rand(n, heads, m, generator=gen) < 0.2] = float("-inf")
    ws_map = torch.full((n, heads, k + 1), -1, dtype=torch.int32)
    ws_last = torch.zeros((n, heads, k), dtype=torch.long)
    block_tables = torch.arange(m, dtype=torch.int32).repeat(n, 1)
    select_blocks(scores.clone(), ws_map, ws_last, torch.arange(n), block_tables, k, k,
                  torch.tensor(1), torch.zeros(3, dtype=torch.long))
    for r in range(n):
        for h in range(heads):
            order = sorted((b for b in range(m) if scores[r, h, b] > float("-inf")),
                           key=lambda b: (-scores[r, h, b].item(), b))
            assert sorted(ws_map[r, h, :k].tolist()) == sorted(order[:k])


@pytest.mark.gpu
def test_select_blocks_gpu_qwen3_8b_shape_in_a_graph():
    """64 rows x 8 kv heads, 2,048 blocks (32K tokens), K = 128, cap 7, replayed from a CUDA
    graph."""
    scores, ws_map, ws_last, slots, block_tables, now = _case(n=64, num_seqs=80, heads=8, k=128,
                                                              m=2048, seed=3, device="cuda")
    want_map, want_last = ws_map.clone(), ws_last.clone()
    want_counters = torch.zeros(3, dtype=torch.long, device="cuda")
    want = select_blocks_ref(scores, want_map, want_last, slots, block_tables, 128, 7, now,
                             want_counters)
    state = [t.clone() for t in (scores, ws_map, ws_last)]
    scratch, tables, stamps = [t.clone() for t in state]
    counters = torch.zeros(3, dtype=torch.long, device="cuda")
    out = {}
    graph = capture_graph(lambda: out.update(
        plan=select_blocks(scratch, tables, stamps, slots, block_tables, 128, 7, now, counters)))
    for live, original in zip((scratch, tables, stamps), state):  # undo the warm-up run
        live.copy_(original)
    counters.zero_()
    graph.replay()
    torch.cuda.synchronize()
    for got, expected in zip((tables, stamps, *out["plan"], counters),
                             (want_map, want_last, *want, want_counters)):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert int(want_counters[2]) > 0
