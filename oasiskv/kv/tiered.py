"""TieredKV: the tiered KV of every layer and the operations one step applies to it.

Storage: the host store (every block of every running sequence), the summaries of complete blocks
and the per-head working sets (``allocate``). Operations, per layer: ``store`` (new K/V into the
host store), ``prefill`` (dense attention over the prompt, summaries of its complete blocks, and the
seeding of each head's working set by the last prompt token's query, without cap),
``store_decode`` (a decode step's new K/V into the host store and the local blocks, one launch) /
``attend`` (sparse attention over the K slots + the local block, draft rows included),
``complete_local_blocks`` (a filled local block is summarised and promoted into the working set)
and ``retrieve`` (score, select under the fetch cap, optionally copy). Where and when ``retrieve``
runs is the retrieval's decision (``kv/retrieval.py``); this file knows nothing of drafters or side
streams.

Per-step metadata (``TierStep``) comes from the backend's ``prepare``: each row's working-set slot,
which rows end their prefill, and the draft rows of a lookahead step. ``now`` is the decode step
stamp on the device (the LRU key): the backend bumps it before each decode step.
"""
from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field

import torch

from oasiskv.attention.prefill import prefill_attention
from oasiskv.config import TierConfig
from oasiskv.engine.forward_batch import ForwardBatch
from oasiskv.kernels.dispatch import kernel
from oasiskv.kernels.fp8 import dequantize, empty_kv, quantized
from oasiskv.kv.counters import DeviceCounters
from oasiskv.kv.host_cache import HostCache
from oasiskv.kv.host_store import HostStore
from oasiskv.kv.layout import TieredLayout
from oasiskv.kv.probes import TierProbes
from oasiskv.kv.summaries import SummaryStore
from oasiskv.kv.working_set import WorkingSet

logger = logging.getLogger(__name__)

DEFAULT_HOST_GIB = 4.0


@dataclass
class TierStep:
    """One step's tier metadata (``ForwardBatch.meta``). slots: int32 ``[N]`` working-set slot of
    each sequence row. ends_prefill: host list (prefill steps). draft_rows: int32 ``[N]`` q row of
    each row's draft, -1 where none, and draft_of: int64 ``[D]`` the row of each draft row (decode
    steps with guesses; else None). aux: layer -> residual stream ``[T, hidden]`` after that layer,
    filled during the forward for a drafter that reads target features."""
    slots: torch.Tensor
    ends_prefill: list[bool] = field(default_factory=list)
    draft_rows: torch.Tensor | None = None
    draft_of: torch.Tensor | None = None
    aux: dict[int, torch.Tensor] = field(default_factory=dict)
    #: prefill steps with open blocks: int64 ``[T]`` each token's row in them
    #: (``attention.prefill.open_block_rows``)
    open_rows: torch.Tensor | None = None
    #: set at the forward's first layer: host slots of the step's tokens, and a decode step's rows
    host_slots: torch.Tensor | None = None
    rows: DecodeRows | None = None
    #: prefill steps: row -> the last prompt token's query at each layer so far, for the rows whose
    #: prompt is handed off to another engine (``engine/handoff.py``)
    queries: dict[int, list[torch.Tensor]] = field(default_factory=dict)


@dataclass
class DecodeRows:
    """A decode step's per-row index tensors for its N sequence rows, computed once per forward
    (``TieredKV.decode_rows``, at the first layer; inside a captured graph, so replays recompute
    them) and read by every layer, so no layer repeats this index arithmetic.

    slots, block: int64 ``[N]`` each row's working-set slot and the logical index of its local
    block (pos // B). local_index: int64 ``[N]`` the new token's row in the flattened local blocks.
    local_lens: int32 ``[N]`` tokens of the local block attended (pos % B + 1). complete,
    complete_next: int32 ``[N]`` complete blocks before and after this token. done: bool ``[N]``
    the token filled its local block (False on padding rows). summary_src, summary_heads,
    summary_dst: int64 ``[N * Hk]`` per (row, kv head): slot, head, and the host block a filled
    local block is summarised into (-1: none). now: 0-d int64, this step's stamp (a copy: the next
    step bumps ``TieredKV.now`` before this step's side stages may run)."""
    slots: torch.Tensor
    block: torch.Tensor
    local_index: torch.Tensor
    local_lens: torch.Tensor
    complete: torch.Tensor
    complete_next: torch.Tensor
    done: torch.Tensor
    summary_src: torch.Tensor
    summary_heads: torch.Tensor
    summary_dst: torch.Tensor
    now: torch.Tensor


def _k_scale(scales: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor | None:
    """The K half of a (k, v) scale pair (summaries are of keys), None without FP8."""
    return None if scales is None else scales[0]


def host_blocks_for(gib: float, layout: TieredLayout) -> int:
    """Host blocks that ``gib`` GiB hold (K and V)."""
    return int(gib * 2**30 // layout.host_block_bytes)


def configured_host_blocks(tier: TierConfig, layout: TieredLayout) -> int:
    """Host blocks the store of ``tier`` holds (``host_kv_gib``, default ``DEFAULT_HOST_GIB``)."""
    return host_blocks_for(tier.host_kv_gib or DEFAULT_HOST_GIB, layout)


class TieredKV:
    """``open_blocks``: beside 8-bit storage, keep each sequence's local block in the model's dtype
    too and attend it from there (``WorkingSet``; ``kv_open_block=model``)."""

    def __init__(self, layout: TieredLayout, config: TierConfig, device: torch.device,
                 probes: TierProbes, open_blocks: bool = False):
        self.layout, self.config, self.device, self.probes = layout, config, device, probes
        self.open_blocks = open_blocks and quantized(layout.storage_dtype)
        self.cap = layout.fetch_cap(config.fetch_ratio)
        self.host: HostStore | None = None
        self.summaries: SummaryStore | None = None
        self.ws: WorkingSet | None = None
        cuda = device.type == "cuda"
        self._store, self._attend = (kernel("store_kv", cuda),
                                     kernel("sparse_decode_attention", cuda))
        self._gather = kernel("gather_blocks", cuda)
        self.now = torch.zeros((), dtype=torch.long, device=device)  # decode step stamp (LRU key)
        #: per layer: the selection kernel adds hits, misses and admitted blocks, in this order;
        #: ``stall`` the foreground's device-clock nanoseconds waiting for retrieval
        self.counters = DeviceCounters(("hits", "misses", "fetched_blocks", "stall_ns"), device,
                                       rows=layout.num_layers)
        self._clock = kernel("clock_add", cuda) if config.measure_stall else None
        if self._clock is not None:
            with self.stall(0):  # compile the marks now, not first inside a capture
                pass
            self.counters.tensor.zero_()

    @contextlib.contextmanager
    def stall(self, layer: int):
        """Time the foreground work inside (waiting for, or running in line, ``layer``'s selection
        and fetch) on the device clock into the layer's ``stall_ns`` counter: clock marks
        (``kernels/device_clock.py``) before and after it on the stream, in graph replays too.
        Nothing with ``measure_stall`` off."""
        if self._clock is None:
            yield
            return
        acc = self.counters.tensor[layer, 3:]
        self._clock(acc, -1)
        try:
            yield
        finally:
            self._clock(acc, 1)

    # ---- storage ---------------------------------------------------------------------------------
    def make_host_store(self) -> HostStore:
        """The host store ``host_kv_gib`` sizes: a ``HostCache`` of ``1 / f_host`` times as many
        block ids with ``f_host < 1``, else the probes' factory when given."""
        lay = self.layout
        blocks = configured_host_blocks(self.config, lay)
        pin = self.device.type == "cuda"
        if self.config.f_host < 1.0:
            return HostCache(lay, int(blocks / self.config.f_host), pin, blocks, self.device,
                             self.config.f_host)
        make = self.probes.host_store or HostStore
        return make(lay, blocks, pin)

    def allocate(self, host: HostStore, num_slots: int) -> None:
        """Summaries for every host block id and ``num_slots`` working sets (one of them the graph
        padding rows' scratch slot)."""
        self.host = host
        self.summaries = SummaryStore(self.layout, host.num_blocks, self.device,
                                      self.config.score_alpha)
        self.ws = WorkingSet(self.layout, num_slots, self.device, self.open_blocks)

    @property
    def slot_bytes(self) -> int:
        """HBM one sequence slot takes: its working sets, and its open blocks where kept."""
        lay = self.layout
        return lay.working_set_bytes + (lay.open_block_bytes if self.open_blocks else 0)

    # ---- prefill ---------------------------------------------------------------------------------
    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor,
              host_slots: torch.Tensor) -> None:
        """Write the step's K/V ``[T, Hk, D]`` into the host store at ``host_slots`` ``[T]``
        (``host.physical_slots`` of the slot mapping; negative slots skipped)."""
        host_k, host_v = self.host.layer(layer)
        self._store(k, v, host_k, host_v, host_slots, scales=self.host.layer_scales(layer),
                    v_layout=False)

    def prefill(self, layer: int, q, k, v, batch: ForwardBatch, scale: float) -> torch.Tensor:
        """Dense attention over each sequence's prompt (a chunk's prefix read from the host store,
        a partly written last block of it from its open block where kept), summaries of the blocks
        the step completed, and seeding where the step ends a prefill. The step's tokens go into
        the open blocks after attention (a chunk may reuse the slot its prefix's block is in)."""
        B, step = self.layout.block_size, batch.meta
        out = prefill_attention(q, k, v, batch, scale,
                                lambda i, n: self._prefix(layer, batch, i, n))
        if self.open_blocks:
            self._store(k, v, self.ws.open_k[layer], self.ws.open_v[layer], step.open_rows)
        end = 0
        for i, (n, prefix) in enumerate(zip(batch.query_lens, batch.prefix_lens)):
            end += n
            table = batch.block_tables[i]
            self._summarise(layer, table[prefix // B:(prefix + n) // B])
            if step.ends_prefill[i]:
                self._seed(layer, q[end - 1], table, prefix + n, step.slots[i:i + 1])
                if i in step.queries:  # (a prompt handed off: its query at every layer)
                    step.queries[i].append(q[end - 1].float())
        return out

    def _prefix(self, layer: int, batch: ForwardBatch, i: int, length: int):
        """Prefill row ``i``'s cached prefix of ``length`` tokens (``host_kv``), its partly written
        last block from the sequence's open block where those are kept."""
        k, v = self.host_kv(layer, batch.block_tables[i], length)
        part = length % self.layout.block_size
        if self.open_blocks and part:
            slot = batch.meta.slots[i].long()
            k[:, length - part:] = self.ws.open_k[layer][slot, :, :part]
            v[:, length - part:] = self.ws.open_v[layer][slot, :, :part]
        return k, v

    def host_kv(self, layer: int, table: torch.Tensor, length: int):
        """K, V at ``layer`` of a sequence's first ``length`` tokens, ``[Hk, length, D]`` in the
        model's dtype, from the host blocks ``table`` names (``[>= ceil(length / B)]``), gathered
        from the host store straight into device memory (UVA on CUDA: no copy through the CPU)."""
        lay = self.layout
        heads, B, D = lay.num_kv_heads, lay.block_size, lay.head_dim
        blocks = table[: -(-length // B)].long()
        n = blocks.shape[0]
        k, v, scales = empty_kv((n * heads, B, D), lay.storage_dtype, self.device)
        head = torch.arange(heads, device=self.device).repeat(n)
        self._gather(self.host.k, self.host.v, layer, k, v,
                     self.host.physical_blocks(blocks.repeat_interleave(heads), layer), head,
                     torch.arange(n * heads, device=self.device),
                     scales=None if scales is None else (*self.host.scales, *scales))
        if scales is not None:
            k, v = (dequantize(x, s).to(lay.dtype) for x, s in zip((k, v), scales))
        return tuple(x.view(n, heads, B, D).transpose(0, 1).reshape(heads, -1, D)[:, :length]
                     for x in (k, v))

    def summarise(self, host_blocks: torch.Tensor) -> None:
        """Summaries at every layer of complete host blocks whose contents were written from
        outside a forward (imported from another engine's host store)."""
        for layer in range(self.layout.num_layers):
            self._summarise(layer, host_blocks)

    def _summarise(self, layer: int, host_blocks: torch.Tensor) -> None:
        """Summaries of complete blocks (host ids) from the host store, every head."""
        if host_blocks.numel() == 0:
            return
        heads = self.layout.num_kv_heads
        blocks = host_blocks.long().repeat_interleave(heads)
        head = torch.arange(heads, device=blocks.device).repeat(host_blocks.numel())
        self.summaries.update(layer, self.host.layer(layer)[0],
                              self.host.physical_blocks(blocks, layer),
                              head, blocks, head, _k_scale(self.host.layer_scales(layer)))

    def _seed(self, layer: int, q_last: torch.Tensor, table: torch.Tensor, length: int,
              slot: torch.Tensor) -> None:
        """First working set of a sequence whose prompt (``length`` tokens) is complete: its top-K
        blocks by the last token's query ``[Hq, D]``, fetched without cap, and the partial last
        block as the local block."""
        self.ws.gather(layer, self.host, self._seed_copies(layer, q_last, table, length, slot))

    def _seed_copies(self, layer: int, q_last: torch.Tensor, table: torch.Tensor, length: int,
                     slot: torch.Tensor) -> torch.Tensor:
        """``_seed``'s selection at ``layer`` (residency tables updated); returns its copy list."""
        B, K, heads = self.layout.block_size, self.layout.topk_blocks, self.layout.num_kv_heads
        slot = slot.long()
        self.ws.reset(layer, slot)
        complete, copies = length // B, []
        if complete:
            scores = self.summaries.scores(layer, q_last[None], table[None, :complete],
                                           torch.full((1,), complete, dtype=torch.int32,
                                                      device=self.device))
            copies.append(self.ws.copy_list(slot, *self.ws.plan(
                layer, slot, table[None, :complete], scores, K, self.now)))
        if length % B:
            local = torch.full((1, heads, 1), self.layout.local_slot, dtype=torch.long,
                               device=self.device)
            block = table[complete].long().view(1, 1, 1).expand(1, heads, 1)
            copies.append(self.ws.copy_list(slot, block, local))
        return torch.cat(copies, 1) if copies else torch.empty((3, 0), dtype=torch.long,
                                                               device=self.device)

    def seed_from(self, queries: torch.Tensor, table: torch.Tensor, length: int,
                  slot: torch.Tensor) -> None:
        """Every layer's first working set of ``slot`` (``[1]``) for a prompt of ``length`` tokens
        that another engine prefilled (``engine/handoff.py``): ``_seed`` from the last token's
        ``queries`` ``[L, Hq, D]`` over the host blocks ``table`` names, with the summaries of its
        complete blocks already written. Every layer selects first; then the blocks they want are
        made resident at once (a decode-host cache reads its located ones: one transfer per remote
        source, each layer's units only); then the copies run."""
        copies = [self._seed_copies(layer, queries[layer], table, length, slot)
                  for layer in range(self.layout.num_layers)]
        if self.host.evicts:
            self.host.make_resident_layers([c[0][c[0] >= 0].unique().tolist() for c in copies],
                                           partial=True)
        for layer, items in enumerate(copies):
            self.ws.gather(layer, self.host, items, resident=self.host.evicts)
            self.ws.open_from_local(layer, slot)

    # ---- decode ----------------------------------------------------------------------------------
    def decode_rows(self, slots: torch.Tensor, pos: torch.Tensor, tables: torch.Tensor,
                    real: torch.Tensor) -> DecodeRows:
        """The step's ``DecodeRows`` from each row's working-set slot, position and block-table row
        (``[N]``, ``[N]``, ``[N, max_blocks]``); ``real`` ``[N]`` is False on graph padding rows
        (their table rows are stale: they must write nothing)."""
        B, heads = self.layout.block_size, self.layout.num_kv_heads
        slots, pos = slots.long(), pos.long()
        block, offset = pos // B, pos % B
        done = (offset == B - 1) & real
        host_block = tables.long().gather(1, block[:, None])[:, 0]
        return DecodeRows(
            slots=slots, block=block, local_index=slots * B + offset,
            local_lens=(offset + 1).to(torch.int32), complete=block.to(torch.int32),
            complete_next=((pos + 1) // B).to(torch.int32), done=done,
            summary_src=slots.repeat_interleave(heads),
            summary_heads=torch.arange(heads, device=pos.device).repeat(pos.shape[0]),
            summary_dst=torch.where(done, host_block, -1).repeat_interleave(heads),
            now=self.now.clone())

    def store_decode(self, layer: int, k: torch.Tensor, v: torch.Tensor, host_slots: torch.Tensor,
                     rows: DecodeRows) -> None:
        """Write each row's new K/V ``[N, Hk, D]`` into the host store at ``host_slots`` ``[N]``
        (``store``) and append it to the row's local block (and its open block): one launch, each
        row quantised once for both."""
        host_k, host_v = self.host.layer(layer)
        local_k, local_v = self.ws.local(layer)
        self._store(k, v, host_k, host_v, host_slots, scales=self.host.layer_scales(layer),
                    open_block=(self.ws.open_k[layer], self.ws.open_v[layer], rows.local_index)
                    if self.open_blocks else None, v_layout=False,
                    mirror=(local_k, local_v, rows.local_index, self.ws.local_scales(layer)))

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               step: TierStep, scale: float) -> torch.Tensor:
        """Sparse attention of q ``[T, Hq, D]`` over each row's working set and local block (its
        open block where kept); draft rows (``step.draft_rows``) see their row's too, plus the
        row's and their own K/V (``k``/``v`` ``[T, Hk, D]``), never stored."""
        extra = ({} if step.draft_rows is None
                 else dict(draft_rows=step.draft_rows, extra_k=k, extra_v=v))
        return self._attend(q, self.ws.k[layer], self.ws.v[layer], self.ws.map[layer], step.slots,
                            step.rows.local_lens, scale, scales=self.ws.scales[layer],
                            open_block=self.ws.opened(layer, step.slots), **extra)

    def complete_local_blocks(self, layer: int, rows: DecodeRows) -> None:
        """Rows whose local block just filled: summarise it and move it into the working set."""
        self.summaries.update(layer, self.ws.local(layer)[0], rows.summary_src, rows.summary_heads,
                              rows.summary_dst, rows.summary_heads,
                              _k_scale(self.ws.local_scales(layer)))
        self.ws.promote_local(layer, rows.slots, rows.done, rows.block, rows.now)

    def retrieve(self, layer: int, q: torch.Tensor, slots: torch.Tensor, tables: torch.Tensor,
                 complete: torch.Tensor, fetch: bool = True, notify: str | None = None,
                 now: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Score each row's ``complete`` ``[N]`` blocks with ``q`` ``[N, Hq, D]``, plan the capped
        selection (counted in the layer's row of ``counters``) at stamp ``now`` (default: this
        step's) and, with ``fetch``, copy the admitted blocks. Returns the plan: (host block ids,
        slots)."""
        scores = self.summaries.scores(layer, q, tables, complete.to(torch.int32))
        if notify:
            self.notify(notify, layer, slots, scores)
        plan = self.ws.plan(layer, slots, tables, scores, self.cap,
                            self.now if now is None else now, self.counters.tensor[layer])
        if fetch:
            self.ws.fetch(layer, self.host, slots, *plan)
        return plan

    def notify(self, kind: str, layer: int, slots: torch.Tensor, scores: torch.Tensor) -> None:
        """Tell the observers a per-head top-K: ``[N, Hk, K']`` block indices, -1 where fewer blocks
        exist. ``kind``: ``current`` (this token's own query) or ``predicted`` (lookahead, for
        t+1)."""
        values, blocks = scores.topk(min(self.layout.topk_blocks, scores.shape[-1]), dim=-1)
        blocks = torch.where(values > float("-inf"), blocks, -1)
        for observer in self.probes.observers:
            observer(kind, layer, slots, blocks)

    def notify_current(self, layer: int, q: torch.Tensor, slots: torch.Tensor, tables: torch.Tensor,
                       complete: torch.Tensor) -> None:
        """Observers see the top-K of this token's own query (scored here, nothing selected)."""
        if self.probes.observers:
            self.notify("current", layer, slots,
                        self.summaries.scores(layer, q, tables, complete.to(torch.int32)))

    # ---- accounting ------------------------------------------------------------------------------
    def decode_read_bytes(self, context_lens: list[int]) -> int:
        """Device bytes one decode step's attention reads: working-set slots actually attended (at
        most K full blocks + the local block) plus the summaries of every complete block."""
        lay, B = self.layout, self.layout.block_size
        per_token = lay.host_block_bytes // B
        total = 0
        for n in context_lens:
            complete = (n - 1) // B
            total += (min(complete, lay.topk_blocks) * B + (n - complete * B)) * per_token
            total += complete * lay.summary_bytes_per_block
        return total
