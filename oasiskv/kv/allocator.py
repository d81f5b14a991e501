"""TieredAllocator: what the scheduler asks in oasis mode. Admits by both budgets at once.

A running sequence holds (a) one working-set slot in HBM (its K + 1 blocks per layer and kv-head,
a fixed size) and (b) host blocks for every token it has computed (its whole KV, in the host store).
``can_allocate`` is true only when both fit, so pinned memory is never over-committed. The block
table holds host block ids; ``slot_of[seq.seq_id]`` the working-set slot (``BlockManager``'s
sequence slots). ``on_free(seq)`` is told
whenever a sequence gives everything back (finished, aborted or preempted; its slot still in
``slot_of``), so per-sequence state elsewhere in the tier goes with it.

Host blocks are a ``BlockManager``'s: ref counts, and prefix sharing by block-hash chain (a new
prompt that starts with complete blocks another request computed takes those host blocks instead
of prefilling them; freed blocks keep their hash and contents, oldest freed handed out first, so
the host store doubles as an LRU cache of recent prompts). With a decode-host cache
(``kv/host_cache.py``, ``host``) host block ids outnumber host memory's rows: the allocator tells
the cache which blocks it hands out fresh, shares or lets go (``taken`` / ``released``), admits only
what can get rows (``can_take``), and forgets the hash of a cached block whose row the cache took
back. A block's summary is indexed by its host
block id and written when the block completes, so a shared block's summary is shared too: the
later request scores and seeds from it without recomputing it. Shared blocks are complete and before
the sequence's last prompt token, so decode never writes into them.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Callable

import numpy as np

from oasiskv.engine.block_manager import BlockManager
from oasiskv.engine.sequence import Sequence
from oasiskv.kv.host_cache import HostCache, NoHostRows


class TieredAllocator(BlockManager):
    def __init__(self, num_host_blocks: int, num_seq_slots: int, block_size: int,
                 on_free: Callable[[Sequence], None] = lambda seq: None,
                 enable_prefix_sharing: bool = True, host: HostCache | None = None):
        super().__init__(num_host_blocks, block_size, enable_prefix_sharing, num_seq_slots)
        self.host = host
        if host is not None:
            host.on_forget = self._forget_hash
        self.on_free = on_free
        #: admissions of a new sequence refused, by the budget that refused them (a waiting request
        #: is refused again at every step until it fits); read and reset by the backend
        self.refused = {"host_blocks": 0, "working_set_slots": 0}

    def _blocks_fit(self, n: int) -> bool:
        return super()._blocks_fit(n) and (self.host is None or self.host.can_take(n))

    def _refused(self, blocks_fit: bool) -> None:
        self.refused["working_set_slots" if blocks_fit else "host_blocks"] += 1

    def can_adopt(self) -> bool:
        return bool(self.free_slots)

    def _take_free(self, n: int, remote: bool = False) -> list[int]:
        blocks = super()._take_free(n)
        if self.host is not None:
            try:
                self.host.taken(blocks, fresh=True, resident=not remote)
            except NoHostRows as exc:
                self._drop(blocks)
                raise RuntimeError(f"KV pool exhausted: {exc}") from None
        return blocks

    def _take(self, block: int) -> None:
        super()._take(block)
        if self.host is not None:
            self.host.taken([block], fresh=False)

    def _drop(self, blocks: Iterable[int]) -> np.ndarray:
        freed = super()._drop(blocks)
        if self.host is not None:
            self.host.released(freed.tolist())
        return freed

    def forget(self, blocks: Iterable[int]) -> None:
        """``blocks``' contents can no longer be trusted: out of the prefix cache."""
        for b in blocks:
            self._forget_hash(b)

    def free(self, seq: Sequence) -> None:
        self.on_free(seq)  # (its slot still in slot_of)
        super().free(seq)
