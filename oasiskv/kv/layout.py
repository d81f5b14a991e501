"""TieredLayout: the shapes and byte sizes every tiered-KV structure derives from.

Host store, per K and V: ``[num_host_blocks, num_layers, Hk, B, D]`` (one (block, layer, kv-head)
slice of B*D elements is contiguous: the unit copied to HBM). Working set, per layer and K/V:
``[num_seq_slots, Hk, W, B, D]`` with W = K + 1 (slot W-1 is the local block). 8-bit storage adds
float32 scales of the same shapes without D (``kernels/fp8.py``). Summaries, per layer:
``[num_host_blocks, Hk, 2, D]`` (element-wise max, then min, of a block's post-RoPE keys; FP8 with
a scale per row). Beside 8-bit working sets, open blocks: per layer and K/V ``[num_seq_slots, Hk, B,
D]`` in the model's dtype (``open_block_bytes``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from oasiskv.kernels.fp8 import row_bytes, storage_dtype


@dataclass(frozen=True)
class TieredLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    topk_blocks: int          # K
    dtype: torch.dtype        # the model's: summaries, attention inputs
    kv_dtype: torch.dtype | None = None  # K/V storage (host store, working sets); None: dtype
    summary_dtype: torch.dtype | None = None  # summaries' storage; None: dtype

    @classmethod
    def of(cls, config, cfg, dtype: torch.dtype) -> "TieredLayout":
        """The layout an engine of ``config`` (``EngineConfig``) stores for a model of ``cfg``
        (``ModelConfig``) computing in ``dtype``: every process of a disaggregated setup with the
        same flags has the same one (a memory worker builds it without the model)."""
        return cls(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, config.block_size,
                   config.tier.topk_blocks, dtype, storage_dtype(config.kv_cache_dtype, dtype),
                   storage_dtype("fp8" if config.fp8_summaries else "auto", dtype))

    @property
    def storage_dtype(self) -> torch.dtype:
        return self.kv_dtype or self.dtype

    @property
    def summary_storage_dtype(self) -> torch.dtype:
        return self.summary_dtype or self.dtype

    @property
    def slots(self) -> int:
        """W = K resident blocks + the local block."""
        return self.topk_blocks + 1

    @property
    def local_slot(self) -> int:
        return self.topk_blocks

    @property
    def slice_bytes(self) -> int:
        """One (block, layer, kv-head) slice of K or V (8-bit: with its rows' scales)."""
        return self.block_size * row_bytes(self.head_dim, self.storage_dtype)

    @property
    def host_block_bytes(self) -> int:
        """K and V of one block over all layers and heads."""
        return 2 * self.num_layers * self.num_kv_heads * self.slice_bytes

    @property
    def working_set_bytes(self) -> int:
        """HBM one sequence's working sets take (all layers, K and V)."""
        return 2 * self.num_layers * self.num_kv_heads * self.slots * self.slice_bytes

    @property
    def open_block_bytes(self) -> int:
        """HBM one sequence's open blocks take where they are kept beside 8-bit working sets (all
        layers, K and V, in the model's dtype; ``kernels/fp8.py``)."""
        return (2 * self.num_layers * self.num_kv_heads * self.block_size * self.head_dim
                * self.dtype.itemsize)

    @property
    def summary_bytes_per_block(self) -> int:
        return (self.num_layers * self.num_kv_heads * 2
                * row_bytes(self.head_dim, self.summary_storage_dtype))

    def fetch_cap(self, fetch_ratio: float) -> int:
        """Most new blocks one head may admit per layer per step: ceil(f_HBM * K)."""
        return max(1, math.ceil(fetch_ratio * self.topk_blocks - 1e-9))
