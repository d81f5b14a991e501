"""Attention backends: the seam where KV storage and attention kernels plug into the model.

``make_backend`` picks one by ``EngineConfig.kv_mode``: ``dense`` (paged HBM pool) or ``oasis``
(full KV in a host store, per-head working sets in HBM). A ``BackendFactory`` has its signature:
harnesses (benchmarks, tests) pass their own to ``LLMEngine`` to build a backend with probes."""
from __future__ import annotations

from typing import Callable

import torch

from oasiskv.attention.base import AttentionBackend
from oasiskv.config import EngineConfig

#: (config, model, dtype, device) -> the engine's attention backend
BackendFactory = Callable[[EngineConfig, torch.nn.Module, torch.dtype, torch.device],
                          AttentionBackend]


def make_backend(config: EngineConfig, model: torch.nn.Module, dtype: torch.dtype,
                 device: torch.device) -> AttentionBackend:
    if config.kv_mode == "oasis":
        from oasiskv.attention.sparse import SparseBackend
        return SparseBackend(config, model, dtype, device)
    from oasiskv.attention.dense import DenseBackend
    return DenseBackend(config, model, dtype, device)
