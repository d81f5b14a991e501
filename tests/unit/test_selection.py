"""Selection invariants under random scores and residency: the cap, LRU victims, unique residency,
the top-K always resident when the cap allows, and the local block never touched."""
import torch
from hypothesis import given, settings, strategies as st

from oasiskv.kv.selection import plan_selection


def random_state(gen, n, heads, k, m):
    ws_map = torch.full((n, heads, k), -1, dtype=torch.int32)
    for r in range(n):
        for h in range(heads):
            filled = int(torch.randint(0, min(k, m) + 1, (1,), generator=gen))
            ws_map[r, h, torch.randperm(k, generator=gen)[:filled]] = \
                torch.randperm(m, generator=gen)[:filled].to(torch.int32)
    ws_last = torch.randint(0, 50, (n, heads, k), generator=gen)
    return ws_map, ws_last


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(1, 3), heads=st.integers(1, 3),
       k=st.integers(1, 6), m=st.integers(1, 12), cap=st.integers(1, 6))
def test_selection_invariants(seed, n, heads, k, m, cap):
    cap = min(cap, k)
    gen = torch.Generator().manual_seed(seed)
    ws_map, ws_last = random_state(gen, n, heads, k, m)
    complete = torch.randint(0, m + 1, (n,), generator=gen)
    scores = torch.randn(n, heads, m, generator=gen)
    scores[torch.arange(m)[None, None, :].expand(n, heads, m)
           >= complete[:, None, None]] = float("-inf")
    # only existing blocks
    ws_map = torch.where(ws_map >= complete[:, None, None].to(torch.int32), -1, ws_map)
    before_map, before_last = ws_map.clone(), ws_last.clone()
    sel = plan_selection(scores, ws_map, ws_last, k, cap, now=100)

    admitted = (sel.src_block >= 0).sum(-1)
    assert (admitted <= cap).all() and int(admitted.sum()) == int(sel.admitted)
    for r in range(n):
        for h in range(heads):
            resident = [b for b in ws_map[r, h].tolist() if b >= 0]
            assert len(resident) == len(set(resident)), "block resident twice"
            want = [b for b in scores[r, h].topk(min(k, m)).indices.tolist()
                    if scores[r, h, b] > float("-inf")]
            old = set(b for b in before_map[r, h].tolist() if b >= 0)
            misses = [b for b in want if b not in old]
            assert int((sel.src_block[r, h] >= 0).sum()) == min(cap, len(misses))
            assert set(misses[:cap]) <= set(resident), "highest-scoring misses are admitted first"
            assert set(want) & old <= set(resident), "hits are never evicted"
            for slot, block in zip(sel.dst_slot[r, h].tolist(), sel.src_block[r, h].tolist()):
                if block < 0:
                    continue
                assert ws_map[r, h, slot] == block and ws_last[r, h, slot] == 100
                assert before_map[r, h, slot].item() not in want, "a wanted block was evicted"
            empty_before = int((before_map[r, h] < 0).sum())
            reused = sum(before_map[r, h, s].item() >= 0 for s, b in
                         zip(sel.dst_slot[r, h].tolist(), sel.src_block[r, h].tolist()) if b >= 0)
            assert reused == max(0, int((sel.src_block[r, h] >= 0).sum()) - empty_before), (
                "empty slots first")
            evicted_slots = {s for s, b in zip(sel.dst_slot[r, h].tolist(),
                                               sel.src_block[r, h].tolist())
                             if b >= 0 and before_map[r, h, s] >= 0}
            kept = [before_last[r, h, j].item() for j in range(k) if j not in evicted_slots
                    and before_map[r, h, j] >= 0 and before_map[r, h, j].item() not in want]
            # LRU: nothing kept was selected less recently than anything evicted
            if evicted_slots and kept:
                assert max(before_last[r, h, s].item() for s in evicted_slots) <= min(kept)


def test_uncapped_selection_makes_the_top_k_resident():
    gen = torch.Generator().manual_seed(0)
    ws_map, ws_last = random_state(gen, 2, 2, 4, 10)
    scores = torch.randn(2, 2, 10, generator=gen)
    plan_selection(scores, ws_map, ws_last, 4, cap=4, now=1)
    for r in range(2):
        for h in range(2):
            assert set(ws_map[r, h].tolist()) == set(scores[r, h].topk(4).indices.tolist())
