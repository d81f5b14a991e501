"""Retrieval: where and when a decode step chooses and fetches each head's working set.

Both answer the calls of ``Retrieval`` (each a no-op there), made by the sparse backend for each
layer of a decode step:
``claim(layer)`` before the layer touches its working set (prefill too), ``before_attention`` and
``after_attention`` around sparse attention; per step ``begin_step()`` first, ``during_step()``
while the device runs the step and ``finish()`` once its tokens are read; and the graph hooks
``begin_capture`` / ``end_capture(bucket)`` / ``replaying(bucket)``.

- ``SyncRetrieval`` (``draft=none``): before attention, score and select with the token's own query
  and copy the admitted blocks, on the foreground stream (the foreground stalls for it).
- ``LookaheadRetrieval`` (any other draft): after attention, with the query predicted for step t+1
  (the draft row's, or the real one without a guess), on side streams (``prefetch=async``,
  ``kv/prefetch.py``) or in line. Inside a CUDA graph only the selections are captured; each
  bucket's copies become a tail graph launched by ``finish`` after the replay; with a decode-host
  cache (``kv/host_cache.py``) the blocks the replay's selections admitted get rows first, and
  those it evicted are read from the remote tier: layer by layer while the replay runs
  (``during_step``, the remote-fetch stage, ``kv/remote_fetch.py``), the rest in ``finish``.

``prefetch=off`` selects nothing after seeding (measurements of the foreground alone).

A slow remote tier stalls only the sequences that read from it: with a decode-host cache the
lookahead retrieval waits at most ``stall_s`` for the blocks its copies need. The copies of blocks
still being read then are taken out of the step's copy lists and kept (*deferred*); their
sequences sit out steps (``resume`` names them, the scheduler skips them) until ``resume``, between
two steps, finds their blocks landed and runs the kept copies, or failed (the sequences end).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from oasiskv.kv.prefetch import PrefetchPipeline, Tail
from oasiskv.kv.remote_fetch import RemoteFetch
from oasiskv.kv.tiered import DecodeRows, TieredKV


@dataclass
class _Deferred:
    """Copies of one layer into one sequence's working-set slot kept back: ``items`` ``[3, M]``
    (``WorkingSet.copy_list`` columns)."""
    layer: int
    slot: int
    items: torch.Tensor


class Retrieval:
    """The calls; ``active`` is False with ``prefetch=off``."""

    def __init__(self, kv: TieredKV, prefetch: str):
        self.kv, self.active = kv, prefetch != "off"

    def allocate(self, max_seqs: int) -> None:
        """Storage for up to ``max_seqs`` sequences per step (with the tier's)."""

    def claim(self, layer: int) -> None:
        """``layer``'s working set is about to be used (decode or prefill)."""

    def before_attention(self, layer: int, q: torch.Tensor, rows: DecodeRows,
                         tables: torch.Tensor) -> None:
        """Decode rows ``q`` ``[N, Hq, D]`` (``rows``, block tables ``tables``) are about to
        attend."""

    def after_attention(self, layer: int, q_next: torch.Tensor, rows: DecodeRows,
                        tables: torch.Tensor) -> None:
        """They attended; ``q_next`` predicts each row's query at the next step."""

    def begin_step(self) -> None:
        """A step begins (what an earlier step left armed, having failed before ``finish``, is
        dropped: its requests ended)."""

    def during_step(self) -> None:
        """The step is launched on the device; the host has not waited for its tokens yet."""

    def finish(self) -> None:
        """The step's tokens are read."""

    def begin_capture(self) -> None:
        """Before a graph capture."""

    def end_capture(self, bucket: int) -> None:
        """After the capture of ``bucket``."""

    def replaying(self, bucket: int) -> None:
        """``bucket``'s graph replays this step."""

    def resume(self, lost: dict[int, str]) -> tuple[set[int], dict[int, str]]:
        """Between steps: run the deferred copies whose blocks have landed. Returns the
        working-set slots still waiting (their sequences sit out the next step) and those whose
        blocks could not be read, with why (``lost``: blocks whose reads failed, with why)."""
        return set(), {}

    def abandon(self) -> set[int]:
        """Drop every deferred copy (``resume`` failed); returns the slots they were for."""
        return set()

    def forget(self, slot: int) -> None:
        """The sequence in ``slot`` ended: nothing deferred may write its slot any more."""


class SyncRetrieval(Retrieval):
    def before_attention(self, layer: int, q: torch.Tensor, rows: DecodeRows,
                         tables: torch.Tensor) -> None:
        if not self.active:
            self.kv.notify_current(layer, q, rows.slots, tables, rows.complete)
            return
        with self.kv.stall(layer):
            self.kv.retrieve(layer, q, rows.slots, tables, rows.complete,
                             notify="current" if self.kv.probes.observers else None)


class LookaheadRetrieval(Retrieval):
    def __init__(self, kv: TieredKV, prefetch: str, num_layers: int, stall_s: float | None):
        """``stall_s``: how long a step waits for the remote tier at most (None: until each read
        is done or past its deadline)."""
        super().__init__(kv, prefetch)
        self.stall_s = stall_s
        self._deferred: list[_Deferred] = []
        probes = kv.probes
        self.pipeline = PrefetchPipeline(num_layers, kv.device, prefetch == "async", kv.stall,
                                         probes.before_copy)
        #: per layer, int64 ``[3, max_seqs * Hk * cap]``: the lookahead fetch's copy list
        #: (``WorkingSet.copy_list`` rows), allocated outside any graph pool: the copy a replay
        #: leaves behind reads it after the graph is done (and another bucket's replay may reuse it)
        self._copy_lists: list[torch.Tensor] = []
        self._tails: dict[int, Tail | None] = {}
        self._due: Tail | None = None  # the tail of the graph being replayed
        self._due_items = 0  # the copy lists' items that graph's selections wrote
        self._remote: RemoteFetch | None = None  # replays' remote-fetch stage (decode-host cache)

    def allocate(self, max_seqs: int) -> None:
        if self.active:
            lay = self.kv.layout
            items = max_seqs * lay.num_kv_heads * self.kv.cap
            self._copy_lists = [torch.full((3, items), -1, dtype=torch.long, device=self.kv.device)
                                for _ in range(lay.num_layers)]
            # (tensor-parallel ranks, stall_s None, wait for their reads in finish)
            if self.kv.host.evicts and self.pipeline.asynchronous and self.stall_s is not None:
                self._remote = RemoteFetch(lay.num_layers, items, self.kv.device)

    def claim(self, layer: int) -> None:
        self.pipeline.wait(layer)  # this layer's working set is the foreground's again

    def before_attention(self, layer: int, q: torch.Tensor, rows: DecodeRows,
                         tables: torch.Tensor) -> None:
        self.kv.notify_current(layer, q, rows.slots, tables, rows.complete)

    def after_attention(self, layer: int, q_next: torch.Tensor, rows: DecodeRows,
                        tables: torch.Tensor) -> None:
        """Step t+1's selection and fetch for ``layer`` from the predicted queries ``q_next``."""
        if not self.active:
            return
        kv, slots, complete, now = self.kv, rows.slots, rows.complete_next, rows.now
        if kv.probes.observers:  # observers read the scores on the host: everything on one stream
            kv.retrieve(layer, q_next, slots, tables, complete, notify="predicted")
            return
        out = self._copy_lists[layer][:, :slots.shape[0] * kv.layout.num_kv_heads * kv.cap]

        def select() -> torch.Tensor:
            plan = kv.retrieve(layer, q_next, slots, tables, complete, fetch=False, now=now)
            items = kv.ws.copy_list(slots, *plan, out=out)
            if self._remote is not None and torch.cuda.is_current_stream_capturing():
                self._remote.publish(layer, items[0])
            return items

        self.pipeline.launch(layer, select, lambda items: self._gather(layer, items),
                             keep=(q_next, slots, tables, complete, now))
        if (layer == kv.layout.num_layers - 1 and self.pipeline.asynchronous
                and torch.cuda.is_current_stream_capturing()):
            self.pipeline.join()  # a captured step ends with its side streams joined

    def begin_step(self) -> None:
        self._due = None
        if self._remote is not None:
            self._remote.disarm()

    def during_step(self) -> None:
        """While a replay with a decode-host cache runs: its remote-fetch stage."""
        remote = self._remote  # (armed: a replay with a tail is due)
        if remote is not None and remote.armed:
            done = torch.cuda.Event()
            done.record()  # (after the replay: its side streams are joined into this one)
            remote.advance(self.kv.host, self.pipeline.wait_copies, done.query)

    def finish(self) -> None:
        """Launch the replayed graph's tail, then order the foreground after the step's selections
        (their counters are read next)."""
        tail, self._due = self._due, None
        if tail is not None:
            if self.kv.host.evicts:
                self._make_resident()
            self.pipeline.run_captured(tail)
        self.pipeline.wait_selections()

    def _gather(self, layer: int, items: torch.Tensor) -> None:
        """``layer``'s copies; outside a capture with a decode-host cache, their blocks made
        resident first (those still being read after ``stall_s`` deferred)."""
        kv = self.kv
        resident = kv.host.evicts and not (items.is_cuda
                                           and torch.cuda.is_current_stream_capturing())
        if resident:
            ids = items[0].tolist()
            self._defer(layer, items, ids, kv.host.make_resident(
                [b for b in set(ids) if b >= 0], layer, partial=True, stall_s=self.stall_s))
        kv.ws.gather(layer, kv.host, items, resident=resident)

    def _make_resident(self) -> None:
        """Give the blocks the replayed selections admitted rows in the decode-host cache (reading
        those it evicted from the remote tier) before the tail copies them: the tail maps ids to
        rows when it runs. Copies of blocks still being read after ``stall_s`` are deferred."""
        self.pipeline.wait_selections()
        lists = [items[:, :self._due_items] for items in self._copy_lists]
        remote, host = self._remote, self.kv.host
        if remote is not None and remote.armed:  # (the layers not started while it ran, now)
            remote.advance(host, self.pipeline.wait_copies, None)
            pending = host.wait_reads(remote.want, self.stall_s)
            wanted = ([remote.ids_of(layer).tolist() for layer in range(len(lists))]
                      if pending else [])
            remote.disarm()
        else:
            wanted = torch.stack([items[0] for items in lists]).tolist()
            pending = host.make_resident_layers(
                [[b for b in set(ids) if b >= 0] for ids in wanted], partial=True,
                stall_s=self.stall_s)
        if pending:
            for layer, (items, ids) in enumerate(zip(lists, wanted)):
                self._defer(layer, items, ids, pending)

    def _defer(self, layer: int, items: torch.Tensor, ids: list[int],
               pending: dict[int, int]) -> None:
        """Take the copies of ``layer``'s ``items`` (block ids ``ids``) whose blocks are pending
        at the layer out of them (id -1: skipped) and keep them."""
        cols = [i for i, b in enumerate(ids) if b >= 0 and pending.get(b, 0) >> layer & 1]
        if not cols:
            return
        idx = torch.tensor(cols, device=items.device)
        kept = items[:, idx]
        items[0, idx] = -1
        slots = kept[2] // self._per_slot
        for slot in sorted(set(slots.tolist())):  # (each sequence waits for its own blocks only)
            self._deferred.append(_Deferred(layer, slot, kept[:, slots == slot]))

    @property
    def _per_slot(self) -> int:
        """Flat working-set slots of one sequence at one layer (``copy_list``'s third row)."""
        return self.kv.layout.num_kv_heads * self.kv.layout.slots

    def resume(self, lost: dict[int, str]) -> tuple[set[int], dict[int, str]]:
        if not self._deferred:
            return set(), {}
        host, failed, left = self.kv.host, {}, []
        host.poll()
        for d in self._deferred:
            blocks = [b for b in set(d.items[0].tolist()) if b >= 0]
            why = next((lost.get(b) or host.failed[b] for b in blocks
                        if b in lost or b in host.failed), None)
            if why is not None:  # (not read again: its sequence ends)
                failed[d.slot] = why
                continue
            # (a block evicted since it landed is read again)
            if host.make_resident(blocks, d.layer, partial=True, stall_s=0.0):
                left.append(d)
                continue
            bad = [b for b in blocks if not host.holds(b, d.layer)]
            if bad:
                failed[d.slot] = lost.get(bad[0]) or host.failed.get(bad[0]) or (
                    f"KV block {bad[0]} could not be read from the remote tier")
            else:
                self.kv.ws.gather(d.layer, host, d.items, resident=True)
        self._deferred = [d for d in left if d.slot not in failed]
        return {d.slot for d in self._deferred}, failed

    def abandon(self) -> set[int]:
        slots, self._deferred = {d.slot for d in self._deferred}, []
        return slots

    def forget(self, slot: int) -> None:
        self._deferred = [d for d in self._deferred if d.slot != slot]

    def begin_capture(self) -> None:
        self.pipeline.join()

    def end_capture(self, bucket: int) -> None:
        self._tails[bucket] = self.pipeline.take_captured()

    def replaying(self, bucket: int) -> None:
        self._due = self._tails[bucket]
        self._due_items = bucket * self.kv.layout.num_kv_heads * self.kv.cap
        if self._remote is not None and self._due is not None:
            self._remote.arm(self._due_items)
