"""AttentionBackend: the interface between attention layers and the KV storage.

A backend owns the KV storage of every layer and computes attention for one layer from the step's
``ForwardBatch``. Lifecycle: the model runner builds it, runs a warm-up prefill (``forward`` must work
before ``allocate`` for a prefill without prefix, storing nothing), calls ``allocate`` with the HBM
budget it measured (None on CPU), then asks ``make_allocator`` for the matching ``KVAllocator`` the
scheduler consults. A backend whose ``forward`` reads only the batch's tensors and never syncs the
host can be captured in CUDA graphs (``supports_cuda_graphs``).
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from oasiskv.engine.forward_batch import ForwardBatch
from oasiskv.engine.kv_allocator import KVAllocator


class AttentionBackend(ABC):
    supports_cuda_graphs: bool = True

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
