"""BlockTableRows: the step's tables equal the sequences' lists through growth, replacement and
pruning."""
from types import SimpleNamespace

import numpy as np

from oasiskv.engine.block_tables import BlockTableRows


def test_rows_follow_appends_replacements_and_other_sequences():
    rows = BlockTableRows(max_live=2)
    a, b = (SimpleNamespace(seq_id=1, block_table=[5]),
            SimpleNamespace(seq_id=2, block_table=list(range(40))))

    def check(*seqs):
        got = rows.build(list(seqs))
        width = max(len(s.block_table) for s in seqs)
        want = np.array([s.block_table + [0] * (width - len(s.block_table)) for s in seqs],
                        dtype=np.int32)
        np.testing.assert_array_equal(got, want)

    check(a, b)
    # growth past the row's capacity, one block at a time and several at once
    for step in range(100):
        a.block_table.append(100 + step)
        if step % 7 == 0:
            b.block_table.extend([200 + step, 300 + step, 400 + step])
        check(b, a)
    a.block_table = [9, 8]  # preempted and re-admitted: a new, shorter list
    check(a, b)
    a.block_table = []
    a.block_table.append(3)  # a new list that grows to the old length: not mistaken for the old one
    a.block_table.append(4)
    check(a)
    for seq_id in range(3, 12):  # many sequences come and go: old rows are forgotten
        check(SimpleNamespace(seq_id=seq_id, block_table=[seq_id] * seq_id), a)
    assert len(rows._rows) <= 2 * 2 + 1


def test_fill_writes_each_row_prefix_and_leaves_the_rest():
    rows = BlockTableRows(max_live=4)
    a, b = (SimpleNamespace(seq_id=1, block_table=[7, 8, 9]),
            SimpleNamespace(seq_id=2, block_table=[4]))
    out = np.full((3, 5), -5, dtype=np.int32)  # a graph's static tables: wider, more rows
    rows.fill([a, b], out)
    np.testing.assert_array_equal(out, [[7, 8, 9, -5, -5], [4, -5, -5, -5, -5], [-5] * 5])
    a.block_table.append(10)
    rows.fill([b, a], out)  # rows follow the sequences' order
    np.testing.assert_array_equal(out, [[4, 8, 9, -5, -5], [7, 8, 9, 10, -5], [-5] * 5])


def test_a_kept_output_gets_only_what_its_rows_lack():
    """``fill`` with ``written`` into an output that keeps its values (a graph's mirror) equals a
    fresh ``build`` after every step: sequences grow, swap rows, come and go, are preempted (a
    new list) and re-admitted; a row holding the same list gets only its new entries."""
    import random
    rng = random.Random(3)
    rows, width = BlockTableRows(max_live=6), 64
    out = np.full((6, width), -7, dtype=np.int32)
    written = [(None, 0)] * 6
    seqs = [SimpleNamespace(seq_id=i, block_table=[rng.randrange(99)]) for i in range(6)]
    for step in range(300):
        for seq in seqs:
            if len(seq.block_table) < width and rng.random() < 0.3:
                seq.block_table.append(rng.randrange(1000))
        if rng.random() < 0.1:  # preempted, re-admitted later with a new, shorter list
            rng.choice(seqs).block_table = [rng.randrange(1000) for _ in range(rng.randrange(4))]
        if rng.random() < 0.2:
            rng.shuffle(seqs)
        live = seqs[:rng.randrange(1, 7)]
        before = out.copy()
        rows.fill(live, out, written)
        for i, seq in enumerate(live):
            np.testing.assert_array_equal(out[i, :len(seq.block_table)], seq.block_table)
            assert (out[i, len(seq.block_table):] == before[i, len(seq.block_table):]).all()
        assert (out[len(live):] == before[len(live):]).all()
    # nothing new: nothing written (a row cleared by hand stays so)
    out[0, :len(live[0].block_table)] = -1
    rows.fill(live, out, written)
    assert (out[0, :len(live[0].block_table)] == -1).all()
