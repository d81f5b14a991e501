"""BlockTableRows: the step's block tables as one int32 array, from per-sequence rows kept between
steps.

A sequence's ``block_table`` only grows by appending, or is replaced by a new list when the sequence
loses its blocks (preemption, finish). Rebuilding ``[batch, width]`` from Python lists every step
costs O(total blocks) of list-to-array conversion (2,048 entries per 32K-token sequence); here each
sequence keeps a numpy row extended by its new entries only, and a step copies rows array to array.
An output that keeps its values between steps (a CUDA graph's table mirror: ``fill`` with
``written``) gets only the entries its rows lack: a row that holds the same sequence's list as at
the last step gets the blocks appended since, most steps none.
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

    def fill(self, seqs, out: np.ndarray, written: list | None = None) -> None:
        """Write each sequence's block table into the first entries of its row of ``out``
        (int32 ``[>= len(seqs), >= widest table]``); the entries past them keep their values.
        ``written``: what rows of an ``out`` that keeps its values hold, ``(list, entries)`` per
        row (updated here; start from ``[(None, 0)] * len(out)``, and again whenever something
        else writes ``out``): a row holding the same list gets only its new entries."""
        if len(self._rows) > 2 * self.max_live:  # forget sequences that are gone
            live = {s.seq_id for s in seqs}
            self._rows = {k: v for k, v in self._rows.items() if k in live}
        for i, seq in enumerate(seqs):
            table = seq.block_table
            known, n = written[i] if written is not None else (None, 0)
            if known is table and n <= len(table):  # (lists only grow, by appending)
                if n < len(table):
                    out[i, n:len(table)] = table[n:]
            else:
                row = self._row(seq)
                out[i, :len(row)] = row
            if written is not None:  # (once the row holds it)
                written[i] = (table, len(table))

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
