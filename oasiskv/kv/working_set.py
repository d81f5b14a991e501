"""WorkingSet: the HBM part of tiered KV. Per (sequence slot, layer, kv-head): K resident block
slots plus the local block, and the head-wise mapping from slot to the sequence's logical block.

Per layer: ``k``/``v`` ``[S, Hk, W, B, D]`` (W = K + 1; slot W-1 is the local block, always
resident, never evicted), ``map`` int32 ``[S, Hk, W]`` logical block held by each slot (-1 empty;
the local slot's entry stays -1: its length comes from the sequence's position), ``last`` int64
``[S, Hk, K]`` the step each slot was last selected (the LRU key). Heads of one layer hold different
blocks.

Open blocks (8-bit storage with ``open_blocks``): per layer also ``open_k``/``open_v``
``[S, Hk, B, D]`` in the model's dtype, each sequence slot's local block as computed
(``kernels/fp8.py``); the local slot W-1 keeps its 8-bit copy too (summaries and ``promote_local``
read that), decode attention reads the open one.

Invariants: a slot's contents are readable only after the copy that filled it (on one stream, stream
order guarantees it); a logical block appears at most once per (sequence, layer, head).
"""
from __future__ import annotations

import torch

from oasiskv.kernels.dispatch import kernel
from oasiskv.kernels.fp8 import OpenBlocks, as_bytes, dequantize, empty_kv
from oasiskv.kv.host_store import HostStore
from oasiskv.kv.layout import TieredLayout

# UVA gather grid (programs, slices in flight each) by storage: 16-bit slices (4 KiB), 8 x 4 move
# 51 GB/s (93% of PCIe) on the H200 and overlap a memory-bound decode GEMM on another stream by 0.87
# (64 x 1, the old grid: 0.76); FP8 slices (2 KiB + scales) need twice the slices in flight: 8 x 4
# moves 26.8 GB/s, 16 x 8 49.7 (docs/benchmarks.md, the uva_gather tables).
_GATHER_GRID = {False: (8, 4), True: (16, 8)}


class WorkingSet:
    def __init__(self, layout: TieredLayout, num_slots: int, device: torch.device,
                 open_blocks: bool = False):
        self.layout, self.num_slots = layout, num_slots
        L, H, W, B, D = (layout.num_layers, layout.num_kv_heads, layout.slots, layout.block_size,
                         layout.head_dim)
        layers = [empty_kv((num_slots, H, W, B, D), layout.storage_dtype, device, zero=True)
                  for _ in range(L)]
        #: per layer ``[S, Hk, W, B, D]``; 8-bit: ``scales[layer]`` = float32 (k, v)
        #: ``[S, Hk, W, B]``
        self.k, self.v, self.scales = (list(x) for x in zip(*layers))
        self.map = [torch.full((num_slots, H, W), -1, dtype=torch.int32, device=device)
                    for _ in range(L)]
        self.last = [torch.zeros((num_slots, H, layout.topk_blocks), dtype=torch.long,
                                 device=device)
                     for _ in range(L)]
        open_shape = (num_slots, H, B, D)
        #: per layer ``[S, Hk, B, D]`` in the model's dtype (empty lists: none kept)
        self.open_k, self.open_v = ([torch.zeros(open_shape, dtype=layout.dtype, device=device)
                                     for _ in range(L if open_blocks else 0)] for _ in range(2))
        self._heads = torch.arange(H, device=device)
        self._gather = kernel("gather_blocks", device.type == "cuda")
        self._select = kernel("select_blocks", device.type == "cuda")
        self._promote = kernel("promote_local", device.type == "cuda")

    def local(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views ``[S, Hk, B, D]`` of every slot's local block at ``layer``."""
        w = self.layout.local_slot
        return self.k[layer][:, :, w], self.v[layer][:, :, w]

    def local_scales(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Views ``[S, Hk, B]`` of the local blocks' row scales (8-bit), else None."""
        scales = self.scales[layer]
        return None if scales is None else tuple(s[:, :, self.layout.local_slot] for s in scales)

    def opened(self, layer: int, slots: torch.Tensor) -> OpenBlocks | None:
        """The open blocks of rows in sequence slots ``slots`` (int32 ``[N]``) at ``layer``, for
        sparse decode; None where none are kept."""
        return OpenBlocks(self.open_k[layer], self.open_v[layer], slots) if self.open_k else None

    def open_from_local(self, layer: int, slots: torch.Tensor) -> None:
        """Fill the open blocks of ``slots`` ``[N]`` with their local blocks' 8-bit rows,
        dequantized (a sequence seeded from a host store: its local block as computed is not
        here)."""
        if self.open_k:
            slots = slots.long()
            k_local, v_local = self.local(layer)
            for opened, local, scale in zip((self.open_k, self.open_v), (k_local, v_local),
                                            self.local_scales(layer)):
                rows = as_bytes(local)[slots].view(local.dtype)
                opened[layer][slots] = dequantize(rows, scale[slots]).to(opened[layer].dtype)

    def reset(self, layer: int, slots: torch.Tensor) -> None:
        """Forget what ``slots`` held at ``layer`` (a sequence is being seeded)."""
        self.map[layer][slots] = -1
        self.last[layer][slots] = 0

    def plan(self, layer: int, slots: torch.Tensor, block_tables: torch.Tensor,
             scores: torch.Tensor, cap: int, now: torch.Tensor,
             counters: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Update the residency tables of rows ``slots`` for a selection from ``scores`` (float32,
        used as scratch) at step stamp ``now`` (0-d device tensor); returns (host block ids, slots),
        int64 ``[N, Hk, cap]``, -1 = nothing, to hand to ``fetch``. Hits, misses and admitted blocks
        are added to ``counters[:3]`` when given."""
        if counters is None:
            counters = torch.zeros(3, dtype=torch.long, device=scores.device)
        return self._select(scores, self.map[layer], self.last[layer], slots, block_tables,
                            self.layout.topk_blocks, cap, now, counters)

    def fetch(self, layer: int, host: HostStore, slots: torch.Tensor, host_blocks: torch.Tensor,
              dst_slots: torch.Tensor) -> None:
        """Copy host blocks ``host_blocks`` ``[N, Hk, X]`` (-1 = skip) of head h into working-set
        slot ``dst_slots[n, h, x]`` of sequence slot ``slots[n]``."""
        self.gather(layer, host, self.copy_list(slots, host_blocks, dst_slots))

    def copy_list(self, slots: torch.Tensor, host_blocks: torch.Tensor,
                  dst_slots: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The slices ``fetch`` moves, as int64 ``[3, N * Hk * X]`` rows (host block id, -1 = skip;
        kv head; flat working-set slot of the layer), written into ``out`` when given (that
        shape). ``gather`` maps the ids to the store's rows when it runs (a lookahead tail runs
        after its selection: a ``HostCache`` may give the blocks rows in between)."""
        n, heads, x = host_blocks.shape
        head = self._heads.view(1, heads, 1).expand(n, heads, x)
        flat_dst = ((slots.long().view(n, 1, 1) * heads + head) * self.layout.slots
                    + dst_slots.clamp(min=0))
        items = torch.stack([host_blocks, head, flat_dst]).view(3, -1)
        return items if out is None else out.copy_(items)

    def gather(self, layer: int, host: HostStore, items: torch.Tensor,
               resident: bool = False) -> None:
        """Copy the slices of a ``copy_list`` ``[3, M]`` from the host store into ``layer``'s
        working set (``resident``: the caller made their blocks resident at the layer)."""
        ws_scales = self.scales[layer]
        scales = None if ws_scales is None else (*host.scales, *ws_scales)
        programs, in_flight = _GATHER_GRID[scales is not None]
        self._gather(host.k, host.v, layer, self.k[layer], self.v[layer],
                     host.physical_blocks(items[0], layer, ensure=not resident), items[1], items[2],
                     num_programs=programs, items_per_iter=in_flight, scales=scales)

    def promote_local(self, layer: int, slots: torch.Tensor, done: torch.Tensor,
                      block: torch.Tensor, now: torch.Tensor) -> None:
        """Rows ``done`` ``[N]`` completed their local block (logical index ``block`` ``[N]``): per
        head it moves into an empty slot, else the least recently selected one, stamped ``now``
        (the paper's rule for newly generated blocks; no fetch, so no cap). One kernel
        (``kernels/promote_local.py``)."""
        self._promote(self.k[layer], self.v[layer], self.scales[layer], self.map[layer],
                      self.last[layer], slots, done, block, now)
