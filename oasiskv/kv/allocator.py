"""TieredAllocator: what the scheduler asks in oasis mode. Admits by both budgets at once.

A running sequence holds (a) one working-set slot in HBM (its K + 1 blocks per layer and kv-head,
a fixed size) and (b) host blocks for every token it has computed (its whole KV, in the host store).
``can_allocate`` is true only when both fit, so pinned memory is never over-committed. The block
table holds host block ids; ``slot_of[seq.seq_id]`` the working-set slot. No prefix sharing here:
every host block has one owner. ``on_free(seq)`` is told whenever a sequence gives everything back
(finished, aborted or preempted), so per-sequence state elsewhere in the tier goes with it.
"""
from __future__ import annotations

from typing import Callable

from oasiskv.engine.kv_allocator import KVAllocator
from oasiskv.engine.sequence import Sequence


class TieredAllocator(KVAllocator):
    def __init__(self, num_host_blocks: int, num_seq_slots: int, block_size: int,
                 on_free: Callable[[Sequence], None] = lambda seq: None):
        self.block_size = block_size
        self._num_host_blocks = num_host_blocks
        self.free_blocks: list[int] = list(range(num_host_blocks - 1, -1, -1))
        self.free_slots: list[int] = list(range(num_seq_slots - 1, -1, -1))
        self.num_seq_slots = num_seq_slots
        self.slot_of: dict[int, int] = {}  #: seq id -> working-set slot
        self.on_free = on_free
        #: admissions of a new sequence refused, by the budget that refused them (a waiting request
        #: is refused again at every step until it fits); read and reset by the backend
        self.refused = {"host_blocks": 0, "working_set_slots": 0}

    @property
    def num_total_blocks(self) -> int:
        return self._num_host_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        fits = self._fits(seq, num_new_tokens)
        if not fits and seq.seq_id not in self.slot_of:  # a new sequence refused: by which budget
            short = self.blocks_to_add(seq, num_new_tokens) > len(self.free_blocks)
            self.refused["host_blocks" if short else "working_set_slots"] += 1
        return fits

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        if not self._fits(seq, num_new_tokens):
            raise RuntimeError("tiered KV exhausted: no host blocks or no working-set slot")
        if seq.seq_id not in self.slot_of:
            self.slot_of[seq.seq_id] = self.free_slots.pop()
        for _ in range(self.blocks_to_add(seq, num_new_tokens)):
            seq.block_table.append(self.free_blocks.pop())

    def _fits(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.blocks_to_add(seq, num_new_tokens) <= len(self.free_blocks) and (
            seq.seq_id in self.slot_of or bool(self.free_slots))

    def free(self, seq: Sequence) -> None:
        self.free_blocks.extend(reversed(seq.block_table))
        seq.block_table = []
        slot = self.slot_of.pop(seq.seq_id, None)
        if slot is not None:
            self.free_slots.append(slot)
        self.on_free(seq)

    def check_invariants(self, live: list[Sequence]) -> None:
        """Every host block and slot is free or owned by exactly one live sequence (tests call
        this)."""
        owned = [b for s in live for b in s.block_table]
        assert len(owned) == len(set(owned)) and not set(owned) & set(self.free_blocks)
        assert len(owned) + len(self.free_blocks) == self._num_host_blocks
        assert set(self.slot_of) <= {s.seq_id for s in live}
        slots = list(self.slot_of.values())
        assert len(slots) == len(set(slots)) and not set(slots) & set(self.free_slots)
        assert len(slots) + len(self.free_slots) == self.num_seq_slots
