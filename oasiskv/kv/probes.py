"""TierProbes: what a harness (a benchmark, the fidelity eval, a test) may attach to the tiered KV.

The served engine runs without any. ``observers`` are told each layer's top-K blocks (see
``TieredKV.notify``; an engine with observers never replays CUDA graphs: observers read on the
host). ``host_store`` builds the host store instead of ``HostStore`` (e.g. the benchmark's emulated
capacity). ``before_copy`` runs on the copy stream before each lookahead copy (tests slow it).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable


@dataclass
class TierProbes:
    observers: list[Callable] = field(default_factory=list)
    host_store: Callable | None = None  #: (layout, num_blocks, pin) -> HostStore
    before_copy: Callable[[], None] | None = None
