"""What the benchmarks and the eval attach to an engine: probes the served engine never carries.

- ``EmulatedHostStore``: a host store that answers for more block ids than it holds (capacity
  emulation, benchmark only): id b lives in physical block b mod ``num_physical``, so requests share
  physical blocks. Bytes moved and access patterns are real, the contents are not: only for
  random-weight throughput runs, and every output says so (``emulated_label``).
- ``make_engine``: the engine a benchmark point (or a served benchmark worker,
  ``serve --emulated-host-gib``) runs, with an emulated host store when asked.
- ``oasis_backend``: a backend factory for ``LLMEngine`` that builds the sparse backend with probes
  (and optionally a drafter of the harness's own, e.g. the eval's oracle); picklable when they
  are, so that tensor-parallel ranks build the same.
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch

from oasiskv.attention.sparse import SparseBackend
from oasiskv.config import EngineConfig
from oasiskv.engine.llm_engine import LLMEngine
from oasiskv.kv.host_store import HostStore
from oasiskv.kv.layout import TieredLayout
from oasiskv.kv.probes import TierProbes
from oasiskv.kv.tiered import host_blocks_for

logger = logging.getLogger(__name__)


class EmulatedHostStore(HostStore):
    """``num_blocks`` host block ids on ``num_physical`` physical blocks (ids share rows)."""

    def __init__(self, layout: TieredLayout, num_blocks: int, pin: bool, num_physical: int):
        super().__init__(layout, min(num_physical, num_blocks), pin)
        self.num_physical, self.num_blocks = self.num_blocks, max(num_blocks, num_physical)
        logger.warning("EMULATED host capacity: %d block ids share %d physical blocks (benchmark "
                       "only: KV contents are shared between requests)", self.num_blocks,
                       self.num_physical)

    def physical_blocks(self, ids: torch.Tensor, layer: int | None = None,
                        ensure: bool = True) -> torch.Tensor:
        return torch.where(ids >= 0, ids % self.num_physical, ids)

    def rows_of(self, ids: list[int]) -> list[int]:
        return [i % self.num_physical for i in ids]

    def physical_slots(self, slots: torch.Tensor) -> torch.Tensor:
        span = self.num_physical * self.layout.block_size
        return torch.where(slots >= 0, slots % span, slots)


@dataclass(frozen=True)
class emulated_host:  # noqa: N801 (used as a factory function)
    """A ``TierProbes.host_store`` factory: ``gib`` GiB of block ids over the physical store that
    ``host_kv_gib`` sizes (per rank: the bench passes each rank its share). Picklable, so every
    tensor-parallel rank builds its own."""
    gib: float

    def __call__(self, layout: TieredLayout, num_physical: int, pin: bool) -> HostStore:
        return EmulatedHostStore(layout, host_blocks_for(self.gib, layout), pin, num_physical)


def emulated_label(engine) -> str:
    """What every output of an engine with an emulated host store says ('' otherwise)."""
    store = getattr(getattr(engine.runner.backend, "kv", None), "host", None)
    if not isinstance(store, EmulatedHostStore):
        return ""
    return f"EMULATED host: {store.num_blocks} block ids on {store.num_physical} physical blocks"


def oasis_backend(probes: TierProbes, drafter=None):
    """A ``BackendFactory`` building ``SparseBackend`` with ``probes`` (and ``drafter``)."""
    return functools.partial(SparseBackend, probes=probes, drafter=drafter)


def make_engine(config: EngineConfig, emulated_host_gib: float = 0.0) -> LLMEngine:
    """The engine a bench point runs: in oasis mode with the harness's probes (an emulated host
    store of ``emulated_host_gib`` GiB when > 0)."""
    if config.kv_mode != "oasis" or not emulated_host_gib:
        return LLMEngine(config)
    # (as --host-kv-gib: the total over the ranks, each emulating its kv heads' share)
    probes = TierProbes(host_store=emulated_host(emulated_host_gib / config.tensor_parallel_size))
    return LLMEngine(config, backend_factory=oasis_backend(probes))
