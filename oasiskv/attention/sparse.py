"""SparseBackend (kv_mode=oasis): full KV in the host store, per-head working sets in HBM.

Prefill is dense: its K/V go straight to the host store, completed blocks get summaries, and when a
sequence's prompt is complete each head's working set is seeded with its top-K blocks by the last
prompt token's query (no cap) plus the partial last block as the local block.

Decode, per layer: store the token's K/V in the host store and the local block; select (score every
complete block's summary, choose per head with the HBM fetch cap, copy the admitted blocks from the
host store: UVA gather on CUDA); attend over the K slots + the local block; when the local block
fills, summarise it and move it into the working set. Selection runs in one of two places:
- synchronous retrieval (``draft`` empty): before attention, with the token's own query;
- lookahead (``draft`` set): after attention, for step t+1, with the draft row's query (the guessed
  next token pushed through the layer next to the real one) or, without a guess, the real query.
  Here it is applied at once; overlapping it with the next layers is the prefetch pipeline's job.
With K >= the number of complete blocks and no cap, every block stays resident: dense attention.
"""
from __future__ import annotations

import logging
import math

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
CPU_HBM_BYTES = 4 << 30  # without a GPU, working sets + summaries get this much ordinary memory


def host_blocks_for(gib: float, layout: TieredLayout, pinned: bool) -> int:
    """Host blocks that ``gib`` GiB hold. Pinned memory comes from torch's caching host allocator,
    which rounds every allocation up to a power of two: K and V (one allocation each) are then sized
    to the largest power of two that fits, so nothing pinned goes unused (up to half the setting)."""
    per_tensor = gib * 2**30 / 2
    if pinned:
        per_tensor = 2 ** math.floor(math.log2(per_tensor))
    return int(per_tensor // (layout.host_block_bytes // 2))


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
        self._counters = torch.zeros(3, dtype=torch.long, device=device)  # hits, misses, fetched (no host sync)
        self._decode_rows = 0
        #: callables (kind, layer, seq slots [N], top-K blocks [N, Hk, K']) told, per decode step and layer,
        #: the current query's top-K ("current") and, with lookahead, the predicted one for the next step
        self.observers: list = []

    # ---- storage ---------------------------------------------------------------------------------
    def allocate(self, budget_bytes: int | None) -> None:
        lay = self.layout
        num_host_blocks = host_blocks_for(self.config.host_kv_gib or DEFAULT_HOST_GIB, lay,
                                          pinned=self.device.type == "cuda")
        summary_bytes = num_host_blocks * lay.summary_bytes_per_block
        budget = CPU_HBM_BYTES if budget_bytes is None else budget_bytes
        slots = min(self.config.max_num_seqs, (budget - summary_bytes) // lay.working_set_bytes)
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
        hits, misses, fetched = self._counters.tolist()
        rows, self._decode_rows = self._decode_rows, 0
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
                                           torch.full((1,), complete, dtype=torch.int32, device=self.device))
            self.ws.select_and_fetch(layer, self.host, slot, table[None, :complete], scores, cap=K, now=self._now)
        if length % B:
            local = torch.full((1, heads, 1), self.layout.local_slot, dtype=torch.long, device=self.device)
            self.ws.fetch(layer, self.host, slot, table[complete].long().view(1, 1, 1).expand(1, heads, 1), local)

    def _decode(self, layer, q, k, v, batch: ForwardBatch, scale: float) -> torch.Tensor:
        lay = self.layout
        B = lay.block_size
        if layer == 0:
            self._now += 1
        n = batch.context_lens.shape[0]  # real rows; lookahead rows follow them
        slots, pos, tables = batch.seq_slots.long(), batch.positions[:n], batch.block_tables
        local_k, local_v = self.ws.local(layer)
        self._store(k[:n], v[:n], local_k, local_v, slots * B + pos % B)
        if not self.config.draft:  # synchronous retrieval: select with this token's own query
            self._select(layer, q[:n], slots, tables, pos // B)
        if self.observers:
            self._notify("current", layer, slots, self.summaries.scores(layer, q[:n], tables, (pos // B).int()))
        out = self._attend(q[:n], self.ws.k[layer], self.ws.v[layer], self.ws.map[layer], batch.seq_slots,
                           (pos % B + 1).to(torch.int32), scale)
        self._complete_local_blocks(layer, slots, pos, tables)
        if not self.config.draft:
            return out
        # lookahead: draft rows attend over the same working set, the real token and themselves (their
        # K/V sit in the local block just past the real token until the next token overwrites them);
        # their queries (the real ones where a sequence has no draft) choose step t+1's working set.
        q_next = q[:n]
        if batch.draft_of is not None:
            rows = batch.draft_of
            d_pos = pos[rows] + 1
            self._store(k[n:], v[n:], local_k, local_v, slots[rows] * B + d_pos % B)
            out_draft = self._attend(q[n:], self.ws.k[layer], self.ws.v[layer], self.ws.map[layer],
                                     batch.seq_slots[rows], (d_pos % B + 1).to(torch.int32), scale)
            out = torch.cat([out, out_draft])
            q_next = q_next.index_copy(0, rows, q[n:])
        scores = self._select(layer, q_next, slots, tables, (pos + 1) // B)
        if self.observers:
            self._notify("predicted", layer, slots, scores)
        return out

    def _select(self, layer: int, q: torch.Tensor, slots: torch.Tensor, tables: torch.Tensor,
                complete: torch.Tensor) -> torch.Tensor:
        """Score each row's complete blocks with ``q``, apply the capped selection, fetch; returns scores."""
        scores = self.summaries.scores(layer, q, tables, complete.to(torch.int32))
        sel = self.ws.select_and_fetch(layer, self.host, slots, tables, scores, self.cap, self._now)
        self._counters += torch.stack([sel.hits, sel.misses, sel.admitted])
        if layer == 0:
            self._decode_rows += len(q)
        return scores

    def _complete_local_blocks(self, layer: int, slots: torch.Tensor, pos: torch.Tensor, tables: torch.Tensor) -> None:
        """Rows whose local block just filled: summarise it and move it into the working set."""
        lay, B = self.layout, self.layout.block_size
        done = pos % B == B - 1
        host_block = tables.long().gather(1, (pos // B)[:, None])[:, 0]
        heads = self._heads(len(pos))
        local_k = self.ws.local(layer)[0]
        self.summaries.update(layer, local_k, slots.repeat_interleave(lay.num_kv_heads), heads,
                              torch.where(done, host_block, -1).repeat_interleave(lay.num_kv_heads), heads)
        self.ws.promote_local(layer, slots, done, pos // B, self._now)

    def _notify(self, kind: str, layer: int, slots: torch.Tensor, scores: torch.Tensor) -> None:
        """Tell observers a per-head top-K: ``[N, Hk, K']`` block indices, -1 where fewer blocks exist."""
        values, blocks = scores.topk(min(self.layout.topk_blocks, scores.shape[-1]), dim=-1)
        blocks = torch.where(values > float("-inf"), blocks, -1)
        for observer in self.observers:
            observer(kind, layer, slots, blocks)

    def _heads(self, rows: int) -> torch.Tensor:
        return torch.arange(self.layout.num_kv_heads, device=self.device).repeat(rows)
