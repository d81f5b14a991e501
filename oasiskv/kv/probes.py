"""TierProbes: what a harness (a benchmark, the fidelity eval, a test) may attach to the tiered KV.

The served engine runs without any. ``observers`` are told each layer's top-K blocks (see
``TieredKV.notify``; an engine with observers never replays CUDA graphs: observers read on the
host). ``host_store`` builds the host store instead of ``HostStore`` (e.g. the benchmark's emulated
capacity). ``stall_clock`` times the foreground's waits for, and in-line runs of, selection and
fetch: its ``measure()`` is a context manager around that foreground work, entered when graphs are
captured too. ``before_copy`` runs on the copy stream before each lookahead copy (tests slow it).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Protocol


class StallClock(Protocol):
    def measure(self) -> contextlib.AbstractContextManager: ...


@dataclass
class TierProbes:
    observers: list[Callable] = field(default_factory=list)
    host_store: Callable | None = None  #: (layout, num_blocks, pin) -> HostStore
    stall_clock: StallClock | None = None
    before_copy: Callable[[], None] | None = None

    def stall(self) -> contextlib.AbstractContextManager:
        """The stall clock's scope (nothing when there is no clock)."""
        return self.stall_clock.measure() if self.stall_clock else contextlib.nullcontext()
