"""Attention backends: the seam where KV storage and attention kernels plug into the model.

``make_backend`` picks one by ``EngineConfig.kv_mode``: ``dense`` (paged HBM pool) or ``oasis``
(full KV in a host store, per-head working sets in HBM)."""
from __future__ import annotations

import torch

from oasiskv.attention.base import AttentionBackend
from oasiskv.config import EngineConfig, ModelConfig


def make_backend(config: EngineConfig, model_config: ModelConfig, dtype: torch.dtype,
                 device: torch.device) -> AttentionBackend:
    if config.kv_mode == "oasis":
        from oasiskv.attention.sparse import SparseBackend
        return SparseBackend(config, model_config, dtype, device)
    from oasiskv.attention.dense import DenseBackend
    return DenseBackend(config, model_config, dtype, device)
