"""SparseBackend (kv_mode=oasis): full KV in the host store, per-head working sets in HBM.

Prefill is dense: its K/V go straight to the host store, completed blocks get summaries, and when a
sequence's prompt is complete each head's working set is seeded with its top-K blocks by the last
prompt token's query (no cap) plus the partial last block as the local block.

Decode, per layer (synchronous retrieval): store the token's K/V in the host store and the local
block; score every complete block's summary with the token's query; select per head with the HBM
fetch cap and copy the admitted blocks from the host store (UVA gather on CUDA); attend over the K
slots + the local block; when the local block fills, summarise it and move it into the working set.
With K >= the number of complete blocks and no cap, every block stays resident: dense attention.
"""
from __future__ import annotations

import logging

import torch

from oasiskv.attention.base import AttentionBackend
from oasiskv.attention.prefill import prefill_attention
from oasiskv.config import EngineConfig, ModelConfig
from oasiskv.engine.forward_batch import ForwardBatch
from oasiskv.kernels.dispatch import kernel
from oasiskv.kv.allocator import TieredAllocator
from oasiskv.kv.host_store import HostStore
from oasiskv.kv.layout import TieredLayout
from oasiskv.kv.summaries import SummaryStore
from oasiskv.kv.working_set import WorkingSet

logger = logging.getLogger(__name__)

DEFAULT_HOST_GIB = 4.0


class SparseBackend(AttentionBackend):
    supports_cuda_graphs = False  # synchronous selection branches on the host per step

    def __init__(self, config: EngineConfig, model_config: ModelConfig, dtype: torch.dtype, device: torch.device):
        self.config, self.device = config, device
        self.layout = TieredLayout(model_config.num_layers, model_config.num_kv_heads, model_config.head_dim,
                                   config.block_size, config.topk_blocks, dtype)
        self.cap = self.layout.fetch_cap(config.fetch_ratio)
        self.host: HostStore | None = None
        self.summaries: SummaryStore | None = None
        self.ws: WorkingSet | None = None
        self.allocator: TieredAllocator | None = None
        cuda = device.type == "cuda"
        self._store, self._attend = kernel("store_kv", cuda), kernel("sparse_decode_attention", cuda)
        self._now = 0
        self._counters = torch.zeros(4, dtype=torch.long, device=device)  # hits, misses, fetched, decode rows

    # ---- storage ---------------------------------------------------------------------------------
    def allocate(self, budget_bytes: int | None) -> None:
        lay = self.layout
        host_bytes = (self.config.host_kv_gib or DEFAULT_HOST_GIB) * 2**30
        num_host_blocks = int(host_bytes // lay.host_block_bytes)
        summary_bytes = num_host_blocks * lay.summary_bytes_per_block
        if budget_bytes is None:
            slots = self.config.max_num_seqs
        else:
            slots = min(self.config.max_num_seqs, (budget_bytes - summary_bytes) // lay.working_set_bytes)
        if slots < 1:
            raise RuntimeError(f"no HBM left for one working set ({lay.working_set_bytes / 2**20:.0f} MiB) after "
                               f"{summary_bytes / 2**30:.2f} GiB of summaries: lower host_kv_gib or topk_blocks")
        self.host = HostStore(lay, num_host_blocks, pin=self.device.type == "cuda")
        self.summaries = SummaryStore(lay, num_host_blocks, self.device, self.config.score_alpha)
        self.ws = WorkingSet(lay, int(slots), self.device)
        logger.info("tiered KV: %d host blocks (%d tokens), %d working-set slots of K=%d blocks "
                    "(%.2f GiB HBM), summaries %.2f GiB HBM, fetch cap %d blocks/head/layer/step",
                    num_host_blocks, num_host_blocks * lay.block_size, slots, lay.topk_blocks,
                    slots * lay.working_set_bytes / 2**30, summary_bytes / 2**30, self.cap)

    def make_allocator(self) -> TieredAllocator:
        self.allocator = TieredAllocator(self.host.num_blocks, self.ws.num_slots, self.layout.block_size)
        return self.allocator

    @property
    def max_tokens_per_seq(self) -> int:
        return self.host.num_blocks * self.layout.block_size

    def decode_read_bytes(self, context_lens: list[int]) -> int:
        """Working-set slots actually attended (at most K full blocks + the local block) plus the summaries
        of every complete block (scored each step)."""
        lay, B = self.layout, self.layout.block_size
        per_token = lay.host_block_bytes // B
        total = 0
        for n in context_lens:
            complete = (n - 1) // B
            total += (min(complete, lay.topk_blocks) * B + (n - complete * B)) * per_token
            total += complete * lay.summary_bytes_per_block
        return total

    def step_stats(self) -> dict[str, float]:
        hits, misses, fetched, rows = self._counters.tolist()
        self._counters.zero_()
        lay = self.layout
        alloc = self.allocator
        used_slots = alloc.num_seq_slots - len(alloc.free_slots)
        return {"hits": hits, "misses": misses, "fetched_blocks": fetched, "deferred": misses - fetched,
                "fetched_bytes": 2 * fetched * lay.slice_bytes, "hit_rate": hits / max(1, hits + misses),
                "decode_rows": rows,
                "host_bytes_in_use": (alloc.num_total_blocks - alloc.num_free_blocks) * lay.host_block_bytes,
                "hbm_bytes_in_use": used_slots * lay.working_set_bytes
                + self.host.num_blocks * lay.summary_bytes_per_block}

    # ---- forward ---------------------------------------------------------------------------------
    def forward(self, layer, q, k, v, batch: ForwardBatch, scale: float) -> torch.Tensor:
        if self.host is None:  # warm-up before storage exists
            return prefill_attention(q, k, v, batch, scale, None)
        host_k, host_v = self.host.layer(layer)
        self._store(k, v, host_k, host_v, batch.slot_mapping)
        if batch.is_prefill:
            return self._prefill(layer, q, k, v, batch, scale)
        return self._decode(layer, q, k, v, batch, scale)

    def _prefill(self, layer, q, k, v, batch: ForwardBatch, scale: float) -> torch.Tensor:
        B = self.layout.block_size
        out = prefill_attention(q, k, v, batch, scale, lambda i, n: self._host_prefix(layer, batch, i, n))
        ends = torch.tensor(batch.query_lens).cumsum(0).tolist()
        for i, (n, prefix) in enumerate(zip(batch.query_lens, batch.prefix_lens)):
            table = batch.block_tables[i]
            self._summarise(layer, table[prefix // B:(prefix + n) // B])
            if batch.last_chunk[i]:
                self._seed(layer, q[ends[i] - 1], table, prefix + n, batch.seq_slots[i:i + 1])
        return out

    def _host_prefix(self, layer: int, batch: ForwardBatch, row: int, length: int):
        """K, V of a sequence's first ``length`` tokens from the host store, ``[Hk, length, D]``."""
        blocks = batch.block_tables[row, : -(-length // self.layout.block_size)]
        k, v = self.host.read_blocks(layer, blocks, self.device)
        heads, dim = self.layout.num_kv_heads, self.layout.head_dim
        return tuple(x.transpose(0, 1).reshape(heads, -1, dim)[:, :length] for x in (k, v))

    def _summarise(self, layer: int, host_blocks: torch.Tensor) -> None:
        """Summaries of complete blocks (host ids) from the host store, every head."""
        if host_blocks.numel() == 0:
            return
        heads = self.layout.num_kv_heads
        blocks = host_blocks.long().repeat_interleave(heads)
        head = torch.arange(heads, device=blocks.device).repeat(host_blocks.numel())
        self.summaries.update(layer, self.host.layer(layer)[0], blocks, head, blocks, head)

    def _seed(self, layer: int, q_last: torch.Tensor, table: torch.Tensor, length: int, slot: torch.Tensor) -> None:
        """First working set of a sequence whose prompt (``length`` tokens) is complete: its top-K blocks
        by the last token's query, fetched without cap, and the partial last block as the local block."""
        B, K, heads = self.layout.block_size, self.layout.topk_blocks, self.layout.num_kv_heads
        slot = slot.long()
        self.ws.reset(layer, slot)
        complete = length // B
        if complete:
            scores = self.summaries.scores(layer, q_last[None], table[None, :complete],
                                           torch.tensor([complete], dtype=torch.int32, device=self.device))
            self.ws.select_and_fetch(layer, self.host, slot, table[None, :complete], scores, cap=K, now=self._now)
        if length % B:
            local = torch.full((1, heads, 1), self.layout.local_slot, dtype=torch.long, device=self.device)
            self.ws.fetch(layer, self.host, slot, table[complete].long().view(1, 1, 1).expand(1, heads, 1), local)

    def _decode(self, layer, q, k, v, batch: ForwardBatch, scale: float) -> torch.Tensor:
        lay = self.layout
        B = lay.block_size
        if layer == 0:
            self._now += 1
        slots = batch.seq_slots
        pos = batch.positions
        local_k, local_v = self.ws.local(layer)
        self._store(k, v, local_k, local_v, slots.long() * B + pos % B)
        complete = (pos // B).to(torch.int32)
        scores = self.summaries.scores(layer, q, batch.block_tables, complete)
        sel = self.ws.select_and_fetch(layer, self.host, slots.long(), batch.block_tables, scores, self.cap, self._now)
        self._counters += torch.stack([sel.hits, sel.misses, sel.admitted, sel.hits.new_tensor(len(pos) * (layer == 0))])
        out = self._attend(q, self.ws.k[layer], self.ws.v[layer], self.ws.map[layer], slots,
                           (pos % B + 1).to(torch.int32), scale)
        done = pos % B == B - 1
        host_block = batch.block_tables.long().gather(1, (pos // B)[:, None])[:, 0]
        heads = self._heads(len(pos))
        self.summaries.update(layer, local_k, slots.long().repeat_interleave(lay.num_kv_heads), heads,
                              torch.where(done, host_block, -1).repeat_interleave(lay.num_kv_heads), heads)
        self.ws.promote_local(layer, slots.long(), done, pos // B, self._now)
        return out

    def _heads(self, rows: int) -> torch.Tensor:
        return torch.arange(self.layout.num_kv_heads, device=self.device).repeat(rows)
