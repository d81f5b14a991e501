"""Retrieval: where and when a decode step chooses and fetches each head's working set.

Both answer the calls of ``Retrieval`` (each a no-op there), made by the sparse backend for each
layer of a decode step:
``claim(layer)`` before the layer touches its working set (prefill too), ``before_attention`` and
``after_attention`` around sparse attention; per step ``finish()`` once the step's tokens are read;
and the graph hooks ``begin_capture`` / ``end_capture(bucket)`` / ``replaying(bucket)``.

- ``SyncRetrieval`` (``draft=none``): before attention, score and select with the token's own query
  and copy the admitted blocks, on the foreground stream (the foreground stalls for it).
- ``LookaheadRetrieval`` (any other draft): after attention, with the query predicted for step t+1
  (the draft row's, or the real one without a guess), on side streams (``prefetch=async``,
  ``kv/prefetch.py``) or in line. Inside a CUDA graph only the selections are captured; each
  bucket's copies become a tail graph launched by ``finish`` after the replay; with a decode-host
  cache (``kv/host_cache.py``) ``finish`` first gives the blocks the replay's selections admitted
  rows (a host sync on those selections, and reads from the remote tier for evicted blocks).

``prefetch=off`` selects nothing after seeding (measurements of the foreground alone).
"""
from __future__ import annotations

import torch

from oasiskv.kv.prefetch import PrefetchPipeline, Tail
from oasiskv.kv.tiered import DecodeRows, TieredKV


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

    def finish(self) -> None:
        """The step's tokens are read."""

    def begin_capture(self) -> None:
        """Before a graph capture."""

    def end_capture(self, bucket: int) -> None:
        """After the capture of ``bucket``."""

    def replaying(self, bucket: int) -> None:
        """``bucket``'s graph replays this step."""


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
    def __init__(self, kv: TieredKV, prefetch: str, num_layers: int):
        super().__init__(kv, prefetch)
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

    def allocate(self, max_seqs: int) -> None:
        if self.active:
            lay = self.kv.layout
            items = max_seqs * lay.num_kv_heads * self.kv.cap
            self._copy_lists = [torch.full((3, items), -1, dtype=torch.long, device=self.kv.device)
                                for _ in range(lay.num_layers)]

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
            return kv.ws.copy_list(slots, *plan, out=out)

        self.pipeline.launch(layer, select, lambda items: kv.ws.gather(layer, kv.host, items),
                             keep=(q_next, slots, tables, complete, now))
        if (layer == kv.layout.num_layers - 1 and self.pipeline.asynchronous
                and torch.cuda.is_current_stream_capturing()):
            self.pipeline.join()  # a captured step ends with its side streams joined

    def finish(self) -> None:
        """Launch the replayed graph's tail, then order the foreground after the step's selections
        (their counters are read next)."""
        tail, self._due = self._due, None
        if tail is not None:
            if self.kv.host.evicts:
                self._make_resident()
            self.pipeline.run_captured(tail)
        self.pipeline.wait_selections()

    def _make_resident(self) -> None:
        """Give the blocks the replayed selections admitted rows in the decode-host cache (reading
        those it evicted from the remote tier) before the tail copies them: the tail maps ids to
        rows when it runs."""
        self.pipeline.wait_selections()
        wanted = torch.stack([items[0, :self._due_items] for items in self._copy_lists]).tolist()
        self.kv.host.make_resident_layers([[b for b in set(ids) if b >= 0] for ids in wanted],
                                          partial=True)

    def begin_capture(self) -> None:
        self.pipeline.join()

    def end_capture(self, bucket: int) -> None:
        self._tails[bucket] = self.pipeline.take_captured()

    def replaying(self, bucket: int) -> None:
        self._due = self._tails[bucket]
        self._due_items = bucket * self.kv.layout.num_kv_heads * self.kv.cap
