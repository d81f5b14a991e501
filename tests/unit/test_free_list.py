"""FreeList against the OrderedDict it replaced: same blocks, same order, under random use."""
import random
from collections import OrderedDict

import numpy as np
import pytest

from oasiskv.engine.free_list import FreeList


@pytest.mark.parametrize("seed", range(20))
def test_free_list_matches_an_ordered_dict(seed):
    rng = random.Random(seed)
    n = rng.choice([1, 5, 64])
    free, ref = FreeList(n), OrderedDict.fromkeys(range(n))
    taken: list[int] = []
    for _ in range(400):
        op = rng.random()
        if op < 0.4 and ref:  # pop the oldest k
            k = rng.randint(1, len(ref))
            got = free.pop(k).tolist()
            want = [ref.popitem(last=False)[0] for _ in range(k)]
            assert got == want
            taken += got
        elif op < 0.6 and ref:  # revive one from the middle
            block = rng.choice(list(ref))
            free.remove(block)
            del ref[block]
            taken.append(block)
        elif taken:  # give some back, in a random order
            rng.shuffle(taken)
            k = rng.randint(1, len(taken))
            back, taken = taken[:k], taken[k:]
            free.push(np.array(back, dtype=np.int64))
            ref.update(dict.fromkeys(back))
        assert len(free) == len(ref)
        assert list(free) == list(ref)
        assert all((b in free) == (b in ref) for b in range(n))


def test_pop_skips_removed_blocks_and_compaction_keeps_order():
    free = FreeList(4)
    free.remove(0)
    free.remove(2)
    assert free.pop(1).tolist() == [1]
    for _ in range(50):  # many pushes and pops: the queue compacts and keeps its order
        free.push(free.pop(len(free))[::-1].copy())
    assert len(free) == 1 and list(free) == [3]
    free.push(np.array([2, 0, 1]))
    assert free.pop(4).tolist() == [3, 2, 0, 1]
    assert len(free) == 0 and list(free) == []
