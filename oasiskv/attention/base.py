"""AttentionBackend: the interface between attention layers and the KV cache.

A backend owns the KV storage for every layer and computes attention for one layer given the step's
``ForwardBatch``. The model runner calls ``allocate`` once (after sizing), then runs the model; each
attention layer calls ``forward``. Graph capture needs nothing special from a backend whose
``forward`` reads only the batch's tensors (the CUDA-graph runner keeps those static).
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from oasiskv.engine.forward_batch import ForwardBatch


class AttentionBackend(ABC):
    @abstractmethod
    def bytes_per_block(self) -> int:
        """Device bytes one KV block takes over all layers (used to size the pool)."""

    @abstractmethod
    def allocate(self, num_blocks: int) -> None:
        """Create the KV storage for ``num_blocks`` blocks. Before this, ``forward`` must still work
        for prefill without prefix (warm-up) and store nothing."""

    @abstractmethod
    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                batch: ForwardBatch, scale: float) -> torch.Tensor:
        """Store this step's k/v ``[T, Hk, D]`` and return attention of q ``[T, Hq, D]`` -> ``[T, Hq, D]``."""
