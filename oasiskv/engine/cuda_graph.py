"""CudaGraphRunner: decode steps replayed from CUDA graphs captured per batch-size bucket.

Static buffers hold the largest bucket; a step of B sequences copies its ForwardBatch into the first
B rows (lookahead draft rows, when the backend captures them, into rows b..b+B of bucket b) and
replays the smallest bucket b >= B. Padding rows have slot -1 (nothing stored), context length 0
(the decode kernel skips them) and the backend's ``padding_slot``. Block tables are
``max_blocks_per_seq`` wide so the graph's kernel grids never depend on the step's contents. All
buckets share one memory pool.
"""
from __future__ import annotations

import gc
import logging

import torch

from oasiskv.attention.base import AttentionBackend
from oasiskv.engine.forward_batch import ForwardBatch, forward_context

logger = logging.getLogger(__name__)


def graph_buckets(max_bs: int) -> list[int]:
    """1, 2, 4, then every multiple of 8 (of 16 past 128) up to ``max_bs``. Buckets are dense because a
    bucket fixes the decode kernel's split count for its size: padding rows idle their programs."""
    sizes = [b for b in (1, 2, 4) if b < max_bs] + list(range(8, min(max_bs, 128), 8)) + \
        list(range(128, max_bs, 16))
    return sorted(set(sizes + [max_bs]))


class CudaGraphRunner:
    def __init__(self, model: torch.nn.Module, backend: AttentionBackend, max_bs: int,
                 max_blocks_per_seq: int, device: torch.device):
        self.model, self.backend = model, backend
        self.max_bs = max_bs
        self.buckets = graph_buckets(max_bs)
        self.draft_rows = backend.graph_draft_rows
        rows = 2 * max_bs if self.draft_rows else max_bs  # a bucket of b: b real rows, then b draft rows
        self.static = ForwardBatch(
            is_prefill=False,
            input_ids=torch.zeros(rows, dtype=torch.long, device=device),
            positions=torch.zeros(rows, dtype=torch.long, device=device),
            slot_mapping=torch.full((rows,), -1, dtype=torch.long, device=device),
            block_tables=torch.zeros((max_bs, max_blocks_per_seq), dtype=torch.int32, device=device),
            context_lens=torch.zeros(max_bs, dtype=torch.int32, device=device),
            seq_slots=torch.full((max_bs,), backend.padding_slot, dtype=torch.int32, device=device),
            draft_of=torch.arange(max_bs, device=device) if self.draft_rows else None,
        )
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.tails: dict[int, object] = {}  # the backend's graph_tail of each bucket
        self._tail_due = None  # the tail of the last replay, not yet started
        self.outputs: dict[int, torch.Tensor] = {}
        self.aux: dict[int, list[torch.Tensor]] = {}  # the model's aux hidden states, per bucket
        self._capture()

    def _view(self, bs: int) -> ForwardBatch:
        s, rows = self.static, 2 * bs if self.draft_rows else bs
        return ForwardBatch(False, s.input_ids[:rows], s.positions[:rows], s.slot_mapping[:rows],
                            s.block_tables[:bs], s.context_lens[:bs], seq_slots=s.seq_slots[:bs],
                            draft_of=s.draft_of[:bs] if self.draft_rows else None)

    @torch.inference_mode()
    def _capture(self) -> None:
        # a CUDA graph destroyed by the garbage collector while another is being captured (e.g. one of
        # an engine dropped earlier) invalidates that capture: collect first, then hold collection off
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
                self.model(view.input_ids, view.positions)  # warm-up: compiles kernels outside capture
                self.backend.join_side_streams()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.outputs[bs] = self.model(view.input_ids, view.positions)
                    self.backend.join_side_streams()
                self.tails[bs] = self.backend.graph_tail()
                self.aux[bs] = list(self.model.aux_hidden_states)
            pool = graph.pool() if pool is None else pool
            self.graphs[bs] = graph
        torch.cuda.synchronize()
        logger.info("captured decode CUDA graphs for batch sizes %s%s", self.buckets,
                    " (with draft rows)" if self.draft_rows else "")

    def can_run(self, bs: int) -> bool:
        return bs <= self.max_bs

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """Replay for a decode ``batch`` (tables at most ``max_blocks_per_seq`` wide; with draft rows, one
        per sequence) -> hidden ``[T, H]`` in the batch's row order.
        Table columns past a row's blocks keep stale values: no kernel reads them. Padding rows get
        position 0 (their draft rows 1), no slot, context length 0 and the backend's padding slot."""
        bs = batch.context_lens.shape[0]
        padded = next(b for b in self.buckets if b >= bs)
        s = self.static
        parts = [(0, slice(0, bs), 0)]  # (first static row, the batch's rows, padding rows' position)
        if self.draft_rows:
            parts.append((padded, slice(bs, 2 * bs), 1))
        for lo, src, pad_position in parts:
            s.input_ids[lo:lo + bs].copy_(batch.input_ids[src])
            s.positions[lo:lo + bs].copy_(batch.positions[src])
            s.positions[lo + bs:lo + padded].fill_(pad_position)
            s.slot_mapping[lo:lo + bs].copy_(batch.slot_mapping[src])
            s.slot_mapping[lo + bs:lo + padded].fill_(-1)
        s.block_tables[:bs, :batch.block_tables.shape[1]].copy_(batch.block_tables)
        s.context_lens[:bs].copy_(batch.context_lens)
        s.seq_slots[:bs].copy_(batch.seq_slots)
        s.context_lens[bs:padded].fill_(0)
        s.seq_slots[bs:padded].fill_(self.backend.padding_slot)
        self.graphs[padded].replay()  # it waits itself for what the last step left on side streams
        self._tail_due = self.tails[padded]
        if self.model.aux_layers:  # drafters read the real rows' features after the step
            assert self.aux[padded], "graphs captured before the model's aux_layers were set"
            self.model.aux_hidden_states = [a[:bs] for a in self.aux[padded]]
        out = self.outputs[padded]
        return torch.cat([out[:bs], out[padded:padded + bs]]) if self.draft_rows else out[:bs]

    def finish_step(self) -> None:
        """Start the last replay's tail (the backend's work that outlives the graph, e.g. the lookahead
        copies). Call once the step's outputs have been read, and before the next forward."""
        tail, self._tail_due = self._tail_due, None
        if tail is not None:
            self.backend.run_graph_tail(tail)
