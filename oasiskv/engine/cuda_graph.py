"""CudaGraphRunner: decode steps replayed from CUDA graphs captured per batch-size bucket.

Static buffers hold the largest bucket; a step of B sequences copies its ForwardBatch into the first
B rows and replays the smallest bucket >= B. Padding rows have slot -1 (nothing stored) and context
length 0 (the decode kernel skips them). Block tables are ``max_blocks_per_seq`` wide so the graph's
kernel grids never depend on the step's contents. All buckets share one memory pool.
"""
from __future__ import annotations

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
        self.static = ForwardBatch(
            is_prefill=False,
            input_ids=torch.zeros(max_bs, dtype=torch.long, device=device),
            positions=torch.zeros(max_bs, dtype=torch.long, device=device),
            slot_mapping=torch.full((max_bs,), -1, dtype=torch.long, device=device),
            block_tables=torch.zeros((max_bs, max_blocks_per_seq), dtype=torch.int32, device=device),
            context_lens=torch.zeros(max_bs, dtype=torch.int32, device=device),
            seq_slots=torch.full((max_bs,), -1, dtype=torch.int32, device=device),
        )
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self._capture()

    def _view(self, bs: int) -> ForwardBatch:
        s = self.static
        return ForwardBatch(False, s.input_ids[:bs], s.positions[:bs], s.slot_mapping[:bs],
                            s.block_tables[:bs], s.context_lens[:bs], seq_slots=s.seq_slots[:bs])

    @torch.inference_mode()
    def _capture(self) -> None:
        pool = None
        for bs in reversed(self.buckets):
            view = self._view(bs)
            with forward_context(view, self.backend):
                self.model(view.input_ids, view.positions)  # warm-up: compiles kernels outside capture
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.outputs[bs] = self.model(view.input_ids, view.positions)
            pool = graph.pool() if pool is None else pool
            self.graphs[bs] = graph
        torch.cuda.synchronize()
        logger.info("captured decode CUDA graphs for batch sizes %s", self.buckets)

    def can_run(self, bs: int) -> bool:
        return bs <= self.max_bs

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """Replay for a decode ``batch`` (tables at most ``max_blocks_per_seq`` wide) -> hidden ``[B, H]``.
        Table columns past a row's blocks keep stale values: the decode kernel never reads them."""
        bs = batch.num_tokens
        padded = next(b for b in self.buckets if b >= bs)
        s = self.static
        s.input_ids[:bs].copy_(batch.input_ids)
        s.positions[:bs].copy_(batch.positions)
        s.slot_mapping[:bs].copy_(batch.slot_mapping)
        s.block_tables[:bs, :batch.block_tables.shape[1]].copy_(batch.block_tables)
        s.context_lens[:bs].copy_(batch.context_lens)
        s.seq_slots[:bs].copy_(batch.seq_slots)
        s.slot_mapping[bs:padded].fill_(-1)
        s.context_lens[bs:padded].fill_(0)
        s.seq_slots[bs:padded].fill_(-1)
        self.graphs[padded].replay()
        return self.outputs[padded][:bs]
