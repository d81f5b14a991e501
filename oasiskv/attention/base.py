"""AttentionBackend: the interface between attention layers and the KV storage.

A backend owns the KV storage of every layer and computes attention for one layer from the step's
``ForwardBatch``. Lifecycle: the model runner builds it, runs a warm-up prefill (``forward`` must work
before ``allocate`` for a prefill without prefix, storing nothing), calls ``allocate`` with the HBM
budget it measured (None on CPU), then asks ``make_allocator`` for the matching ``KVAllocator`` the
scheduler consults. A backend whose ``forward`` reads only the batch's tensors and never syncs the
host can be captured in CUDA graphs (``supports_cuda_graphs``): the graph runner pads a bucket with
rows of context length 0 at seq slot ``padding_slot``, asks ``can_graph`` before each replay, calls
``join_side_streams`` before and at the end of each capture (a graph must end with every side stream
joined), then keeps the capture's ``graph_tail``: work the step defers past its graph, which it hands
to ``run_graph_tail`` after each replay of that graph once the step's outputs have been read.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from oasiskv.engine.forward_batch import ForwardBatch
from oasiskv.engine.kv_allocator import KVAllocator


class AttentionBackend(ABC):
    supports_cuda_graphs: bool = True
    padding_slot: int = -1  #: ``seq_slots`` value of graph padding rows
    graph_draft_rows: bool = False  #: captured decode steps carry one lookahead draft row per sequence

    def can_graph(self, batch: ForwardBatch) -> bool:
        """Whether this decode step fits the captured layout (else it runs eagerly)."""
        return batch.draft_of is None

    def join_side_streams(self) -> None:
        """Order the current stream after any work the backend left on side streams."""

    def graph_tail(self):
        """After a capture: what the captured step left to run after each replay (None: nothing)."""
        return None

    def run_graph_tail(self, tail) -> None:
        """Start a replayed graph's ``graph_tail`` (the replay has completed: its outputs were read).
        The next replay must be ordered after it by the graph itself."""

    @abstractmethod
    def allocate(self, budget_bytes: int | None) -> None:
        """Create the KV storage within ``budget_bytes`` of device memory (None: the backend's CPU default
        or its explicit settings). Raises RuntimeError when not even one sequence fits."""

    @abstractmethod
    def make_allocator(self) -> KVAllocator:
        """The allocator that hands out this backend's storage (called once, after ``allocate``)."""

    @property
    @abstractmethod
    def max_tokens_per_seq(self) -> int:
        """The most tokens one sequence can hold once storage exists."""

    @abstractmethod
    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                batch: ForwardBatch, scale: float) -> torch.Tensor:
        """Store this step's k/v ``[T, Hk, D]`` and return attention of q ``[T, Hq, D]`` -> ``[T, Hq, D]``."""

    @abstractmethod
    def decode_read_bytes(self, context_lens: list[int]) -> int:
        """Device bytes one decode step's attention reads for sequences of these lengths (roofline)."""

    def step_stats(self) -> dict[str, float]:
        """Counters of the last step for the engine's stats (e.g. blocks fetched); empty by default."""
        return {}
