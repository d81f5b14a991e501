"""Handoff: a prompt prefilled by one engine and decoded by another, without the prompt's KV.

The engine that prefills (a prefill worker) runs the whole prompt, as for a one-token request, and
keeps what decoding needs beyond the KV itself: the last prompt token's final hidden state (what
the LM head reads: the decoding engine samples the first token from it, with the request's own
sampling parameters) and, per layer, its query (what the tiered KV's seeding scores the blocks
with). It holds the prompt's host blocks until the decoding engine has what it wants of them.

The decoding engine (``LLMEngine.add_handoff``) gets a ``Handoff`` whose ``blocks`` are its own
held host blocks for the whole prompt: the complete ones before the last token's block named by
their hashes with their summaries written (their bytes may stay remote: a decode-host cache reads
them when a selection wants them), and the last token's block with its bytes. The request added
next with the same prompt takes it (``HandoffTable.take``): the scheduler admits it without a
forward, the backend seeds each layer's working set from the queries (the same selection the
prefilling engine made), and the first token is sampled from the hidden state. A handoff no
request takes within ``grace_s`` (and none of its prompt waits for) lets its blocks go
(``LLMEngine.expire_handoffs``, which servers call on a timer: an idle engine does not step), as
does one whose waiting request is aborted.
"""
from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, Container, Hashable

import torch


@dataclass
class Handoff:
    """``hidden`` ``[hidden_size]`` and ``queries`` ``[num_layers, Hq, D]`` (float32, CPU): the last
    prompt token's final hidden state and its post-RoPE query at each layer. ``blocks``: host blocks
    covering the whole prompt (``ceil(P / B)``), held by whoever made the handoff."""
    hidden: torch.Tensor
    queries: torch.Tensor
    blocks: list[int] = field(default_factory=list)
    created: float = field(default_factory=time.monotonic)


class HandoffTable:
    """Handoffs waiting to be taken, by key (a prompt's token ids as a tuple, or a request id),
    oldest first. ``release(blocks)`` lets go of the holds of a handoff nobody took."""

    def __init__(self, release: Callable[[list[int]], None], grace_s: float = 30.0):
        self._release, self.grace_s = release, grace_s
        self._by_key: defaultdict[Hashable, list[Handoff]] = defaultdict(list)

    def __len__(self) -> int:
        return sum(len(v) for v in self._by_key.values())

    def __bool__(self) -> bool:
        return bool(self._by_key)

    def add(self, key: Hashable, handoff: Handoff) -> None:
        self._by_key[key].append(handoff)

    def peek(self, key: Hashable) -> Handoff | None:
        """The oldest handoff under ``key``, left in the table."""
        waiting = self._by_key.get(key) if self._by_key else None
        return waiting[0] if waiting else None

    def take(self, key: Hashable) -> Handoff | None:
        """The oldest handoff under ``key``, out of the table (its holds pass to the caller)."""
        waiting = self._by_key.get(key) if self._by_key else None
        if not waiting:
            return None
        handoff = waiting.pop(0)
        if not waiting:
            del self._by_key[key]
        return handoff

    def drop(self, key: Hashable, handoff: Handoff | None = None) -> bool:
        """Let go of ``handoff`` (default: the oldest) under ``key``; whether it was there."""
        waiting = self._by_key.get(key, [])
        handoff = handoff if handoff is not None else (waiting[0] if waiting else None)
        if handoff is None or not any(h is handoff for h in waiting):
            return False
        waiting[:] = [h for h in waiting if h is not handoff]
        if not waiting:
            del self._by_key[key]
        self._release(handoff.blocks)
        return True

    def expire(self, now: float | None = None, keep: Container[Hashable] = ()) -> int:
        """Let go of the handoffs older than ``grace_s``, but those under a key in ``keep`` (a
        request of theirs is waiting); returns how many."""
        if not self._by_key:
            return 0
        cutoff = (time.monotonic() if now is None else now) - self.grace_s
        gone = 0
        for key in [k for k in self._by_key if k not in keep]:
            waiting = self._by_key[key]
            for h in [h for h in waiting if h.created <= cutoff]:
                waiting.remove(h)
                self._release(h.blocks)
                gone += 1
            if not waiting:
                del self._by_key[key]
        return gone

    def clear(self) -> None:
        for waiting in self._by_key.values():
            for h in waiting:
                self._release(h.blocks)
        self._by_key.clear()
