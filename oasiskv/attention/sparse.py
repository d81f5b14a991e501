"""SparseBackend (kv_mode=oasis): the attention-backend lifecycle over the tiered KV.

Who decides what: ``kv/tiered.py`` holds the storage and does each layer's operations (store,
prefill + seed, attend, promote, retrieve); ``kv/retrieval.py`` decides where and when retrieval
runs (synchronous before attention, or lookahead after it on side streams); ``kv/lookahead.py``
owns the drafter, its guesses and the draft rows; ``kv/allocator.py`` admits by both budgets. This
file wires them to the engine's calls:

- ``allocate``: host store, summaries, working sets and the drafter's memory within the budget;
- ``prepare``: the step's ``TierStep`` (each row's working-set slot, the rows that end their
  prefill, draft rows as extra rows of a decode step) and the decode step stamp;
- ``forward``: per layer, prefill (dense, seeding) or decode (store, retrieve, attend, promote);
- ``admit``: a handed-off prompt's seeding from the prefilling engine's queries, no forward;
- ``finish``: the replayed graph's deferred copies, the drafter's next guesses, the step's counters;
- graph hooks: static ``TierStep`` per bucket (padding rows use a scratch working-set slot that is
  never handed out, so they select, fetch and summarise nothing); a step whose sequences do not
  all have a guess runs eagerly, and an engine with observers never captures.

With K >= the number of complete blocks and no cap, every block stays resident: dense attention.
"""
from __future__ import annotations

import logging
from dataclasses import replace

import numpy as np
import torch

from oasiskv.attention.base import SlotBackend, StepPlan, StepStats
from oasiskv.attention.prefill import open_block_rows, prefill_attention
from oasiskv.config import EngineConfig
from oasiskv.engine.forward_batch import ForwardBatch, to_device_many
from oasiskv.engine.scheduler import ScheduledBatch
from oasiskv.engine.sequence import Sequence
from oasiskv.kv.allocator import TieredAllocator
from oasiskv.kv.guardrail import Guardrail
from oasiskv.kv.layout import TieredLayout
from oasiskv.kv.lookahead import Lookahead
from oasiskv.kv.probes import TierProbes
from oasiskv.kv.retrieval import LookaheadRetrieval, SyncRetrieval
from oasiskv.kv.tiered import TieredKV, TierStep
from oasiskv.spec.base import Drafter, make_drafter

logger = logging.getLogger(__name__)

CPU_HBM_BYTES = 4 << 30  # without a GPU, working sets + summaries get this much ordinary memory
LRU_PERIOD = 8  # decode steps between two LRU passes of a decode-host cache


class SparseBackend(SlotBackend):
    """``probes``: a harness's attachments (``kv/probes.py``). ``drafter``: replaces the one
    ``tier.draft`` names (a lookahead ``draft`` must be set)."""
    takes_handoffs = True

    def __init__(self, config: EngineConfig, model: torch.nn.Module, dtype: torch.dtype,
                 device: torch.device, probes: TierProbes | None = None,
                 drafter: Drafter | None = None):
        tier, cfg = config.tier, model.cfg
        ranks = model.tp.size if hasattr(model, "tp") else 1
        if ranks > 1:  # each tensor-parallel rank stores its kv heads: its share of the host store
            tier = replace(tier, host_kv_gib=tier.host_kv_gib / ranks)
        self.config, self.device, self.dtype = config, device, dtype
        self.kv = TieredKV(TieredLayout.of(config, cfg, dtype), tier, device,
                           probes or TierProbes(), open_blocks=config.kv_open_block == "model")
        self.guardrail = Guardrail(self.kv, tier.guardrail_rate, cfg.num_heads)
        # observers read each step's scores on the host: such an engine never captures graphs
        self.supports_cuda_graphs = not self.kv.probes.observers
        self.lookahead: Lookahead | None = None
        if tier.lookahead:
            if drafter is None and tier.draft != "previous":
                drafter = make_drafter(tier.draft, device, model)
            self.lookahead = Lookahead(drafter, model)
            # (tensor-parallel ranks must run the same batch: they wait for their reads)
            self.retrieval = LookaheadRetrieval(self.kv, tier.prefetch, cfg.num_layers,
                                                tier.remote_stall_ms / 1e3 if ranks == 1 else None)
            self.rows_per_seq = self.lookahead.rows_per_seq
        else:
            self.retrieval = SyncRetrieval(self.kv, tier.prefetch)
        self._max_len = config.max_model_len or cfg.max_position_embeddings
        self.allocator: TieredAllocator | None = None
        self._statics: dict[int, TierStep] = {}
        self._eager: TierStep | None = None  # this step's meta (its aux features), eager steps
        self._replayed: TierStep | None = None  # the static meta of the graph this step replayed
        self._decode_rows = 0
        self._tap_bytes = 0  # the guardrail's tap buffers (HBM)
        self._lost: dict[int, str] = {}  # blocks whose reads failed since ``held_back`` ran

    # ---- storage ---------------------------------------------------------------------------------
    def allocate(self, budget_bytes: int | None) -> None:
        kv, lay = self.kv, self.kv.layout
        host = kv.make_host_store()
        max_len = min(self._max_len, host.num_blocks * lay.block_size)
        drafter = self.lookahead.drafter if self.lookahead else None
        drafter_per_seq = drafter.bytes_per_seq(max_len) if drafter else 0
        drafter_fixed = drafter.fixed_bytes() if drafter else 0
        summary_bytes = host.num_blocks * lay.summary_bytes_per_block
        taps = self._tap_bytes = self.guardrail.allocate(self.config.max_num_seqs)
        per_seq = kv.slot_bytes + drafter_per_seq
        fixed = summary_bytes + drafter_fixed + taps
        budget = CPU_HBM_BYTES if budget_bytes is None else budget_bytes
        # one working set more than the slots handed out: the scratch slot of graph padding rows
        slots = min(self.config.max_num_seqs, (budget - fixed) // per_seq - 1)
        if slots < 1:
            where = ("HBM" if budget_bytes is not None
                     else f"of the {CPU_HBM_BYTES >> 30} GiB the tier takes without a GPU")
            raise RuntimeError(f"no room {where} for two working sets ({per_seq / 2**20:.0f} MiB "
                               f"each, drafter included) after {fixed / 2**30:.2f} GiB of block "
                               f"summaries and drafter: lower --host-kv-gib or --topk-blocks")
        kv.allocate(host, int(slots) + 1)
        self.guardrail.warm_up()
        self.retrieval.allocate(self.config.max_num_seqs)
        if drafter:
            drafter.reserve(int(slots), max_len)
        logger.info("tiered KV: %d host blocks (%d tokens), %d working-set slots of K=%d blocks "
                    "(%.2f GiB HBM, drafter %.2f GiB), summaries %.2f GiB HBM, fetch cap %d "
                    "blocks/head/layer/step", host.num_blocks, host.num_blocks * lay.block_size,
                    slots, lay.topk_blocks, slots * kv.slot_bytes / 2**30,
                    (slots * drafter_per_seq + drafter_fixed) / 2**30, summary_bytes / 2**30,
                    kv.cap)

    def make_allocator(self) -> TieredAllocator:
        # a drafter that reads the target's features of every prompt token cannot start after a
        # shared prefix: no prefix sharing with it
        drafter = self.lookahead.drafter if self.lookahead is not None else None
        sharing = not (drafter is not None and drafter.aux_layers)
        host = self.kv.host
        self.allocator = TieredAllocator(host.num_blocks, self._padding_slot,
                                         self.kv.layout.block_size, on_free=self._release,
                                         enable_prefix_sharing=sharing,
                                         host=host if host.evicts else None)
        return self.allocator

    @property
    def max_tokens_per_seq(self) -> int:
        return self.kv.host.num_blocks * self.kv.layout.block_size

    @property
    def _padding_slot(self) -> int:
        return self.kv.ws.num_slots - 1

    def _release(self, seq: Sequence) -> None:
        if self.lookahead is not None:
            self.lookahead.release(seq)
        slot = self.allocator.slot_of.get(seq.seq_id)
        if slot is not None:
            self.retrieval.forget(slot)

    # ---- tensor parallelism: a worker's allocator keeps rank 0's working-set slots -------------
    def drop_sequence(self, seq: Sequence) -> None:
        self._release(seq)
        super().drop_sequence(seq)

    # ---- one step --------------------------------------------------------------------------------
    def prepare(self, batch: ScheduledBatch) -> StepPlan:
        # the rows' working-set slots, then (lookahead) each row's draft row and the row it drafts
        # for: one host-to-device copy
        self.retrieval.begin_step()
        slots = [self.allocator.slot_of[s.seq_id] for s in batch.seqs]
        arrays = [(slots, torch.int32)]
        plan = StepPlan()
        if batch.is_prefill:
            self.guardrail.pick([], [])
            if self.kv.open_blocks:
                arrays.append((open_block_rows(batch, slots, self.kv.layout.block_size),
                               torch.long))
        else:
            self.kv.now += 1
            self._decode_rows += len(batch)
            if self.kv.host.evicts and int(self.kv.now) % LRU_PERIOD == 0:
                self._enforce_budgets(batch.seqs)
            self.guardrail.pick(batch.seqs, [len(seq) - 1 for seq in batch.seqs])
            if self.lookahead is not None:
                plan.extra_ids, plan.extra_positions, rows = self.lookahead.draft_rows(batch)
                if rows:
                    n = len(batch)
                    index = [-1] * n
                    for j, row in enumerate(rows):
                        index[row] = n + j
                    arrays += [(index, torch.int32), (rows, torch.long)]
        tensors = to_device_many(arrays, self.device)
        self.kv.host.flush()  # the rows of blocks handed out since the last step
        step = plan.meta = self._eager = TierStep(tensors[0],
                                                  ends_prefill=list(batch.ends_prefill))
        if batch.is_prefill:
            step.queries = {i: [] for i, (seq, ends) in enumerate(zip(batch.seqs,
                                                                      batch.ends_prefill))
                            if ends and seq.hand_off}
        if batch.is_prefill and self.kv.open_blocks:
            step.open_rows = tensors[1]
        elif len(tensors) > 1:
            step.draft_rows, step.draft_of = tensors[1:]
        return plan

    def admit(self, batch: ScheduledBatch) -> torch.Tensor:
        # the prompts' blocks are the sequences' own (held until now), their complete blocks'
        # summaries written: the same seeding as a prefill that ends here, once every layer's
        # working sets are the foreground's again (a finished sequence's copies may still be
        # running into the slot a new one takes)
        for layer in range(self.kv.layout.num_layers):
            self.retrieval.claim(layer)
        step = self.prepare(batch).meta
        for i, seq in enumerate(batch.seqs):
            table = torch.tensor(seq.block_table, dtype=torch.int32, device=self.device)
            self.kv.seed_from(seq.handoff.queries.to(self.device, self.dtype), table, len(seq),
                              step.slots[i:i + 1])
        return torch.stack([s.handoff.hidden for s in batch.seqs]).to(self.device, self.dtype)

    def handoff_queries(self, index: int) -> torch.Tensor:
        return torch.stack(self._eager.queries[index]).cpu()

    def _enforce_budgets(self, seqs: list[Sequence]) -> None:
        """The decode-host cache's LRU pass over the running ``seqs``: each keeps ``f_host * P +
        F`` resident blocks, never a block any of its working sets holds."""
        slots = torch.tensor([self.allocator.slot_of[s.seq_id] for s in seqs], device=self.device)
        # per sequence, which of its blocks any (layer, head) holds: a mask over its table, made on
        # the device (the maps hold ~10^6 entries at 128 x 32K), one copy to the host
        held = torch.stack([m[slots] for m in self.kv.ws.map], 1).flatten(1).long()
        width = max(len(s.block_table) for s in seqs) + 1  # the last column takes the empty (-1)
        mask = torch.zeros((len(seqs), width), dtype=torch.bool, device=self.device)
        mask.scatter_(1, torch.where(held >= 0, held, width - 1), True)
        B, pinned = self.kv.layout.block_size, set()
        for seq, row in zip(seqs, mask[:, :-1].cpu().numpy()):
            table = seq.block_table
            pinned.update(table[i] for i in np.flatnonzero(row[:len(table)]))
        self.kv.host.touch(pinned)
        self.kv.host.enforce_budgets([(s.block_table, s.num_prompt_tokens // B) for s in seqs],
                                     pinned)

    def forward(self, layer, q, k, v, batch: ForwardBatch, scale: float) -> torch.Tensor:
        if batch.meta is None:  # the warm-up before storage exists
            return prefill_attention(q, k, v, batch, scale, None)
        self.retrieval.claim(layer)
        step, n = batch.meta, batch.num_seqs  # draft rows follow the n sequence rows
        if layer == 0:  # the step's index tensors, once per forward (and per graph replay)
            step.host_slots = self.kv.host.physical_slots(batch.slot_mapping)
            if not batch.is_prefill:
                step.rows = self.kv.decode_rows(step.slots, batch.positions[:n],
                                                batch.block_tables, batch.context_lens > 0)
        if batch.is_prefill:
            self.kv.store(layer, k, v, step.host_slots)
            return self.kv.prefill(layer, q, k, v, batch, scale)
        return self._decode(layer, q, k, v, batch, scale)

    def _decode(self, layer, q, k, v, batch: ForwardBatch, scale: float) -> torch.Tensor:
        kv, step, n, tables = self.kv, batch.meta, batch.num_seqs, batch.block_tables
        kv.store_decode(layer, k[:n], v[:n], step.host_slots[:n], step.rows)
        self.retrieval.before_attention(layer, q[:n], step.rows, tables)
        out = kv.attend(layer, q, k, v, step, scale)
        self.guardrail.tap(layer, q[:n], step.rows, scale)
        kv.complete_local_blocks(layer, step.rows)
        # step t+1's working set: chosen by the draft rows' queries (the real ones where no guess)
        q_next = q[:n] if step.draft_of is None else q[:n].index_copy(0, step.draft_of, q[n:])
        self.retrieval.after_attention(layer, q_next, step.rows, tables)
        return out

    def held_back(self) -> tuple[set[int], dict[int, str]]:
        try:
            waiting, failed = self.retrieval.resume(self._lost)
        except Exception as exc:  # (the sequences it was for end; the engine and others go on)
            logger.exception("running deferred KV copies failed")
            waiting, failed = set(), dict.fromkeys(self.retrieval.abandon(),
                                                   f"{type(exc).__name__}: {exc}")
        self._lost = {}
        if not waiting and not failed:
            return set(), {}
        seq_of = {slot: seq_id for seq_id, slot in self.allocator.slot_of.items()}
        return ({seq_of[s] for s in waiting if s in seq_of},
                {seq_of[s]: why for s, why in failed.items() if s in seq_of})

    def idle(self) -> bool:
        return self.kv.host.poll()

    def during_step(self) -> None:
        self.retrieval.during_step()

    def finish(self, batch: ScheduledBatch) -> StepStats:
        self.retrieval.finish()
        failed, lost = {}, self.kv.host.take_failed()
        self._lost.update(lost)  # (the reasons for ``held_back``, until it runs)
        if lost:
            for seq in batch.seqs:  # (they end now: the next step would attend stale blocks)
                why = next((lost[b] for b in seq.block_table if b in lost), None)
                if why is not None:
                    failed[seq.seq_id] = why
                    # what this step computed for it may have read missing bytes: no prefix
                    # cache entry of it may outlive it (blocks a remote tier holds are sound)
                    self.allocator.forget(b for b in seq.block_table
                                          if not self.kv.host.located(b))
        lay = self.kv.layout
        counters, per_layer = self.kv.counters.read()
        counters["stall_seconds"] = counters.pop("stall_ns") / 1e9
        samples = ({"stall_seconds": [counters["stall_seconds"]]}
                   if self.kv.config.measure_stall and not batch.is_prefill else {})
        samples |= self.guardrail.measure()
        if self.guardrail.active:
            counters["guardrail_dropped"] = self.guardrail.take_dropped()
        counters["deferred"] = counters["misses"] - counters["fetched_blocks"]
        counters["fetched_bytes"] = 2 * counters["fetched_blocks"] * lay.slice_bytes
        counters["decode_rows"], self._decode_rows = self._decode_rows, 0
        # the most blocks the fetch cap lets this step admit: the cap per (row, layer, kv head)
        counters["cap_slots"] = (self.kv.cap * lay.num_kv_heads * lay.num_layers
                                 * counters["decode_rows"])
        for budget, count in self.allocator.refused.items():
            counters[f"admissions_refused_{budget}"] = count
            self.allocator.refused[budget] = 0
        # cached prompt blocks the host store handed out again (prefix cache evictions)
        counters["prefix_evictions"], self.allocator.evictions = self.allocator.evictions, 0
        if self.lookahead is not None:
            self.lookahead.advance(batch, self._last_aux())
            counters.update(self.lookahead.take_counts())
        alloc = self.allocator
        used_slots = alloc.num_seq_slots - len(alloc.free_slots)
        gauges = {
            "hit_rate": counters["hits"] / max(1, counters["hits"] + counters["misses"]),
            "cap_fill": counters["fetched_blocks"] / max(1, counters["cap_slots"]),
            "host_bytes_in_use": (alloc.num_total_blocks - alloc.num_free_blocks)
            * lay.host_block_bytes,
            "hbm_bytes_in_use": used_slots * self.kv.slot_bytes
            + self.kv.host.num_blocks * lay.summary_bytes_per_block + self._tap_bytes}
        return StepStats(counters, gauges, {"fetched_blocks": per_layer["fetched_blocks"]}, samples,
                         failed)

    def _last_aux(self) -> dict[int, torch.Tensor]:
        """The features the drafter reads: from the replayed graph's static meta, else this
        step's."""
        step = self._replayed if self._replayed is not None else self._eager
        self._replayed = self._eager = None
        return step.aux if step is not None else {}

    # ---- CUDA graphs -----------------------------------------------------------------------------
    def init_graphs(self, buckets: list[int]) -> dict[int, TierStep]:
        """One set of static buffers for the largest bucket; each bucket's ``TierStep`` views them.
        With draft rows, row j's draft is row bucket + j."""
        top = max(buckets)
        slots = torch.full((top,), self._padding_slot, dtype=torch.int32, device=self.device)
        draft = self.rows_per_seq > 1
        for bs in buckets:
            self._statics[bs] = TierStep(
                slots[:bs],
                draft_rows=torch.arange(bs, 2 * bs, dtype=torch.int32, device=self.device)
                if draft else None,
                draft_of=torch.arange(bs, device=self.device) if draft else None)
        return self._statics

    def begin_capture(self) -> None:
        self.retrieval.begin_capture()

    def end_capture(self, bucket: int) -> None:
        self.retrieval.end_capture(bucket)
        self.kv.counters.tensor.zero_()  # the warm-up and capture runs counted (and compiled) too

    def prepare_replay(self, meta: TierStep, num_seqs: int, bucket: int) -> bool:
        # (the graph runner replays a step only with rows_per_seq - 1 draft rows per sequence)
        static = self._statics[bucket]
        static.slots[:num_seqs].copy_(meta.slots)
        static.slots[num_seqs:].fill_(self._padding_slot)
        self.retrieval.replaying(bucket)
        self._replayed = static
        return True
