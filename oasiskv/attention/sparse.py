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
  Draft rows attend in the same kernel call as their rows (each K/V tile read once for both): the
  real token's working set and local block plus their own K/V, which is never written anywhere.
  ``prefetch=async`` runs it on side streams (``kv/prefetch.py``): the foreground goes on with the
  next layers and waits only on that layer's event at the next step; ``inline`` runs it here.
With K >= the number of complete blocks and no cap, every block stays resident: dense attention.

CUDA graphs: decode reads only the batch's tensors and device state (the step stamp ``_now`` is a
device scalar), so it is captured like dense decode. Graph padding rows use a scratch working-set
slot (``padding_slot``, never handed out) at position 0: they select, fetch and summarise nothing.
With a drafter that guesses for every sequence the graph carries one draft row per row; a step where
some sequence has no guess runs eagerly. Inside a graph only the selections are captured (they overlap
layers l+1.. and are joined when the step ends); each layer's copy is the graph's tail (``graph_tail``),
launched on the copy stream after the replay (``run_graph_tail``), so it overlaps the host's work
between steps and the next step's layers ..l-1; that step's layer l waits for it. Eager steps leave
their stages pending until the next step reaches layer l.
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
from oasiskv.kv.prefetch import PrefetchPipeline, Tail
from oasiskv.kv.summaries import SummaryStore
from oasiskv.kv.working_set import WorkingSet

logger = logging.getLogger(__name__)

DEFAULT_HOST_GIB = 4.0
CPU_HBM_BYTES = 4 << 30  # without a GPU, working sets + summaries get this much ordinary memory


def host_blocks_for(gib: float, layout: TieredLayout) -> int:
    """Host blocks that ``gib`` GiB hold (K and V)."""
    return int(gib * 2**30 // layout.host_block_bytes)


class SparseBackend(AttentionBackend):
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
        self._now = torch.zeros((), dtype=torch.long, device=device)  # decode step stamp (LRU key)
        self._draft_rows: torch.Tensor | None = None  # this decode step's q row of each row's draft
        # hits, misses, fetched, decode rows: summed on the device, read once per step
        self._counters = torch.zeros(4, dtype=torch.long, device=device)
        self.pipeline = PrefetchPipeline(model_config.num_layers, device,
                                         config.prefetch == "async" and bool(config.draft), config.measure_stall)
        #: per layer, int64 ``[3, max_num_seqs * Hk * cap]``: the lookahead fetch's copy list (``copy_list``
        #: rows), allocated with the storage, outside any graph pool: the copy a replay leaves behind reads
        #: it after the graph is done (and another bucket's replay may reuse the pool)
        self._copy_lists: list[torch.Tensor] = []
        #: callables (kind, layer, seq slots [N], top-K blocks [N, Hk, K']) told, per decode step and layer,
        #: the current query's top-K ("current") and, with lookahead, the predicted one for the next step
        self.observers: list = []

    # ---- storage ---------------------------------------------------------------------------------
    def allocate(self, budget_bytes: int | None) -> None:
        lay, pinned = self.layout, self.device.type == "cuda"
        num_physical = host_blocks_for(self.config.host_kv_gib or DEFAULT_HOST_GIB, lay)
        num_host_blocks = max(num_physical, host_blocks_for(self.config.emulated_host_gib, lay))
        summary_bytes = num_host_blocks * lay.summary_bytes_per_block
        budget = CPU_HBM_BYTES if budget_bytes is None else budget_bytes
        # one working set more than the slots handed out: the scratch slot of graph padding rows
        slots = min(self.config.max_num_seqs, (budget - summary_bytes) // lay.working_set_bytes - 1)
        if slots < 1:
            raise RuntimeError(f"no HBM left for two working sets ({lay.working_set_bytes / 2**20:.0f} MiB) after "
                               f"{summary_bytes / 2**30:.2f} GiB of summaries: lower host_kv_gib or topk_blocks")
        self.host = HostStore(lay, num_host_blocks, pin=pinned, num_physical=num_physical)
        self.summaries = SummaryStore(lay, num_host_blocks, self.device, self.config.score_alpha)
        self.ws = WorkingSet(lay, int(slots) + 1, self.device)  # + the graph padding rows' scratch slot
        if self.config.draft and self.config.prefetch != "off":
            items = self.config.max_num_seqs * lay.num_kv_heads * self.cap
            self._copy_lists = [torch.full((3, items), -1, dtype=torch.long, device=self.device)
                                for _ in range(lay.num_layers)]
        logger.info("tiered KV: %d host blocks (%d tokens), %d working-set slots of K=%d blocks "
                    "(%.2f GiB HBM), summaries %.2f GiB HBM, fetch cap %d blocks/head/layer/step",
                    num_host_blocks, num_host_blocks * lay.block_size, slots, lay.topk_blocks,
                    slots * lay.working_set_bytes / 2**30, summary_bytes / 2**30, self.cap)

    def make_allocator(self) -> TieredAllocator:
        self.allocator = TieredAllocator(self.host.num_blocks, self.padding_slot, self.layout.block_size)
        return self.allocator

    @property
    def max_tokens_per_seq(self) -> int:
        return self.host.num_blocks * self.layout.block_size

    @property
    def padding_slot(self) -> int:
        return self.ws.num_slots - 1

    @property
    def graph_draft_rows(self) -> bool:
        """Whether captured decode steps carry a draft row per sequence (a drafter that guesses)."""
        return self.config.draft not in ("", "none")

    def can_graph(self, batch: ForwardBatch) -> bool:
        # a draft row for every sequence means draft_of == arange(n) (the runner lists them in order)
        drafts = 0 if batch.draft_of is None else batch.draft_of.shape[0]
        wanted = batch.context_lens.shape[0] if self.graph_draft_rows else 0
        return not self.observers and drafts == wanted

    def join_side_streams(self) -> None:
        self.pipeline.join()

    def graph_tail(self) -> Tail | None:
        return self.pipeline.take_captured()

    def run_graph_tail(self, tail: Tail | None) -> None:
        if tail is not None:
            self.pipeline.run_captured(tail)

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
        self.pipeline.wait_selections()
        hits, misses, fetched, rows = self._counters.tolist()
        self._counters.zero_()
        lay = self.layout
        alloc = self.allocator
        used_slots = alloc.num_seq_slots - len(alloc.free_slots)
        stats = {"hits": hits, "misses": misses, "fetched_blocks": fetched, "deferred": misses - fetched,
                 "fetched_bytes": 2 * fetched * lay.slice_bytes, "hit_rate": hits / max(1, hits + misses),
                 "decode_rows": rows,
                 "host_bytes_in_use": (alloc.num_total_blocks - alloc.num_free_blocks) * lay.host_block_bytes,
                 "hbm_bytes_in_use": used_slots * lay.working_set_bytes
                 + self.host.num_blocks * lay.summary_bytes_per_block}
        stall = self.pipeline.stall_seconds()
        if stall is not None:  # timed only when measuring
            stats["stall_seconds"] = stall
        return stats

    # ---- forward ---------------------------------------------------------------------------------
    def forward(self, layer, q, k, v, batch: ForwardBatch, scale: float) -> torch.Tensor:
        if self.host is None:  # warm-up before storage exists
            return prefill_attention(q, k, v, batch, scale, None)
        self.pipeline.wait(layer)  # this layer's working set is the foreground's again
        host_k, host_v = self.host.layer(layer)
        self._store(k, v, host_k, host_v, self.host.physical_slots(batch.slot_mapping))
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
        self.summaries.update(layer, self.host.layer(layer)[0], self.host.physical_blocks(blocks), head, blocks, head)

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
        B = self.layout.block_size
        if layer == 0:
            self._now += 1
            self._counters[3] += (batch.context_lens > 0).sum()
        n = batch.context_lens.shape[0]  # real rows; lookahead rows follow them
        slots, pos, tables = batch.seq_slots.long(), batch.positions[:n], batch.block_tables
        local_k, local_v = self.ws.local(layer)
        self._store(k[:n], v[:n], local_k, local_v, slots * B + pos % B)
        lookahead = bool(self.config.draft)
        current = "current" if self.observers else None  # observers see this token's own scores
        if not lookahead and self.config.prefetch != "off":  # synchronous retrieval: this token's own query
            with self.pipeline.stall():
                self._select(layer, q[:n], slots, tables, pos // B, notify=current)
        elif current:
            self._notify(current, layer, slots, self.summaries.scores(layer, q[:n], tables, (pos // B).int()))
        # draft rows (lookahead) attend in the same call: the real token's working set and local block,
        # plus their own K/V passed in (never written to the working set)
        if layer == 0:
            self._draft_rows = self._draft_row_index(batch.draft_of, n)
        extra = dict(draft_rows=self._draft_rows, extra_k=k, extra_v=v) if self._draft_rows is not None else {}
        out = self._attend(q, self.ws.k[layer], self.ws.v[layer], self.ws.map[layer], batch.seq_slots,
                           (pos % B + 1).to(torch.int32), scale, **extra)
        self._complete_local_blocks(layer, slots, pos, tables, batch.context_lens > 0)
        if not lookahead:
            return out
        # step t+1's working set is chosen by the draft rows' queries (the real ones where there is no draft)
        q_next = q[:n] if batch.draft_of is None else q[:n].index_copy(0, batch.draft_of, q[n:])
        self._prefetch(layer, q_next, slots, tables, (pos + 1) // B)
        return out

    def _draft_row_index(self, draft_of: torch.Tensor | None, n: int) -> torch.Tensor | None:
        """int32 ``[n]``: the q row of each row's draft (draft j is q row n + j), -1 where none."""
        if draft_of is None:
            return None
        index = torch.full((n,), -1, dtype=torch.int32, device=self.device)
        return index.index_copy_(0, draft_of, torch.arange(n, n + draft_of.shape[0], dtype=torch.int32,
                                                           device=self.device))

    def _prefetch(self, layer: int, q: torch.Tensor, slots: torch.Tensor, tables: torch.Tensor,
                  complete: torch.Tensor) -> None:
        """Step t+1's selection and fetch for ``layer`` from the lookahead queries ``q`` ``[N, Hq, D]``."""
        if self.config.prefetch == "off":
            return
        if self.observers:  # observers read the scores on the host: keep everything on one stream
            self._select(layer, q, slots, tables, complete, notify="predicted")
            return
        now = self._now.clone()  # this step's stamp: the next step bumps _now before this stage may run
        out = self._copy_lists[layer][:, :slots.shape[0] * self.layout.num_kv_heads * self.cap]

        def select() -> torch.Tensor:
            plan = self._select(layer, q, slots, tables, complete, fetch=False, now=now)
            return self.ws.copy_list(self.host, slots, *plan, out=out)

        self.pipeline.launch(layer, select, lambda items: self.ws.gather(layer, self.host, items),
                             keep=(q, slots, tables, complete, now))

    def _select(self, layer: int, q: torch.Tensor, slots: torch.Tensor, tables: torch.Tensor,
                complete: torch.Tensor, fetch: bool = True, notify: str | None = None,
                now: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Score each row's complete blocks with ``q``, plan the capped selection (counted in the step's
        counters) and (``fetch``) copy the admitted blocks. Returns the plan: (host block ids, slots)."""
        scores = self.summaries.scores(layer, q, tables, complete.to(torch.int32))
        if notify:
            self._notify(notify, layer, slots, scores)
        plan = self.ws.plan(layer, slots, tables, scores, self.cap, self._now if now is None else now,
                            self._counters)
        if fetch:
            self.ws.fetch(layer, self.host, slots, *plan)
        return plan

    def _complete_local_blocks(self, layer: int, slots: torch.Tensor, pos: torch.Tensor, tables: torch.Tensor,
                               real: torch.Tensor) -> None:
        """Rows whose local block just filled: summarise it and move it into the working set. ``real``
        ``[N]`` is False on graph padding rows (their table rows are stale: they must write nothing)."""
        lay, B = self.layout, self.layout.block_size
        done = (pos % B == B - 1) & real
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
