"""BlockTableRows: the step's block tables as one int32 array, from per-sequence rows kept between
steps.

A sequence's ``block_table`` only grows by appending, or is replaced by a new list when the sequence
loses its blocks (preemption, finish). Rebuilding ``[batch, width]`` from Python lists every step
costs O(total blocks) of list-to-array conversion (2,048 entries per 32K-token sequence); here each
sequence keeps a numpy row extended by its new entries only, and a step copies rows array to array.
"""
from __future__ import annotations

import numpy as np


class BlockTableRows:
    def __init__(self, max_live: int):
        self.max_live = max_live
        # seq_id -> (its list, row, entries in row)
        self._rows: dict[int, tuple[list[int], np.ndarray, int]] = {}

    def build(self, seqs) -> np.ndarray:
        """int32 ``[len(seqs), widest table]``: each sequence's block table, zero padded."""
        tables = np.zeros((len(seqs), max(len(s.block_table) for s in seqs)), dtype=np.int32)
        self.fill(seqs, tables)
        return tables

    def fill(self, seqs, out: np.ndarray) -> None:
        """Write each sequence's block table into the first entries of its row of ``out``
        (int32 ``[>= len(seqs), >= widest table]``); the entries past them keep their values."""
        if len(self._rows) > 2 * self.max_live:  # forget sequences that are gone
            live = {s.seq_id for s in seqs}
            self._rows = {k: v for k, v in self._rows.items() if k in live}
        for dst, seq in zip(out, seqs):
            row = self._row(seq)
            dst[:len(row)] = row

    def _row(self, seq) -> np.ndarray:
        table = seq.block_table
        known, row, filled = self._rows.get(seq.seq_id, (None, None, 0))
        if known is not table or filled > len(table):  # new sequence or a new list: start over
            row, filled = np.empty(max(16, 2 * len(table)), dtype=np.int32), 0
        if len(table) > filled:
            if len(table) > len(row):
                row = np.concatenate([row[:filled],
                                      np.empty(2 * len(table) - filled, dtype=np.int32)])
            row[filled:len(table)] = table[filled:]
            filled = len(table)
        self._rows[seq.seq_id] = (table, row, filled)
        return row[:filled]
