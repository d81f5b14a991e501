"""KV exchange: the bookkeeping that moves a prompt's complete blocks between two engines' host
stores (disaggregated prefill), on each engine's own thread. The bytes move elsewhere (NIXL,
``kv/remote.py``); this module only decides which host blocks they come from and land in.

A prompt's complete blocks before its last token are named by their block-hash chain
(``BlockManager.prompt_hashes``), which every process computes alike from the token ids. The
exporting engine (a prefill worker) holds the blocks of a prompt it has just prefilled (``export``),
so that nothing evicts them while a reader copies them, until ``release``. The importing engine (the
decode worker) holds, per offered block, either the block its own host store already has under the
same hash (a prefix it has seen: nothing to read) or a fresh block to read into (``begin_import``);
once the bytes are in, ``finish_import`` writes the new blocks' summaries, names them by their
hashes and lets go of every hold: the request added right after finds the whole prefix in the
prefix cache and prefills only the rest (less than a block and the last token). If the blocks were
evicted before it was admitted (only when the host store is short), it prefills them itself: a cost,
never a wrong token. ``abort_import`` lets go without naming anything.

Partial admission (``engine/handoff.py``): the exporting engine prefills the whole prompt and
holds every block of it (``LLMEngine.take_handoff``); the importing engine holds, as for a full
import, a block per complete block before the last token's, plus a fresh one for the last token's
block (``begin_handoff``), reads only that last block, writes the summaries the exporter sends
(``SummaryStore.read`` there, ``finish_handoff`` here) and leaves the other blocks' bytes where they
are: a decode-host cache locates them and reads each (block, layer) a selection wants.

Holds are bounded: at most ``MAX_HELD_SHARE`` of the host store is held for exchanges at once, so
moving KV never starves the engine's own requests of blocks; past it an export offers nothing and
an import is refused (the prompt is then prefilled where it is).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from oasiskv.engine.block_manager import BlockManager
from oasiskv.kv.host_store import HostStore
from oasiskv.kv.layout import TieredLayout

#: the most of a host store's blocks that exchanges may hold at once
MAX_HELD_SHARE = 0.5


class NoRoom(RuntimeError):
    """An import that would need more free host blocks, or more holds, than there are now."""


@dataclass
class Import:
    """One prompt's import: ``blocks[i]`` (held) receives offered block ``i``; only the blocks at
    ``missing`` must be read."""
    hashes: list[int]
    blocks: list[int]
    missing: list[int]


@dataclass
class _StoreOnly:
    """The KV side of an exchange with no engine: a host store and its layout."""
    layout: TieredLayout
    host: HostStore


class KVExchange:
    """Exports and imports complete prompt blocks of a tiered engine's host store (``backend``: its
    ``SparseBackend``, with a prefix-sharing allocator)."""

    def __init__(self, backend):
        allocator = getattr(backend, "allocator", None)
        if allocator is None or not hasattr(backend, "kv"):
            raise ValueError("moving prompt KV between engines needs the tiered KV path "
                             "(--kv-mode oasis)")
        if not allocator.enable_prefix_sharing:
            raise ValueError("moving prompt KV between engines needs prefix sharing, which a "
                             "drafter reading every prompt token's features (EAGLE-3) turns off")
        self.allocator, self.kv = allocator, backend.kv
        self.summarises = True  # (``finish_import``)
        self.max_held = int(MAX_HELD_SHARE * allocator.num_total_blocks)
        #: blocks holds will take that are not held yet (a prefill worker's handoffs still
        #: prefilling: ``LLMEngine.pending_handoff_blocks``), counted against ``max_held``; called
        #: where the store's bookkeeping runs
        self.reserved: Callable[[], int] = lambda: 0

    @classmethod
    def store_only(cls, layout: TieredLayout, host: HostStore) -> "KVExchange":
        """An exchange over ``host`` with no engine behind it (a memory worker's): it holds,
        names and serves blocks and computes nothing, so it keeps no summaries (whoever imports
        its blocks writes their own), and no requests of its own to leave blocks for: every block
        may be held."""
        self = cls.__new__(cls)
        self.allocator = BlockManager(host.num_blocks, layout.block_size)
        self.kv = _StoreOnly(layout, host)
        self.summarises = False
        self.max_held = host.num_blocks
        self.reserved = lambda: 0
        return self

    def has_room(self, n: int) -> bool:
        """Whether ``n`` more blocks may be held for exchanges now (besides ``reserved``)."""
        return sum(self.allocator.held.values()) + self.reserved() + n <= self.max_held

    @property
    def block_bytes(self) -> int:
        """Bytes one whole host block holds (K and V, every layer and kv head)."""
        return self.kv.layout.host_block_bytes

    def prompt_hashes(self, token_ids: list[int]) -> list[int]:
        """The hash chain of ``token_ids``' complete blocks before its last token: a pure function
        of the tokens and the block size, safe on any thread (hash off the engine's, once)."""
        return self.allocator.prompt_hashes(token_ids)

    def uncached(self, hashes: list[int]) -> int:
        """How many of a prompt's complete blocks (their ``prompt_hashes``) this store's prefix
        cache does not hold: those after the longest leading run it has."""
        held = next((i for i, h in enumerate(hashes) if h not in self.allocator.hash_to_block),
                    len(hashes))
        return len(hashes) - held

    def export(self, token_ids: list[int]) -> list[int]:
        """Hold the host blocks of ``token_ids``' complete prefix that this store has (in chain
        order, the longest leading run; none past the bound on holds); ``release`` them when
        read."""
        hashes = self.allocator.prompt_hashes(token_ids)
        if not self.has_room(len(hashes)):
            return []
        return self.allocator.hold_cached(hashes)

    def release(self, blocks: list[int]) -> None:
        self.allocator.release(blocks)

    def begin_import(self, hashes: list[int], remote: bool = False, tail: bool = False) -> Import:
        """Hold a host block for each of the offered complete blocks of a prompt (the first of its
        ``prompt_hashes``): the cached one where this store has it, else a fresh one to read into.
        Raises ``NoRoom`` (nothing held) when the store has too few free blocks or the holds would
        pass their bound. ``remote``: the fresh blocks' bytes stay where they are (a decode-host
        cache gives them no rows: ``locate`` them). ``tail``: one fresh block more, last (with a
        row), also missing: the block of the prompt's last token."""
        n = len(hashes) + tail
        if not self.has_room(n):
            raise NoRoom(f"exchanges hold {sum(self.allocator.held.values())} host blocks "
                         f"(at most {self.max_held}): no room for {n} more")
        cached = self.allocator.hold_cached(hashes)
        fresh = []
        try:
            fresh += self.allocator.hold_new(len(hashes) - len(cached), remote)
            fresh += self.allocator.hold_new(1) if tail else []
        except RuntimeError as exc:
            self.allocator.release(cached + fresh)
            raise NoRoom(str(exc)) from None
        return Import(hashes, cached + fresh, list(range(len(cached), n)))

    def finish_import(self, imp: Import, keep: bool = False) -> list[int]:
        """The missing blocks' bytes are in: summarise them, name each by its hash, let go; with
        ``keep`` the holds pass to the caller instead (to ``release`` ``imp.blocks``, returned,
        later: a memory worker serves them on). A failure lets go in any case and leaves the fresh
        blocks unnamed."""
        try:
            if imp.missing:
                if self.summarises:
                    fresh = torch.tensor([imp.blocks[i] for i in imp.missing], dtype=torch.long,
                                         device=self.kv.device)
                    self.kv.summarise(fresh)
                for i in imp.missing:
                    self.allocator.register(imp.blocks[i], imp.hashes[i])
        except BaseException:
            self.allocator.release(imp.blocks)
            raise
        if not keep:
            self.allocator.release(imp.blocks)
        return imp.blocks

    def begin_handoff(self, hashes: list[int]) -> Import:
        """``begin_import`` of a prompt's complete blocks before its last token's (``hashes``),
        plus a fresh held block last: the last token's block, to read whole. Needs a decode-host
        cache (the other blocks are read from where they are when wanted)."""
        if not self.kv.host.evicts:
            raise ValueError("partial admission needs a decode-host cache (--f-host < 1): a "
                             "host store that keeps every block would never read them")
        return self.begin_import(hashes, remote=True, tail=True)

    def finish_handoff(self, imp: Import, num_tokens: int, first: int,
                       summaries: list[torch.Tensor]) -> list[int]:
        """The last block's bytes are in: write ``summaries`` (the exporter's ``SummaryStore.read``
        of its complete blocks ``first ..``) into this import's fresh complete blocks, name those
        by their hashes. Returns the held blocks (the caller's now: a ``Handoff``'s). Raises
        ``NoRoom`` (nothing held) when a block before ``first``, whose summary was not sent, is
        not one this store had. ``num_tokens``: the prompt's."""
        complete = num_tokens // self.kv.layout.block_size
        fresh = [i for i in imp.missing if i < complete]
        try:
            if fresh and fresh[0] < first:
                raise NoRoom(f"block {fresh[0]} of the prompt left this store's prefix cache "
                             "before its summary was sent")
            if fresh:
                self.kv.summaries.write(
                    torch.tensor([imp.blocks[i] for i in fresh], dtype=torch.long,
                                 device=self.kv.device),
                    [t[:, [i - first for i in fresh]] for t in summaries])
            for i in imp.missing[:-1]:  # (the last token's block is named once computed)
                self.allocator.register(imp.blocks[i], imp.hashes[i])
        except BaseException:
            self.allocator.release(imp.blocks)
            raise
        return imp.blocks

    def abort_import(self, imp: Import) -> None:
        """Let go of an import whose bytes did not arrive (its fresh blocks stay unnamed)."""
        self.allocator.release(imp.blocks)
