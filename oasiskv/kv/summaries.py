"""SummaryStore: per (host block, kv-head) element-wise max and min of the block's post-RoPE keys,
in HBM.

Indexed by host block id, one table per layer: ``[num_host_blocks, Hk, 2, D]``, in the model's
dtype or (``summary_dtype=fp8``) as FP8 rows with a float32 scale each (``[num_host_blocks, Hk,
2]``, ``kernels/fp8.py``): half the HBM, and half the bytes every selection scans. A block's
summary is written once, when the block completes (prefill, or the local block filling during
decode), and is readable by scoring from then on. Scoring follows the Quest bound: for a box [min,
max] the largest q.k is q.c + |q|.r with c = (max + min)/2, r = (max - min)/2; a kv-head's score
sums it over the query heads that share the kv-head, with ``alpha`` weighting the radius term.
"""
from __future__ import annotations

import torch

from oasiskv.kernels.dispatch import kernel
from oasiskv.kernels.fp8 import as_bytes, empty_rows
from oasiskv.kv.layout import TieredLayout


class SummaryStore:
    def __init__(self, layout: TieredLayout, num_host_blocks: int, device: torch.device,
                 alpha: float):
        shape = (num_host_blocks, layout.num_kv_heads, 2, layout.head_dim)
        self.tables, self.scales = map(list, zip(*(
            empty_rows(shape, layout.summary_storage_dtype, device, zero=True)
            for _ in range(layout.num_layers))))
        self.alpha = alpha
        cuda = device.type == "cuda"
        self._minmax, self._scores = kernel("block_minmax", cuda), kernel("block_scores", cuda)

    def update(self, layer: int, src: torch.Tensor, idx0: torch.Tensor, idx1: torch.Tensor,
               dst_block: torch.Tensor, dst_head: torch.Tensor,
               src_scale: torch.Tensor | None = None) -> None:
        """Summarise complete blocks ``src[idx0[i], idx1[i]]`` (src a ``[I0, I1, B, D]`` view; FP8:
        with its row scales ``[I0, I1, B]``) into (``dst_block[i]``, ``dst_head[i]``) of ``layer``;
        entries with ``dst_block < 0`` are skipped."""
        self._minmax(src, idx0, idx1, self.tables[layer], dst_block, dst_head, src_scale=src_scale,
                     summary_scale=self.scales[layer])

    def _parts(self) -> list[list[torch.Tensor]]:
        """The per-layer tables, then (FP8) the per-layer scales."""
        return [self.tables] + ([self.scales] if self.scales[0] is not None else [])

    def read(self, blocks: list[int]) -> list[torch.Tensor]:
        """The summaries of complete host ``blocks`` at every layer, on the CPU (what another
        engine ``write``s): ``[L, n, Hk, 2, D]`` in their storage dtype, then (FP8 summaries)
        their scales ``[L, n, Hk, 2]``."""
        index = torch.tensor(blocks, dtype=torch.long, device=self.tables[0].device)
        return [torch.stack([t[index] for t in tables]).cpu() for tables in self._parts()]

    def write(self, blocks: torch.Tensor, rows: list[torch.Tensor]) -> None:
        """Summaries made elsewhere (another engine's ``read``) into host blocks ``blocks``
        ``[n]``: ``rows`` as ``read`` returns them."""
        parts = self._parts()
        if len(rows) != len(parts):
            raise ValueError(f"summaries come in {len(rows)} parts, this store keeps "
                             f"{len(parts)} (FP8 summaries on one side only?)")
        for tables, src in zip(parts, rows):
            for layer, t in enumerate(tables):
                t[blocks] = src[layer].to(t.device, t.dtype)

    def scores(self, layer: int, q: torch.Tensor, block_tables: torch.Tensor,
               num_blocks: torch.Tensor) -> torch.Tensor:
        """q ``[N, Hq, D]`` -> float32 ``[N, Hk, max_blocks]`` scores of each row's first
        ``num_blocks[n]`` blocks (host ids from ``block_tables``), -inf past them."""
        return self._scores(q, self.tables[layer], block_tables, num_blocks, self.alpha,
                            summary_scale=self.scales[layer])


class SummaryMirror:
    """Host copies of block summaries, laid out by block as the host store is (``[rows, L, Hk, 2,
    D]``; FP8: scales ``[rows, L, Hk, 2]``), so that NIXL moves a block's summaries in one unit. A
    prefill worker's is indexed by its host store's rows (``HostStore.rows_of``: a block's id, but
    in an emulated store) and filled when it hands a prompt off (``put``); a decode
    worker's is the staging area it reads a handoff's summaries into (``take``)."""

    def __init__(self, layout: TieredLayout, num_rows: int):
        shape = (num_rows, layout.num_layers, layout.num_kv_heads, 2, layout.head_dim)
        self.values, self.scales = empty_rows(shape, layout.summary_storage_dtype)
        self.num_rows = num_rows

    def tensors(self) -> list[torch.Tensor]:
        """The values, then the FP8 scales when present (a remote reader's region order)."""
        return [self.values] + ([self.scales] if self.scales is not None else [])

    def put(self, rows: list[int], parts: list[torch.Tensor]) -> None:
        """``parts`` (``SummaryStore.read``: ``[L, n, ...]`` each) into ``rows``."""
        index = torch.tensor(rows, dtype=torch.long)
        for t, part in zip(self.tensors(), parts):
            as_bytes(t)[index] = as_bytes(part.transpose(0, 1))

    def take(self, n: int) -> list[torch.Tensor]:
        """Rows ``0 .. n - 1`` as ``put`` takes them (``[L, n, ...]`` each, copies)."""
        return [t[:n].transpose(0, 1).clone() for t in self.tensors()]
