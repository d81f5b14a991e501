"""HostCache: the decode-host cache (``f_host < 1``): more host block ids than host memory holds,
the rest of a prompt's KV on the remote tier.

A ``HostStore`` whose ``num_blocks`` logical block ids (what block tables, summaries and the block
manager name) live on ``num_physical`` rows of ``k``/``v``: ``rows`` ``[num_blocks]`` (device,
int64) maps an id to its row, -1 while the block is not resident. A block is *located* when a remote
tier holds a copy of it (``locate``: a prefill or memory worker's block under a lease, registered
after a full transfer, or after a handoff whose blocks were never read: ``taken(...,
resident=False)``), so its row may be taken back (*evicted*) and the block read again when a
selection wants it. Blocks nobody located (generated ones, prompts prefilled here) stay resident
while in use.

Residency, eagerly: ``physical_blocks`` / ``physical_slots`` outside a CUDA-graph capture first make
every id they are given resident at the layer the caller reads (a new block gets a row; a located
one's missing (block, layer) units are read from its remote tier: ``reader.start``, one transfer
per source, waited for until done or past the reader's deadline; a row records which layers it
holds, so a block read again for one layer costs one layer's bytes); inside a capture they only
look ids up, and whoever replays the graph makes what it will read resident first: the lookahead
retrieval starts each layer's reads while the replay runs (``start_reads``, no device sync: the
remote-fetch stage, ``kv/remote_fetch.py``) and waits for them before the tail (``wait_reads``),
or calls ``make_resident_layers`` on every layer's copy list at once. Row-table
updates reach the device with ``flush`` (on the current stream; every path above flushes). A block
whose read fails stays not resident (copies skip it) and is reported by ``take_failed``: the
backend ends the sequences whose tables name it, with the reason, and the others go on.

A slow source stalls only what it is read for: ``make_resident_layers`` with ``stall_s`` waits that
long at most and returns the (block, layer) units still being read, *pending*. A pending block
keeps its row (no eviction takes it) and settles when a later call polls its transfer (``poll``,
or any residency call; a caller that needs a pending unit waits for it): its layers become valid,
or it fails as a failed read does. The caller keeps whatever needed pending units out of use until
then (the lookahead retrieval holds their sequences back, ``kv/retrieval.py``).

Rows: a block takes a free row, else the least recently used *evictable* one: a located resident
block, or a resident block no block table references (a cached prefix block: it leaves the prefix
cache, ``on_forget``). ``enforce_budgets`` keeps each running sequence within ``f_host * P + F``
resident blocks (P its prompt's complete blocks, F those it generated), evicting its least
recently used located prompt blocks that no working set holds; generated blocks and working sets
are never evicted by it. ``touch`` marks blocks used (working sets, reads).

Leases: every located block names the lease that keeps its remote copy; a lease none of them names
any more is passed to ``on_lease_idle`` (the server releases it). A located block loses its
location when its last reference goes (``released``), when it is handed out again, or when it was
located for a request that never took it (imported, then the request failed or waited too long):
``drop_unused`` lets such blocks go as ``released`` does, so that no lease is kept for them.
"""
from __future__ import annotations

import logging
import math
import time
from collections import OrderedDict, defaultdict
from dataclasses import dataclass
from typing import Callable, Hashable, Iterable, Protocol

import numpy as np
import torch

from oasiskv.kv.host_store import HostStore
from oasiskv.kv.layout import TieredLayout

logger = logging.getLogger(__name__)

_POLL_S = 0.0002  # between two polls of the reads a caller waits for


class PendingRead(Protocol):
    def done(self) -> bool:
        """Whether the read completed. Raises when it failed or passed its deadline: an exception
        whose ``unsettled`` attribute is true says its rows may still be written (they are never
        used again)."""


class RemoteTier(Protocol):
    def start(self, source: Hashable, remote_blocks: list[int], rows: list[int],
              layers: list[int]) -> PendingRead:
        """Start copying blocks ``remote_blocks`` of ``source`` into rows ``rows`` of the store,
        each at layer ``layers[i]`` only (-1: the whole block); raises when it cannot start (as
        ``PendingRead.done`` does)."""


class NoHostRows(RuntimeError):
    """Every row holds a block that cannot be read again (in use, no remote copy)."""


@dataclass(frozen=True)
class Location:
    source: Hashable  #: what ``RemoteTier.read`` reads from
    block: int  #: the block's id there
    lease: Hashable  #: what keeps it there


@dataclass
class _Read:
    """A transfer in flight: its source and (remote block, row, layer) units."""
    source: Hashable
    units: list[tuple[int, int, int]]
    handle: PendingRead


@dataclass
class CacheStats:
    """Counts since start, of located blocks wanted resident, per call that wants them (the eager
    path asks once per layer, a replay's remote-fetch stage once per batch of layers, the old
    replay path once for all): with every layer wanted already in their rows (``hits``), or not
    (``misses``: blocks read from the remote tier, per transfer, in ``units``, a whole block or
    one layer of one, ``bytes`` in all; reads that failed not counted), over ``remote_reads``
    transfers (failed ones too), of which ``staged_reads`` were started by a replay's
    remote-fetch stage (``start_reads``), ``early_reads`` of those while the replay still ran, and
    ``deferred`` were still running when the step that started them stopped waiting; and rows
    taken back."""
    hits: int = 0
    misses: int = 0
    units: int = 0
    bytes: int = 0
    remote_reads: int = 0
    staged_reads: int = 0
    early_reads: int = 0
    deferred: int = 0
    evictions: int = 0


class HostCache(HostStore):
    evicts = True

    def __init__(self, layout: TieredLayout, num_blocks: int, pin: bool, num_physical: int,
                 device: torch.device, f_host: float):
        super().__init__(layout, min(num_physical, num_blocks), pin)
        self.num_physical, self.num_blocks = self.num_blocks, max(num_blocks, num_physical)
        self.f_host = f_host
        self.rows = torch.full((self.num_blocks,), -1, dtype=torch.long, device=device)
        self._row_of = np.full(self.num_blocks, -1, dtype=np.int64)
        self._block_at = [-1] * self.num_physical  # row -> the block in it
        #: per block, a mask of the layers whose bytes its row holds (a block read again may hold
        #: only the layers a selection wanted); a new block's are all written here
        self._layers = layout.num_layers
        self._full = (1 << layout.num_layers) - 1
        self._valid = [0] * self.num_blocks
        self._free_rows = list(range(self.num_physical))  # (the last row is handed out first)
        self._dirty: dict[int, int] = {}  # id -> row, not yet on the device
        #: resident blocks that may give their row back, least recently used first
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._stamp = np.zeros(self.num_blocks, dtype=np.int64)  # last use (``touch``)
        self._clock = 0
        self._quiet = False  # the device has finished every copy since this call began
        self._in_use: set[int] = set()  # referenced by a block table or held
        #: located blocks no block table references and nobody holds, since when (monotonic s)
        self._unused_since: dict[int, float] = {}
        self.where: dict[int, Location] = {}
        self._lease_refs: defaultdict[Hashable, int] = defaultdict(int)
        self._lost: set[Hashable] = set()  # leases whose blocks may be gone remotely
        self.reader: RemoteTier | None = None
        #: blocks whose read failed (since ``take_failed``), with why
        self.failed: dict[int, str] = {}
        self._reads: list[_Read] = []  # in flight
        self._staged: list[_Read] = []  # started by ``start_reads`` since the last ``wait_reads``
        self.pending: dict[int, int] = {}  # block -> mask of its layers being read
        self._retired: set[int] = set()  # rows a failed read may still write
        self.on_forget: Callable[[int], None] = lambda block: None
        self.on_lease_idle: Callable[[Hashable], None] = lambda lease: None
        self.stats = CacheStats()
        logger.info("decode-host cache: %d block ids on %d rows (f_host %.2f)", self.num_blocks,
                    self.num_physical, f_host)

    # ---- what a step reads and writes --------------------------------------------------------
    def physical_blocks(self, ids: torch.Tensor, layer: int | None = None,
                        ensure: bool = True) -> torch.Tensor:
        if ensure and not self._capturing():
            self.make_resident(ids[ids >= 0].unique().tolist(), layer, partial=True)
        return torch.where(ids >= 0, self.rows[ids.clamp(min=0)], ids)

    def physical_slots(self, slots: torch.Tensor) -> torch.Tensor:
        B = self.layout.block_size
        if not self._capturing():
            self.make_resident((slots[slots >= 0] // B).unique().tolist())
        rows = self.rows[(slots // B).clamp(min=0)]
        return torch.where((slots >= 0) & (rows >= 0), rows * B + slots % B, -1)

    def rows_of(self, ids: list[int]) -> list[int]:
        rows = self._row_of[np.asarray(ids, dtype=np.int64)]
        if (rows < 0).any():
            raise ValueError("rows asked for blocks that are not resident")
        return rows.tolist()

    def _capturing(self) -> bool:
        return self.rows.is_cuda and torch.cuda.is_current_stream_capturing()

    def resident(self, block: int) -> bool:
        return bool(self._row_of[block] >= 0)

    def holds(self, block: int, layer: int) -> bool:
        """Whether ``block``'s row holds its bytes at ``layer``."""
        return bool(self._row_of[block] >= 0) and bool(self._valid[block] >> layer & 1)

    @property
    def rows_in_use(self) -> int:
        return self.num_physical - len(self._free_rows)

    def make_resident(self, blocks: Iterable[int], layer: int | None = None,
                      partial: bool = False, stall_s: float | None = None) -> dict[int, int]:
        """Make ``blocks`` resident with their bytes at ``layer`` (None: every layer) in their
        rows; see ``make_resident_layers``."""
        return self._ensure(dict.fromkeys(blocks, self._unit_mask(layer)), partial, stall_s)

    def _unit_mask(self, layer: int | None) -> int:
        """The layers a unit covers: one, or every one (``None`` or -1: a whole block)."""
        return self._full if layer is None or layer < 0 else 1 << layer

    def make_resident_layers(self, per_layer: list[list[int]], partial: bool = False,
                             stall_s: float | None = None) -> dict[int, int]:
        """Make the blocks ``per_layer[l]`` resident with their bytes at layer ``l`` in their rows,
        for every layer ``l`` at once: a block gets a row (a free one, else the least recently
        used evictable block's), and a located block's missing (block, layer) units are read from
        its remote tier, one transfer per source, after the device has finished every copy out of
        the store (a row may have held another block); flushes. A read that fails evicts its
        blocks (rows -1: copies skip them) and reports them in ``failed`` until ``take_failed``.
        When no row can be taken back: ``NoHostRows`` (nothing changed), or with ``partial`` the
        blocks left without a row are failed the same way (one step wanting more blocks at once
        than there are rows ends the sequences that wanted those, not the step). ``stall_s``:
        wait that long at most for the reads (None: until each is done or past its deadline).
        Returns the wanted units still being read: block -> mask of its layers (pending)."""
        want: dict[int, int] = {}
        for layer, blocks in enumerate(per_layer):
            for b in blocks:
                want[b] = want.get(b, 0) | 1 << layer
        return self._ensure(want, partial, stall_s)

    def start_reads(self, want: dict[int, int], keep: set[int], early: bool) -> None:
        """While a replay runs (the remote-fetch stage, ``kv/remote_fetch.py``): give the blocks
        of ``want`` (block -> mask of the layers wanted) rows and start reading their missing
        units from their remote tiers, one transfer per source, as ``make_resident_layers`` does,
        but without waiting for the reads and without touching the device: the caller has waited
        for every device copy out of the store, and the row table reaches the device at the next
        flush (``wait_reads``). ``keep``: the blocks the step wants so far, ``want``'s included,
        which no eviction here takes; ``early``: the replay still runs (``early_reads``)."""
        started = len(self._staged)
        self._ensure(dict(want), True, 0.0, keep=keep, staged=True)
        self.stats.staged_reads += len(self._staged) - started
        self.stats.early_reads += (len(self._staged) - started) * early

    def wait_reads(self, want: dict[int, int], stall_s: float | None) -> dict[int, int]:
        """After ``start_reads``: wait ``stall_s`` at most (None: until each is done or past its
        deadline) for the reads of the units ``want`` (block -> mask of its layers), and flush.
        Returns the wanted units still being read (pending); the reads the ``start_reads`` calls
        since the last ``wait_reads`` started that still run count as deferred."""
        if self._reads:
            self._settle(None if stall_s is None else time.monotonic() + stall_s, want)
            left = {id(r) for r in self._reads}
            self.stats.deferred += sum(id(r) in left for r in self._staged)
        self._staged = []
        self.flush()
        return {b: mask & self.pending[b] for b, mask in want.items()
                if mask & self.pending.get(b, 0)}

    def poll(self) -> bool:
        """Settle the reads that finished (or failed) since the last call; never waits. True
        while some still run."""
        if self._reads:
            self._settle(time.monotonic(), None)
            self.flush()
        return bool(self._reads)

    def _ensure(self, want: dict[int, int], partial: bool, stall_s: float | None,
                keep: set[int] | None = None, staged: bool = False) -> dict[int, int]:
        """``make_resident_layers`` for ``want``: block -> mask of the layers wanted; ``keep``: the
        blocks no eviction may take (default: ``want``'s); ``staged``: a ``start_reads`` call (no
        device copy out of the store runs, so no device sync; no wait for the reads, no flush)."""
        if self._reads:  # (a caller that cannot wait less waits for the units it needs)
            self._settle(time.monotonic() if stall_s is not None else None, want)
        for b in [b for b in want if b in self.where and self.where[b].lease in self._lost
                  and want[b] & ~self._valid[b]]:  # (their bytes are gone: no row, no read)
            self.failed[b] = (f"the lease on {self.where[b].source} that kept this block's KV "
                              "is gone")
            del want[b]
            if self._row_of[b] >= 0:
                self._evict(b, retire=self._drop_reads(b))
        blocks = list(want)
        self.touch(blocks)
        missing = [b for b in blocks if self._row_of[b] < 0]
        self._quiet = staged
        if missing:
            keep, taken = set(blocks) if keep is None else keep, []
            spare = len(self._free_rows) + len(self._evictable) - sum(
                1 for b in blocks if b in self._evictable)
            if len(missing) > spare and not partial:
                raise NoHostRows(f"{len(missing)} blocks need rows, {spare} can be had: raise "
                                 "--host-kv-gib or --f-host")
            try:
                for b in missing:
                    taken.append(self._take_row(keep))
            except NoHostRows:
                if not partial:
                    self._free_rows.extend(taken)
                    raise
                why = (f"{len(blocks)} blocks were wanted resident at once, more than the "
                       f"decode-host cache's {self.num_physical} rows hold besides blocks in use: "
                       "raise --host-kv-gib or --f-host")
                logger.error("%s", why)
                self.failed.update(dict.fromkeys(missing[len(taken):], why))
                for b in missing[len(taken):]:
                    del want[b]
            for b, row in zip(missing, taken):
                self._set_row(b, row)
                self._valid[b] = 0 if b in self.where else self._full  # (new: written here)
                if b in self.where or b not in self._in_use:
                    self._evictable[b] = None
        # per source, the (remote block, row, layer) units to read (layer -1: the whole block)
        reads: defaultdict[Hashable, list[tuple[int, int, int]]] = defaultdict(list)
        for b, mask in want.items():
            lacking = mask & ~self._valid[b] & ~self.pending.get(b, 0)
            loc = self.where.get(b)
            if loc is None:
                continue
            if not lacking:
                self.stats.hits += b not in self.pending
                continue
            row = int(self._row_of[b])
            if lacking == self._full:
                reads[loc.source].append((loc.block, row, -1))
            else:
                reads[loc.source] += [(loc.block, row, layer) for layer in range(self._layers)
                                      if lacking >> layer & 1]
        if reads and self.rows.is_cuda and not self._quiet:
            torch.cuda.synchronize()
        started = []
        for source, units in reads.items():
            self.stats.remote_reads += 1
            try:
                if self.reader is None:
                    raise RuntimeError("no remote tier to read located blocks from")
                read = _Read(source, units, self.reader.start(source,
                                                              *(list(x) for x in zip(*units))))
            except Exception as exc:  # noqa: BLE001 (the tier's errors: the blocks are lost here)
                self._read_failed(source, units, exc)
                continue
            started.append(read)
            for _, row, layer in units:
                b = self._block_at[row]
                self.pending[b] = self.pending.get(b, 0) | self._unit_mask(layer)
                self._evictable.pop(b, None)  # (its row is being written)
        self._reads += started
        if staged:
            self._staged += started
            return {}
        if self._reads:
            until = None if stall_s is None else time.monotonic() + stall_s
            self._settle(until, want)
            left = {id(r) for r in self._reads}
            self.stats.deferred += sum(id(r) in left for r in started)
        self.flush()
        return {b: mask & self.pending[b] for b, mask in want.items()
                if mask & self.pending.get(b, 0)}

    def _settle(self, until: float | None, need: dict[int, int] | None) -> None:
        """Poll the reads in flight, settling those that finished or failed, until none is left,
        or (``need``: block -> layer mask) none is left that reads one of those units, or
        ``until`` (monotonic s; None: no limit, each read ends by its own deadline) passes."""
        while True:
            left, landed, failed = [], [], []
            for read in self._reads:
                try:
                    (landed if read.handle.done() else left).append(read)
                except Exception as exc:  # noqa: BLE001 (as a read that could not start)
                    failed.append((read, exc))
            self._reads = left
            for read in landed:
                self._landed(read)
            for i, (read, exc) in enumerate(failed):
                self._read_failed(read.source, read.units, exc, [r for r, _ in failed[i + 1:]])
            left = self._reads
            if (not left or until is not None and time.monotonic() >= until
                    or need is not None and not any(
                        need.get(self._block_at[row], 0) & self._unit_mask(layer)
                        for r in left for _, row, layer in r.units)):
                return
            time.sleep(_POLL_S)

    def _landed(self, read: _Read) -> None:
        """``read`` completed: its units are valid in their rows."""
        block = self.layout.host_block_bytes
        self.stats.misses += len({row for _, row, _ in read.units})
        self.stats.units += len(read.units)
        self.stats.bytes += sum(block if layer < 0 else block // self._layers
                                for _, _, layer in read.units)
        done = set()
        for _, row, layer in read.units:
            b = self._block_at[row]
            mask = self._unit_mask(layer)
            self._valid[b] |= mask
            self.pending[b] &= ~mask
            done.add(b)
        for b in done:
            if not self.pending[b]:
                del self.pending[b]
                self._settle_row(b)

    def _settle_row(self, block: int) -> None:
        """A resident block no read is writing any more takes its place among the evictable ones
        (as ``locate`` / ``released`` would have put it)."""
        if self._row_of[block] < 0 or block in self.pending:
            return
        if block not in self.where and block not in self._in_use and (
                self._valid[block] != self._full):  # (released meanwhile, only some layers read)
            self._evict(block)
        elif block in self.where or block not in self._in_use:
            self._evictable[block] = None

    def _read_failed(self, source: Hashable, units: list[tuple[int, int, int]],
                     exc: BaseException, others: Iterable[_Read] = ()) -> None:
        """A read of ``units`` from ``source`` failed: its blocks are lost here (``failed``), their
        rows taken back (retired while the read, or another read of them, may still write: the
        ones in flight and ``others``, whose units of these blocks are dropped)."""
        lost = list(dict.fromkeys(b for b in (self._block_at[row] for _, row, _ in units)
                                  if b >= 0))  # (a block an earlier failure took: gone already)
        if not lost:
            return
        why = f"reading {len(lost)} KV blocks from {source} failed: {type(exc).__name__}: {exc}"
        logger.error("%s", why)
        self.failed.update(dict.fromkeys(lost, why))
        unsettled = getattr(exc, "unsettled", False)
        for b in lost:
            self._evict(b, retire=self._drop_reads(b, others) or unsettled)
        if unsettled:
            logger.error("%d host rows may still be written by that read: retired", len(lost))

    def _drop_reads(self, block: int, others: Iterable[_Read] = ()) -> bool:
        """Take ``block``'s units out of the reads in flight (and ``others``); whether one had any
        (then its row may still be written)."""
        self.pending.pop(block, None)
        had = False
        for r in [*self._reads, *others]:
            kept = [u for u in r.units if self._block_at[u[1]] != block]
            had, r.units = had or len(kept) < len(r.units), kept
        return had

    def located(self, block: int) -> bool:
        """Whether a remote tier holds ``block`` (``locate``; until its last reference goes)."""
        return block in self.where

    def take_failed(self) -> dict[int, str]:
        """The blocks whose reads failed since the last call, with why."""
        failed, self.failed = self.failed, {}
        return failed

    def flush(self) -> None:
        """Row-table changes to the device (on the current stream)."""
        if self._dirty:
            ids = torch.tensor(list(self._dirty), dtype=torch.long)
            rows = torch.tensor(list(self._dirty.values()), dtype=torch.long)
            self.rows[ids.to(self.rows.device)] = rows.to(self.rows.device)
            self._dirty.clear()

    def touch(self, blocks: Iterable[int]) -> None:
        """``blocks`` were used now (the LRU order)."""
        self._clock += 1
        for b in blocks:
            self._stamp[b] = self._clock
            if b in self._evictable:
                self._evictable.move_to_end(b)

    def _set_row(self, block: int, row: int) -> None:
        if row >= 0:
            self._block_at[row] = block
        else:
            self._block_at[self._row_of[block]] = -1
            self._valid[block] = 0
        self._row_of[block] = row
        self._dirty[block] = row

    def _take_row(self, keep: set[int]) -> int:
        """A free row, else the row of the least recently used evictable block not in ``keep``."""
        if self._free_rows:
            return self._free_rows.pop()
        for b in self._evictable:
            if b not in keep:
                if self.rows.is_cuda and not self._quiet:
                    # a copy launched earlier (the last step's tail) may still read this row, or
                    # the row table's entry that names it
                    torch.cuda.synchronize()
                    self._quiet = True
                self._evict(b)
                return self._free_rows.pop()  # (its row)
        raise NoHostRows(f"every one of the {self.num_physical} host rows is in use by blocks "
                         "that cannot be read again: raise --host-kv-gib or --f-host")

    def _evict(self, block: int, retire: bool = False) -> None:
        """Take ``block``'s row back (``retire``: never to be used again, a failed read may still
        write it); a block no remote tier has is forgotten (``on_forget``)."""
        self._evictable.pop(block, None)
        row = int(self._row_of[block])
        self._set_row(block, -1)
        if retire:
            self._retired.add(row)
            self.num_physical -= 1
        else:
            self._free_rows.append(row)
        self.stats.evictions += 1
        if block not in self.where:  # a cached prefix block: its contents are gone
            self.on_forget(block)

    def can_take(self, n: int) -> bool:
        """Whether ``n`` new blocks can get rows now."""
        return len(self._free_rows) + len(self._evictable) >= n

    # ---- the block manager's calls -----------------------------------------------------------
    def taken(self, blocks: list[int], fresh: bool, resident: bool = True) -> None:
        """``blocks`` are referenced now; ``fresh``: handed out for new contents (they get rows and
        lose their locations; ``NoHostRows`` when no row is left), else shared or revived. A fresh
        block not ``resident`` gets no row: its contents stay remote (``locate`` it next)."""
        for b in blocks:
            self._unused_since.pop(b, None)
        if fresh:
            for b in blocks:
                self._unlocate(b)
                self.failed.pop(b, None)  # (an earlier life's)
                if b in self.pending:  # an earlier life's read: not waited for, its row retired
                    self._evict(b, retire=self._drop_reads(b))
            self._in_use.update(blocks)
            for b in blocks:
                self._evictable.pop(b, None)
            if not resident:
                for b in blocks:
                    if self._row_of[b] >= 0:
                        self._evict(b)
                self.flush()
                return
            self.make_resident(blocks)
            for b in blocks:  # (written here from now on)
                self._valid[b] = self._full
            return
        for b in blocks:
            self._in_use.add(b)
            if b not in self.where:
                self._evictable.pop(b, None)

    def released(self, blocks: Iterable[int]) -> None:
        """No block table references ``blocks`` any more: their locations go; a resident one stays
        as a cached block (evictable), one that is not is forgotten."""
        for b in blocks:
            self._in_use.discard(b)
            self._unlocate(b)
            if b in self.pending:  # (its row settles when the read does; its contents, read
                self.on_forget(b)  # while its lease may go, are no one's to reuse)
                continue
            if self._row_of[b] >= 0 and self._valid[b] == self._full:
                self._evictable[b] = None
                self._evictable.move_to_end(b, last=False)  # (the least recently used now)
            elif self._row_of[b] >= 0:  # only some layers read back: no use to anyone now
                self._evict(b)
            else:
                self.on_forget(b)

    def locate(self, blocks: list[int], remote_blocks: list[int], source: Hashable,
               lease: Hashable) -> None:
        """Blocks ``blocks`` are also blocks ``remote_blocks`` of ``source`` (kept under
        ``lease``)."""
        now = time.monotonic()
        for b, r in zip(blocks, remote_blocks):
            self._unlocate(b)
            self.where[b] = Location(source, r, lease)
            self._lease_refs[lease] += 1
            if b not in self._in_use:
                self._unused_since[b] = now
            if self._row_of[b] >= 0 and b not in self.pending:  # (just imported: the most
                self._evictable[b] = None  # recently used)
                self._evictable.move_to_end(b)

    def lease_lost(self, lease: Hashable) -> None:
        """The remote copies ``lease`` kept may be gone (it expired, or its worker restarted):
        its resident whole blocks stay as they are, without a location; any other of its blocks
        fails when it is next read (its sequences end), and goes when its last reference does."""
        if lease not in self._lease_refs:  # (no block names it any more)
            return
        self._lost.add(lease)
        for b in [b for b, loc in self.where.items() if loc.lease == lease]:
            if self._row_of[b] >= 0 and self._valid[b] == self._full:
                self._unlocate(b)
            else:  # no later request may take it from the prefix cache
                self.on_forget(b)

    def drop_unused(self, grace_s: float) -> int:
        """Let go (as ``released``) of the located blocks that no block table has referenced nor
        anyone held for ``grace_s`` seconds since they were located: their leases are not kept for
        them any more; a resident one stays a cached block, one that is not leaves the prefix cache.
        Returns how many."""
        cutoff = time.monotonic() - grace_s
        stale = [b for b, since in self._unused_since.items() if since <= cutoff]
        self.released(stale)
        self.flush()
        return len(stale)

    def _unlocate(self, block: int) -> None:
        self._unused_since.pop(block, None)
        loc = self.where.pop(block, None)
        if loc is None:
            return
        if block in self._in_use:
            self._evictable.pop(block, None)
        self._lease_refs[loc.lease] -= 1
        if not self._lease_refs[loc.lease]:
            del self._lease_refs[loc.lease]
            self._lost.discard(loc.lease)
            self.on_lease_idle(loc.lease)

    # ---- the periodic LRU pass ---------------------------------------------------------------
    def enforce_budgets(self, sequences: list[tuple[list[int], int]],
                        pinned: Iterable[int]) -> int:
        """Per running sequence (its block table, its prompt's complete blocks P): evict its least
        recently used located prompt blocks not in ``pinned`` (its working sets) until it holds at
        most ``ceil(f_host * P) + F`` resident blocks. Returns the blocks evicted."""
        spare = np.zeros(self.num_blocks, dtype=bool)  # may go: located, in no working set
        spare[list(self.where)] = True
        spare[list(pinned)] = False
        spare[list(self.pending)] = False
        evicted = 0
        for table, prompt_blocks in sequences:
            ids = np.asarray(table, dtype=np.int64)
            budget = math.ceil(self.f_host * prompt_blocks) + len(table) - prompt_blocks
            over = int((self._row_of[ids] >= 0).sum()) - budget
            if over <= 0:
                continue
            prompt = ids[:prompt_blocks]
            candidates = prompt[(self._row_of[prompt] >= 0) & spare[prompt]]
            for b in candidates[np.argsort(self._stamp[candidates], kind="stable")][:over]:
                self._evict(int(b))
                evicted += 1
        self.flush()
        return evicted

    def check_invariants(self) -> None:
        """Rows and ids map one to one; free rows are nobody's; the evictable blocks are the
        resident ones that are located or unreferenced; the device table is the host's (tests call
        this)."""
        owners = {}
        for b, row in enumerate(self._row_of.tolist()):
            if row >= 0:
                assert row not in owners, f"row {row} is blocks {owners[row]} and {b}"
                owners[row] = b
        assert not set(owners) & (set(self._free_rows) | self._retired)
        assert len(owners) + len(self._free_rows) == self.num_physical
        evictable = {b for b in owners.values()
                     if (b in self.where or b not in self._in_use) and b not in self.pending}
        assert evictable == set(self._evictable)
        assert set(self.pending) == {self._block_at[row] for r in self._reads
                                     for _, row, _ in r.units}
        assert all(self._block_at[row] == b for row, b in owners.items())
        assert all(self._block_at[row] == -1 for row in self._free_rows)
        for b in range(self.num_blocks):  # only a located block's row may lack layers
            if self._row_of[b] < 0:
                assert self._valid[b] == 0, b
            else:
                assert b in self.where or self._valid[b] == self._full or b in self.pending, b
        assert sum(self._lease_refs.values()) == len(self.where)
        assert set(self._unused_since) <= set(self.where) - self._in_use
        self.flush()
        assert self.rows.tolist() == self._row_of.tolist()
