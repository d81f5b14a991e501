"""TieredAllocator: what the scheduler asks in oasis mode. Admits by both budgets at once.

A running sequence holds (a) one working-set slot in HBM (its K + 1 blocks per layer and kv-head,
a fixed size) and (b) host blocks for every token it has computed (its whole KV, in the host store).
``can_allocate`` is true only when both fit, so pinned memory is never over-committed. The block
table holds host block ids; ``seq.kv_slot`` the working-set slot. No prefix sharing here: every host
block has one owner.
"""
from __future__ import annotations

from oasiskv.engine.kv_allocator import KVAllocator
from oasiskv.engine.sequence import Sequence


class TieredAllocator(KVAllocator):
    def __init__(self, num_host_blocks: int, num_seq_slots: int, block_size: int):
        self.block_size = block_size
        self._num_host_blocks = num_host_blocks
        self.free_blocks: list[int] = list(range(num_host_blocks - 1, -1, -1))
        self.free_slots: list[int] = list(range(num_seq_slots - 1, -1, -1))
        self.num_seq_slots = self.max_running = num_seq_slots

    @property
    def num_total_blocks(self) -> int:
        return self._num_host_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        needs_slot = seq.kv_slot < 0
        return self.blocks_to_add(seq, num_new_tokens) <= len(self.free_blocks) and (
            not needs_slot or bool(self.free_slots))

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        if not self.can_allocate(seq, num_new_tokens):
            raise RuntimeError("tiered KV exhausted: no host blocks or no working-set slot")
        if seq.kv_slot < 0:
            seq.kv_slot = self.free_slots.pop()
        for _ in range(self.blocks_to_add(seq, num_new_tokens)):
            seq.block_table.append(self.free_blocks.pop())

    def free(self, seq: Sequence) -> None:
        self.free_blocks.extend(reversed(seq.block_table))
        seq.block_table = []
        if seq.kv_slot >= 0:
            self.free_slots.append(seq.kv_slot)
            seq.kv_slot = -1

    def check_invariants(self, live: list[Sequence]) -> None:
        """Every host block and slot is free or owned by exactly one live sequence (tests call this)."""
        owned = [b for s in live for b in s.block_table]
        assert len(owned) == len(set(owned)) and not set(owned) & set(self.free_blocks)
        assert len(owned) + len(self.free_blocks) == self._num_host_blocks
        slots = [s.kv_slot for s in live if s.kv_slot >= 0]
        assert len(slots) == len(set(slots)) and not set(slots) & set(self.free_slots)
        assert len(slots) + len(self.free_slots) == self.num_seq_slots
