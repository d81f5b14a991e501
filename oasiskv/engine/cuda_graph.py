"""CudaGraphRunner: decode steps replayed from CUDA graphs captured per batch-size bucket.

Static buffers hold the largest bucket; a step of B sequences replays the smallest bucket b >= B.
With ``k = backend.rows_per_seq`` a bucket of b runs k * b rows: row group j (rows j*b .. j*b + b)
holds the step's group j (its sequences' tokens, then each group of the backend's extra rows),
padded to b. Padding rows have slot -1 (nothing stored), position 0 and context length 0 (the
decode kernels skip them); the backend pads its own ``meta`` in ``prepare_replay``. Block tables
are ``max_blocks_per_seq`` wide so the graph's kernel grids never depend on the step's contents.
All buckets share one memory pool.

The static inputs (token ids, positions, slots, context lengths, block tables) are views of one
device buffer with a pinned host mirror laid out the same way: a step writes its inputs into the
mirror, already in the bucket's padded layout, and moves them with one copy (no per-field device
copies, no second staging buffer).
"""
from __future__ import annotations

import gc
import logging

import torch

from oasiskv.attention.base import AttentionBackend
from oasiskv.engine.block_tables import BlockTableRows
from oasiskv.engine.forward_batch import (ForwardBatch, StepRows, forward_context,
                                          packed_offsets)

logger = logging.getLogger(__name__)


def graph_buckets(max_bs: int) -> list[int]:
    """1, 2, 4, then every multiple of 8 (of 16 past 128) up to ``max_bs``. Buckets are dense
    because a bucket fixes the decode kernel's split count for its size: padding rows idle their
    programs."""
    sizes = [b for b in (1, 2, 4) if b < max_bs] + list(range(8, min(max_bs, 128), 8)) + \
        list(range(128, max_bs, 16))
    return sorted(set(sizes + [max_bs]))


class CudaGraphRunner:
    def __init__(self, model: torch.nn.Module, backend: AttentionBackend, max_bs: int,
                 max_blocks_per_seq: int, device: torch.device):
        self.model, self.backend = model, backend
        self.max_bs = max_bs
        self.buckets = graph_buckets(max_bs)
        self.rows_per_seq = backend.rows_per_seq
        rows = self.rows_per_seq * max_bs
        # one byte buffer, int64 fields first, block tables last (a step copies only the rows of
        # its bucket's tables): (name, dtype, shape)
        fields = [("input_ids", torch.long, (rows,)), ("positions", torch.long, (rows,)),
                  ("slot_mapping", torch.long, (rows,)),
                  ("context_lens", torch.int32, (max_bs,)),
                  ("block_tables", torch.int32, (max_bs, max_blocks_per_seq))]
        sizes = [torch.Size(shape).numel() * dtype.itemsize for _, dtype, shape in fields]
        offsets, total = packed_offsets(sizes)
        self._device_bytes = torch.zeros(total, dtype=torch.uint8, device=device)
        self._host_bytes = torch.zeros(total, dtype=torch.uint8, pin_memory=True)
        self._uploaded = torch.cuda.Event()  # after the last copy out of the host mirror
        views, host = {}, {}
        for (name, dtype, shape), n, offset in zip(fields, sizes, offsets):
            views[name] = self._device_bytes[offset:offset + n].view(dtype).view(shape)
            host[name] = self._host_bytes[offset:offset + n].view(dtype).view(shape).numpy()
        self._tables_offset = offsets[-1]
        self.static = ForwardBatch(is_prefill=False, **views)
        self.host = host  # numpy views of the mirror, by field
        self._written = [(None, 0)] * max_bs  # what the mirror's table rows hold (``fill``)
        self.host["slot_mapping"][:] = -1
        self._device_bytes.copy_(self._host_bytes)
        self.metas = backend.init_graphs(self.buckets)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self._capture()

    def _view(self, bs: int) -> ForwardBatch:
        s, rows = self.static, self.rows_per_seq * bs
        return ForwardBatch(False, s.input_ids[:rows], s.positions[:rows], s.slot_mapping[:rows],
                            s.block_tables[:bs], s.context_lens[:bs], meta=self.metas[bs])

    @torch.inference_mode()
    def _capture(self) -> None:
        # a CUDA graph destroyed by the garbage collector while another is being captured (e.g. one
        # of an engine dropped earlier) invalidates that capture: collect first, then hold it off
        gc.collect()
        gc.disable()
        try:
            self._capture_buckets()
        finally:
            gc.enable()

    def _capture_buckets(self) -> None:
        pool = None
        for bs in reversed(self.buckets):
            view = self._view(bs)
            with forward_context(view, self.backend):
                # warm-up: compiles kernels outside capture
                self.model(view.input_ids, view.positions)
                self.backend.begin_capture()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.outputs[bs] = self.model(view.input_ids, view.positions)
            self.backend.end_capture(bs)
            pool = graph.pool() if pool is None else pool
            self.graphs[bs] = graph
        torch.cuda.synchronize()
        logger.info("captured decode CUDA graphs for batch sizes %s (%d rows per sequence)",
                    self.buckets, self.rows_per_seq)

    def run(self, rows: StepRows, seqs: list, tables: BlockTableRows,
            inputs: torch.Tensor | None = None) -> torch.Tensor | None:
        """Replay for a decode step -> hidden ``[T, H]`` in the step's row order, or None when the
        step does not fit a captured layout (too many sequences, not ``rows_per_seq`` rows per
        sequence, or the backend declines): the caller runs it eagerly. ``rows``: the step's
        rows on the host (and the backend's meta); ``tables``: the sequences' block tables. Table
        columns past a row's blocks keep stale values: no kernel reads them. ``inputs``: the
        sequences' token ids ``[len(seqs)]`` on the device, copied in after the upload in place
        of ``rows.ids``' first group."""
        bs, k = len(seqs), self.rows_per_seq
        if bs > self.max_bs or len(rows.ids) != k * bs:
            return None
        padded = next(b for b in self.buckets if b >= bs)
        if not self.backend.prepare_replay(rows.meta, bs, padded):
            return None
        self._uploaded.synchronize()  # (the last step's copy out of the mirror: long done)
        h = self.host
        for j in range(k):  # row group j of the step -> rows j*padded.. of the bucket
            lo, src = j * padded, slice(j * bs, (j + 1) * bs)
            if j or inputs is None:  # (else the host's ids are placeholders: the mirror keeps
                # valid ids, which padding rows may read later)
                h["input_ids"][lo:lo + bs] = rows.ids[src]
            h["positions"][lo:lo + bs] = rows.positions[src]
            h["positions"][lo + bs:lo + padded] = 0
            h["slot_mapping"][lo:lo + bs] = rows.slots[src]
            h["slot_mapping"][lo + bs:lo + padded] = -1
        h["context_lens"][:bs] = rows.context_lens
        h["context_lens"][bs:padded] = 0
        tables.fill(seqs, h["block_tables"], self._written)
        end = self._tables_offset + h["block_tables"][:bs].nbytes
        self._device_bytes[:end].copy_(self._host_bytes[:end], non_blocking=True)
        self._uploaded.record()
        if inputs is not None:
            self.static.input_ids[:bs].copy_(inputs)
        self.graphs[padded].replay()
        out = self.outputs[padded]
        return torch.cat([out[j * padded:j * padded + bs] for j in range(k)]) if k > 1 else out[:bs]
