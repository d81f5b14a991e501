"""KVAllocator: the interface the scheduler consults before it lets a sequence compute more tokens.

The dense engine implements it with ``BlockManager`` (paged HBM pool). A tiered implementation plugs
in here without the scheduler changing. Contract: a sequence may compute ``n`` new tokens only after
``allocate(seq, n)`` succeeded; ``free(seq)`` returns everything the sequence holds.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

from oasiskv.engine.sequence import Sequence


class KVAllocator(ABC):
    block_size: int  #: tokens per block

    @property
    @abstractmethod
    def num_total_blocks(self) -> int: ...

    @property
    @abstractmethod
    def num_free_blocks(self) -> int: ...

    @abstractmethod
    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Whether ``seq`` can hold ``num_new_tokens`` more computed tokens right now."""

    @abstractmethod
    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Grow ``seq.block_table`` to hold its computed tokens plus ``num_new_tokens``."""

    @abstractmethod
    def free(self, seq: Sequence) -> None:
        """Release every block ``seq`` holds and clear its block table."""

    def blocks_to_add(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks ``seq``'s table must grow by to hold its computed tokens plus
        ``num_new_tokens``."""
        return max(0, -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size)
                   - len(seq.block_table))

    def reuse_prefix(self, seq: Sequence) -> int:
        """Attach already-cached blocks for a new sequence's prompt; returns tokens skipped
        (default 0)."""
        return 0

    def can_adopt(self) -> bool:
        """Whether a fresh sequence can ``adopt`` blocks now (default: this allocator never
        lets it)."""
        return False

    def adopt(self, seq: Sequence, blocks: list[int]) -> None:
        """A fresh sequence takes held ``blocks`` (another engine's prefill, ``engine/handoff.py``)
        as its block table: each hold becomes its reference."""
        raise NotImplementedError(f"{type(self).__name__} takes no handed-off prompts")

    def release(self, blocks: list[int]) -> None:
        """Give back one hold of each of ``blocks``."""
        raise NotImplementedError(f"{type(self).__name__} holds no blocks")

    def on_computed(self, seq: Sequence) -> None:
        """Called after a step computed tokens of ``seq`` (e.g. to register completed blocks)."""
