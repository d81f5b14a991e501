"""HostCache: the decode-host cache (``f_host < 1``): more host block ids than host memory holds,
the rest of a prompt's KV on the remote tier.

A ``HostStore`` whose ``num_blocks`` logical block ids (what block tables, summaries and the block
manager name) live on ``num_physical`` rows of ``k``/``v``: ``rows`` ``[num_blocks]`` (device,
int64) maps an id to its row, -1 while the block is not resident. A block is *located* when a remote
tier holds a copy of it (``locate``: a prefill or memory worker's block under a lease, registered
after a full transfer), so its row may be taken back (*evicted*) and the block read again when a
selection wants it. Blocks nobody located (generated ones, prompts prefilled here) stay resident
while in use.

Residency, eagerly: ``physical_blocks`` / ``physical_slots`` outside a CUDA-graph capture first make
every id they are given resident (a new block gets a row, a located one is read from its remote
tier: ``reader.read``, blocking, with the reader's deadline); inside a capture they only look ids
up, and whoever replays the graph calls ``make_resident`` on what it will read first (the lookahead
retrieval does, for each step's copy lists, before their tail). Row-table updates reach the device
with ``flush`` (on the current stream; every path above flushes). A block whose read fails stays
not resident (copies skip it) and is reported by ``take_failed``: the backend ends the sequences
whose tables name it, with the reason, and the others go on.

Rows: a block takes a free row, else the least recently used *evictable* one: a located resident
block, or a resident block no block table references (a cached prefix block: it leaves the prefix
cache, ``on_forget``). ``enforce_budgets`` keeps each running sequence within ``f_host * P + F``
resident blocks (P its prompt's complete blocks, F those it generated), evicting its least
recently used located prompt blocks that no working set holds; generated blocks and working sets
are never evicted by it. ``touch`` marks blocks used (working sets, reads).

Leases: every located block names the lease that keeps its remote copy; a lease none of them names
any more is passed to ``on_lease_idle`` (the server releases it). A located block loses its
location when its last reference goes (``released``) or when it is handed out again.
"""
from __future__ import annotations

import logging
import math
from collections import OrderedDict, defaultdict
from dataclasses import dataclass
from typing import Callable, Hashable, Iterable, Protocol

import numpy as np
import torch

from oasiskv.kv.host_store import HostStore
from oasiskv.kv.layout import TieredLayout

logger = logging.getLogger(__name__)


class RemoteTier(Protocol):
    def read(self, source: Hashable, remote_blocks: list[int], rows: list[int]) -> None:
        """Copy whole blocks ``remote_blocks`` of ``source`` into rows ``rows`` of the store;
        blocks until done, raises (past a deadline too) when it fails: an exception whose
        ``unsettled`` attribute is true says the rows may still be written (they are never used
        again)."""


class NoHostRows(RuntimeError):
    """Every row holds a block that cannot be read again (in use, no remote copy)."""


@dataclass(frozen=True)
class Location:
    source: Hashable  #: what ``RemoteTier.read`` reads from
    block: int  #: the block's id there
    lease: Hashable  #: what keeps it there


@dataclass
class CacheStats:
    """Counts since start: reads that found a block resident / had to read it from the remote tier
    (``misses``, blocks; ``remote_reads``, transfers), rows taken back, rows in use."""
    hits: int = 0
    misses: int = 0
    remote_reads: int = 0
    evictions: int = 0


class HostCache(HostStore):
    def __init__(self, layout: TieredLayout, num_blocks: int, pin: bool, num_physical: int,
                 device: torch.device, f_host: float):
        super().__init__(layout, min(num_physical, num_blocks), pin)
        self.num_physical, self.num_blocks = self.num_blocks, max(num_blocks, num_physical)
        self.f_host = f_host
        self.rows = torch.full((self.num_blocks,), -1, dtype=torch.long, device=device)
        self._row_of = np.full(self.num_blocks, -1, dtype=np.int64)
        self._free_rows = list(range(self.num_physical))  # (the last row is handed out first)
        self._dirty: dict[int, int] = {}  # id -> row, not yet on the device
        #: resident blocks that may give their row back, least recently used first
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._stamp = np.zeros(self.num_blocks, dtype=np.int64)  # last use (``touch``)
        self._clock = 0
        self._in_use: set[int] = set()  # referenced by a block table or held
        self.where: dict[int, Location] = {}
        self._located = np.zeros(self.num_blocks, dtype=bool)  # (``where``'s keys, as a mask)
        self._lease_refs: defaultdict[Hashable, int] = defaultdict(int)
        self.reader: RemoteTier | None = None
        #: blocks whose read failed (since ``take_failed``), with why
        self.failed: dict[int, str] = {}
        self._retired: set[int] = set()  # rows a failed read may still write
        self.on_forget: Callable[[int], None] = lambda block: None
        self.on_lease_idle: Callable[[Hashable], None] = lambda lease: None
        self.stats = CacheStats()
        logger.info("decode-host cache: %d block ids on %d rows (f_host %.2f)", self.num_blocks,
                    self.num_physical, f_host)

    # ---- what a step reads and writes --------------------------------------------------------
    def physical_blocks(self, ids: torch.Tensor) -> torch.Tensor:
        if not self._capturing():
            self.make_resident(ids[ids >= 0].unique().tolist(), partial=True)
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

    @property
    def rows_in_use(self) -> int:
        return self.num_physical - len(self._free_rows)

    def make_resident(self, blocks: Iterable[int], partial: bool = False) -> None:
        """Give every block in ``blocks`` a row, reading the located ones from their remote tier
        (one read per source, after the device has finished every copy out of the store: a row
        may have held another block); flushes. A read that fails leaves its blocks not resident
        (rows -1: copies skip them) and in ``failed`` until ``take_failed``. When no row can be
        taken back: ``NoHostRows`` (nothing changed), or with ``partial`` the blocks left without
        a row are failed the same way (one step wanting more blocks at once than there are rows
        ends the sequences that wanted those, not the step)."""
        blocks = list(dict.fromkeys(blocks))
        missing = [b for b in blocks if self._row_of[b] < 0]
        self.touch(blocks)
        self.stats.hits += sum(1 for b in blocks if b in self.where and self._row_of[b] >= 0)
        if missing:
            keep = set(blocks)
            taken = []
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
                missing = missing[:len(taken)]
            reads: defaultdict[Hashable, list[tuple[int, int]]] = defaultdict(list)
            for b, row in zip(missing, taken):
                loc = self.where.get(b)
                if loc is not None:
                    reads[loc.source].append((loc.block, row))
            if reads and self.rows.is_cuda:
                torch.cuda.synchronize()
            unread: set[int] = set()
            for source, pairs in reads.items():
                self.stats.remote_reads += 1
                self.stats.misses += len(pairs)
                try:
                    if self.reader is None:
                        raise RuntimeError("no remote tier to read located blocks from")
                    self.reader.read(source, [p[0] for p in pairs], [p[1] for p in pairs])
                except Exception as exc:  # noqa: BLE001 (the tier's errors: the blocks are lost)
                    why = (f"reading {len(pairs)} KV blocks from {source} failed: "
                           f"{type(exc).__name__}: {exc}")
                    logger.error("%s", why)
                    failed = {b for b, row in zip(missing, taken) if row in
                              {p[1] for p in pairs}}
                    self.failed.update(dict.fromkeys(failed, why))
                    unread |= failed
                    if getattr(exc, "unsettled", False):  # never to be used again
                        logger.error("%d host rows may still be written by that read: retired",
                                     len(pairs))
                        self.num_physical -= len(pairs)
                        self._retired.update(p[1] for p in pairs)
            for b, row in zip(missing, taken):
                if b in unread:
                    if row not in self._retired:
                        self._free_rows.append(row)
                    continue
                self._set_row(b, row)
                if b in self.where or b not in self._in_use:
                    self._evictable[b] = None
        self.flush()

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
        self._row_of[block] = row
        self._dirty[block] = row

    def _take_row(self, keep: set[int]) -> int:
        """A free row, else the row of the least recently used evictable block not in ``keep``."""
        if self._free_rows:
            return self._free_rows.pop()
        for b in self._evictable:
            if b not in keep:
                row = int(self._row_of[b])
                self._evict(b)
                self._free_rows.remove(row)
                return row
        raise NoHostRows(f"every one of the {self.num_physical} host rows is in use by blocks "
                         "that cannot be read again: raise --host-kv-gib or --f-host")

    def _evict(self, block: int) -> None:
        del self._evictable[block]
        self._free_rows.append(int(self._row_of[block]))
        self._set_row(block, -1)
        self.stats.evictions += 1
        if block not in self.where:  # a cached prefix block: its contents are gone
            self.on_forget(block)

    def can_take(self, n: int) -> bool:
        """Whether ``n`` new blocks can get rows now."""
        return len(self._free_rows) + len(self._evictable) >= n

    # ---- the block manager's calls -----------------------------------------------------------
    def taken(self, blocks: list[int], fresh: bool) -> None:
        """``blocks`` are referenced now; ``fresh``: handed out for new contents (they get rows and
        lose their locations; ``NoHostRows`` when no row is left), else shared or revived."""
        if fresh:
            for b in blocks:
                self._unlocate(b)
            self._in_use.update(blocks)
            for b in blocks:
                self._evictable.pop(b, None)
            self.make_resident(blocks)
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
            if self._row_of[b] >= 0:
                self._evictable[b] = None
                self._evictable.move_to_end(b, last=False)  # (the least recently used now)
            else:
                self.on_forget(b)

    def locate(self, blocks: list[int], remote_blocks: list[int], source: Hashable,
               lease: Hashable) -> None:
        """Blocks ``blocks`` are also blocks ``remote_blocks`` of ``source`` (kept under
        ``lease``)."""
        for b, r in zip(blocks, remote_blocks):
            self._unlocate(b)
            self.where[b] = Location(source, r, lease)
            self._located[b] = True
            self._lease_refs[lease] += 1
            if self._row_of[b] >= 0:
                self._evictable[b] = None

    def _unlocate(self, block: int) -> None:
        loc = self.where.pop(block, None)
        if loc is None:
            return
        self._located[block] = False
        if block in self._in_use:
            self._evictable.pop(block, None)
        self._lease_refs[loc.lease] -= 1
        if not self._lease_refs[loc.lease]:
            del self._lease_refs[loc.lease]
            self.on_lease_idle(loc.lease)

    # ---- the periodic LRU pass ---------------------------------------------------------------
    def enforce_budgets(self, sequences: list[tuple[list[int], int]],
                        pinned: Iterable[int]) -> int:
        """Per running sequence (its block table, its prompt's complete blocks P): evict its least
        recently used located prompt blocks not in ``pinned`` (its working sets) until it holds at
        most ``ceil(f_host * P) + F`` resident blocks. Returns the blocks evicted."""
        spare = self._located.copy()  # may go: located, in no working set
        spare[list(pinned)] = False
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
        evictable = {b for b in owners.values() if b in self.where or b not in self._in_use}
        assert evictable == set(self._evictable)
        assert sum(self._lease_refs.values()) == len(self.where)
        self.flush()
        assert self.rows.tolist() == self._row_of.tolist()
        assert set(np.flatnonzero(self._located).tolist()) == set(self.where)
