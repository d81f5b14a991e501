"""BlockManager: the paged HBM KV pool's allocator (free list, ref counts, prefix sharing).

Invariants (checked by ``check_invariants`` in tests): every block is either on the free list with
ref count 0 or owned by ``ref_count`` block tables; a block id appears at most once per table; a
block that is cached (its hash registered) holds exactly the tokens that hash names.

Prefix sharing: a completed block is registered under the hash of all tokens up to its end. A new
sequence whose prompt starts with registered blocks takes them (ref count + 1) instead of computing
them. Freed blocks keep their hash until they are handed out again, so a later request can revive
them. The chain hashes ints only, so every process computes the same chain for the same tokens.

Sequence slots (``num_seq_slots``): a backend that keeps a fixed-size piece of state per running
sequence (the tiered working sets, the dense pool's open blocks in the model's dtype) has every
sequence that holds blocks hold one slot too, ``slot_of[seq.seq_id]``, taken with its first blocks
and given back by ``free``; a sequence is admitted only when a slot is free.

Holds: blocks can also be held outside any block table (``hold_cached`` / ``hold_new``, given back
with ``release``), while their contents move between engines (``kv/exchange.py``); a held block
counts one reference, so it is never handed out or evicted.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

import numpy as np

from oasiskv.engine.free_list import FreeList
from oasiskv.engine.kv_allocator import KVAllocator
from oasiskv.engine.sequence import Sequence


class BlockManager(KVAllocator):
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_sharing: bool = True,
                 num_seq_slots: int | None = None):
        if num_blocks < 1:
            raise ValueError(f"the KV pool needs at least one block, got {num_blocks}")
        self.block_size = block_size
        self._num_blocks = num_blocks
        self.ref_counts = np.zeros(num_blocks, dtype=np.int64)
        self.free_blocks = FreeList(num_blocks)  # in reuse order, oldest freed first
        self.enable_prefix_sharing = enable_prefix_sharing
        self.hash_to_block: dict[int, int] = {}
        self.block_hash: dict[int, int] = {}
        self._hashed: dict[int, tuple[int, int]] = {}  # seq_id -> (blocks hashed, last hash)
        self.held: Counter[int] = Counter()  # block -> holds outside block tables
        self.evictions = 0  #: cached blocks handed out again (their prefix forgotten), so far
        self.num_seq_slots = num_seq_slots
        self.free_slots: list[int] = list(range((num_seq_slots or 0) - 1, -1, -1))
        self.slot_of: dict[int, int] = {}  #: seq id -> its sequence slot (with num_seq_slots)

    @property
    def num_total_blocks(self) -> int:
        return self._num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def needs_slot(self, seq: Sequence) -> bool:
        """Whether ``seq`` must take a sequence slot before it holds blocks."""
        return self.num_seq_slots is not None and seq.seq_id not in self.slot_of

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        n = self.blocks_to_add(seq, num_new_tokens)
        needs_slot = self.needs_slot(seq)
        if not n and not needs_slot:  # (most decode steps: no sequence starts a block)
            return True
        blocks = self._blocks_fit(n)
        fits = blocks and (not needs_slot or bool(self.free_slots))
        if not fits and needs_slot:
            self._refused(blocks)
        return fits

    def _blocks_fit(self, n: int) -> bool:
        """Whether ``n`` more blocks can be handed out now."""
        return n <= len(self.free_blocks)

    def _refused(self, blocks_fit: bool) -> None:
        """A sequence that needs a slot was refused: for want of blocks or (``blocks_fit``) of a
        slot."""

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        needs_slot = self.needs_slot(seq)
        if needs_slot and not self.free_slots:
            raise RuntimeError("KV exhausted: no sequence slot left")
        n = self.blocks_to_add(seq, num_new_tokens)
        if n:
            seq.block_table += self._take_free(n)
        if needs_slot:
            self.slot_of[seq.seq_id] = self.free_slots.pop()

    def free(self, seq: Sequence) -> None:
        """Drop ``seq``'s reference to each of its blocks; those no one references join the end of
        the free list, its last block first. Its sequence slot is free again."""
        self._drop(reversed(seq.block_table))
        seq.block_table = []
        self._hashed.pop(seq.seq_id, None)
        slot = self.slot_of.pop(seq.seq_id, None)
        if slot is not None:
            self.free_slots.append(slot)

    def reuse_prefix(self, seq: Sequence) -> int:
        """Share registered blocks covering the start of a fresh prompt (never its last token)."""
        if (not self.enable_prefix_sharing or seq.block_table
                or seq.params.prompt_logprobs is not None):
            return 0
        last = 0
        for h in self.prompt_hashes(seq.token_ids):
            block = self.hash_to_block.get(h)
            if block is None:
                break
            self._take(block)
            seq.block_table.append(block)
            last = h
        seq.num_computed_tokens = len(seq.block_table) * self.block_size
        self._hashed[seq.seq_id] = (len(seq.block_table), last)
        return seq.num_computed_tokens

    def prompt_hashes(self, tokens: list[int]) -> list[int]:
        """The hash chain of a prompt's shareable blocks: the complete ones before its last
        token."""
        return self._chain(tokens, 0, (len(tokens) - 1) // self.block_size, 0)

    def _chain(self, tokens: list[int], first: int, end: int, last: int) -> list[int]:
        """Chain hashes of blocks ``first .. end - 1`` of ``tokens``, going on from ``last``, the
        hash of block ``first - 1`` (0 before the first block)."""
        bs, chain = self.block_size, []
        for i in range(first, end):
            last = hash((last, tuple(tokens[i * bs:(i + 1) * bs])))
            chain.append(last)
        return chain

    def hold_cached(self, hashes: list[int]) -> list[int]:
        """Hold the registered blocks of the longest leading run of ``hashes``; returns them."""
        blocks = []
        for h in hashes:
            block = self.hash_to_block.get(h)
            if block is None:
                break
            blocks.append(block)
        self.hold(blocks)
        return blocks

    def hold_new(self, n: int, remote: bool = False) -> list[int]:
        """Hold ``n`` free blocks (the oldest freed, their hashes forgotten), for contents written
        from outside (``remote``: contents that stay on another engine's store); raises
        ``RuntimeError`` when fewer are free."""
        blocks = self._take_free(n, remote)
        self.held.update(blocks)
        return blocks

    def hold(self, blocks: list[int]) -> None:
        """One more hold of each of ``blocks`` (registered or referenced ones, e.g. a live
        sequence's table)."""
        for block in blocks:
            self._take(block)
            self.held[block] += 1

    def adopt(self, seq: Sequence, blocks: list[int]) -> None:
        assert not seq.block_table, "only a fresh sequence adopts blocks"
        needs_slot = self.needs_slot(seq)
        if needs_slot and not self.free_slots:
            raise RuntimeError("KV exhausted: no sequence slot left")
        self._unhold(blocks)
        seq.block_table = list(blocks)
        if needs_slot:
            self.slot_of[seq.seq_id] = self.free_slots.pop()

    def register(self, block: int, h: int) -> None:
        """Name a held block's (now complete) contents by chain hash ``h`` (kept if the hash or the
        block is named already)."""
        assert self.held[block] > 0, f"block {block} is not held"
        if self.enable_prefix_sharing:
            self._name(block, h)

    def _name(self, block: int, h: int) -> None:
        """Register ``block`` under chain hash ``h``, unless the hash or the block is named
        already."""
        if h not in self.hash_to_block and block not in self.block_hash:
            self.hash_to_block[h] = block
            self.block_hash[block] = h

    def release(self, blocks: list[int]) -> None:
        """Give back one hold of each of ``blocks``; a block no one references is free again (the
        most recently freed: the last to be handed out)."""
        self._unhold(blocks)
        self._drop(blocks)

    def _unhold(self, blocks: list[int]) -> None:
        """One hold less of each of ``blocks`` (their references stay)."""
        for block in blocks:
            assert self.held[block] > 0, f"block {block} is not held"
            self.held[block] -= 1
            if not self.held[block]:
                del self.held[block]

    def _take_free(self, n: int, remote: bool = False) -> list[int]:
        """``n`` free blocks, the oldest freed first, each with one reference and its hash
        forgotten; ``RuntimeError`` (nothing taken) when fewer are free. ``remote``: their contents
        stay on another engine's store (``hold_new``)."""
        if n > len(self.free_blocks):
            raise RuntimeError(f"KV pool exhausted: need {n} blocks, {len(self.free_blocks)} free")
        if not n:
            return []
        blocks = self.free_blocks.pop(n)
        self.ref_counts[blocks] = 1
        blocks = blocks.tolist()
        if self.block_hash:
            for block in blocks:
                self._forget_hash(block)
        return blocks

    def _take(self, block: int) -> None:
        """One more reference to ``block`` (off the free list if it was free)."""
        if self.ref_counts[block] == 0:
            self.free_blocks.remove(block)
        self.ref_counts[block] += 1

    def _drop(self, blocks: Iterable[int]) -> np.ndarray:
        """One reference less to each of ``blocks`` (distinct); those no one references go to the
        end of the free list, in order, and are returned (vectorised: a 32K-token sequence frees
        2,048 at once)."""
        blocks = np.fromiter(blocks, dtype=np.int64)
        left = self.ref_counts[blocks] - 1
        assert (left >= 0).all(), f"blocks {blocks[left < 0].tolist()} freed twice"
        self.ref_counts[blocks] = left
        freed = blocks[left == 0]
        self.free_blocks.push(freed)
        return freed

    def on_computed(self, seq: Sequence) -> None:
        """Register blocks of ``seq`` that became complete."""
        if not self.enable_prefix_sharing:
            return
        done, last = self._hashed.get(seq.seq_id, (0, 0))
        end = seq.num_computed_tokens // self.block_size
        if end <= done:
            return
        chain = self._chain(seq.token_ids, done, end, last)
        for block, h in zip(seq.block_table[done:end], chain):
            self._name(block, h)
        self._hashed[seq.seq_id] = (end, chain[-1])

    def _forget_hash(self, block: int) -> None:
        h = self.block_hash.pop(block, None)
        if h is not None:
            del self.hash_to_block[h]
            self.evictions += 1

    def check_invariants(self, live: list[Sequence]) -> None:
        """Assert ref counts match the live block tables and the free list (tests call this)."""
        counts = [0] * self._num_blocks
        for block, holds in self.held.items():
            counts[block] += holds
        for seq in live:
            assert len(set(seq.block_table)) == len(seq.block_table), "block twice in one table"
            for b in seq.block_table:
                counts[b] += 1
        assert counts == self.ref_counts.tolist(), "ref counts disagree with block tables"
        free = set(self.free_blocks)
        assert all((self.ref_counts[b] == 0) == (b in free) for b in range(self._num_blocks))
        assert all(self.hash_to_block[h] == b for b, h in self.block_hash.items())
        if self.num_seq_slots is not None:  # every slot free or owned by one live sequence
            assert set(self.slot_of) <= {s.seq_id for s in live}
            slots = list(self.slot_of.values())
            assert len(slots) == len(set(slots)) and not set(slots) & set(self.free_slots)
            assert len(slots) + len(self.free_slots) == self.num_seq_slots
