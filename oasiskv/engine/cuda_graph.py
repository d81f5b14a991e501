"""CudaGraphRunner: decode steps replayed from CUDA graphs captured per batch-size bucket.

Static buffers hold the largest bucket; a step of B sequences copies its ForwardBatch into them and
replays the smallest bucket b >= B. With ``k = backend.rows_per_seq`` a bucket of b runs k * b rows:
row group j (rows j*b .. j*b + b) holds the step's group j (its sequences' tokens, then each group
of the backend's extra rows), padded to b. Padding rows have slot -1 (nothing stored), position 0
and context length 0 (the decode kernels skip them); the backend pads its own ``meta`` in
``prepare_replay``. Block tables are ``max_blocks_per_seq`` wide so the graph's kernel grids never
depend on the step's contents. All buckets share one memory pool.
"""
from __future__ import annotations

import gc
import logging

import torch

from oasiskv.attention.base import AttentionBackend
from oasiskv.engine.forward_batch import ForwardBatch, forward_context

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
        self.static = ForwardBatch(
            is_prefill=False,
            input_ids=torch.zeros(rows, dtype=torch.long, device=device),
            positions=torch.zeros(rows, dtype=torch.long, device=device),
            slot_mapping=torch.full((rows,), -1, dtype=torch.long, device=device),
            block_tables=torch.zeros((max_bs, max_blocks_per_seq), dtype=torch.int32,
                                     device=device),
            context_lens=torch.zeros(max_bs, dtype=torch.int32, device=device),
        )
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

    def run(self, batch: ForwardBatch) -> torch.Tensor | None:
        """Replay for a decode ``batch`` -> hidden ``[T, H]`` in the batch's row order, or None when
        the step does not fit a captured layout (too many sequences, not ``rows_per_seq`` rows per
        sequence, or the backend declines): the caller runs it eagerly. Table columns past a row's
        blocks keep stale values: no kernel reads them."""
        bs, k = batch.num_seqs, self.rows_per_seq
        if bs > self.max_bs or batch.num_tokens != k * bs:
            return None
        padded = next(b for b in self.buckets if b >= bs)
        if not self.backend.prepare_replay(batch.meta, bs, padded):
            return None
        s = self.static
        for j in range(k):  # row group j of the step -> rows j*padded.. of the bucket
            lo, src = j * padded, slice(j * bs, (j + 1) * bs)
            s.input_ids[lo:lo + bs].copy_(batch.input_ids[src])
            s.positions[lo:lo + bs].copy_(batch.positions[src])
            s.positions[lo + bs:lo + padded].fill_(0)
            s.slot_mapping[lo:lo + bs].copy_(batch.slot_mapping[src])
            s.slot_mapping[lo + bs:lo + padded].fill_(-1)
        s.block_tables[:bs, :batch.block_tables.shape[1]].copy_(batch.block_tables)
        s.context_lens[:bs].copy_(batch.context_lens)
        s.context_lens[bs:padded].fill_(0)
        self.graphs[padded].replay()
        out = self.outputs[padded]
        return torch.cat([out[j * padded:j * padded + bs] for j in range(k)]) if k > 1 else out[:bs]
