"""DenseBackend: the paged HBM KV pool and dense attention over it.

Storage per layer: ``k_cache``/``v_cache`` ``[num_blocks, Hk, block_size, D]`` (one (block, kv-head)
slice is contiguous). Decode uses the paged decode kernel (Triton on CUDA, the torch reference on
CPU); prefill uses ``prefill_attention`` with the cached prefix gathered from the pool.
"""
from __future__ import annotations

import logging

import torch

from oasiskv.attention.base import AttentionBackend
from oasiskv.attention.prefill import prefill_attention
from oasiskv.config import EngineConfig
from oasiskv.engine.block_manager import BlockManager
from oasiskv.engine.forward_batch import ForwardBatch
from oasiskv.kernels.dispatch import kernel
from oasiskv.kernels.fp8 import as_bytes, dequantize, empty_kv, row_bytes, storage_dtype

logger = logging.getLogger(__name__)

CPU_KV_BYTES = 4 << 30


class DenseBackend(AttentionBackend):
    def __init__(self, config: EngineConfig, model: torch.nn.Module, dtype: torch.dtype,
                 device: torch.device):
        self.config = config
        model_config = model.cfg
        self.num_layers, self.num_kv_heads = model_config.num_layers, model_config.num_kv_heads
        self.head_dim, self.block_size = model_config.head_dim, config.block_size
        self.dtype, self.device = dtype, device
        self.kv_dtype = storage_dtype(config.kv_cache_dtype, dtype)
        self.num_blocks = 0
        self.k_cache: list[torch.Tensor] = []
        self.v_cache: list[torch.Tensor] = []
        self.scales: list[tuple[torch.Tensor, torch.Tensor] | None] = []  # per layer (8-bit only)
        cuda = device.type == "cuda"
        self._store, self._decode = kernel("store_kv", cuda), kernel("paged_decode_attention", cuda)

    def bytes_per_block(self) -> int:
        return (2 * self.num_layers * self.num_kv_heads * self.block_size
                * row_bytes(self.head_dim, self.kv_dtype))

    def allocate(self, budget_bytes: int | None) -> None:
        per_block = self.bytes_per_block()
        if self.config.num_kv_blocks:
            blocks = self.config.num_kv_blocks
        else:
            blocks = (CPU_KV_BYTES if budget_bytes is None else budget_bytes) // per_block
        if blocks < 1:
            raise RuntimeError(f"no memory left for the KV cache (one block needs {per_block} "
                               f"bytes): raise gpu_memory_utilization or lower "
                               f"max_num_batched_tokens")
        logger.info("KV pool: %d blocks of %d tokens (%.2f GiB, %d tokens, %s)", blocks,
                    self.block_size, blocks * per_block / 2**30, blocks * self.block_size,
                    str(self.kv_dtype).removeprefix("torch."))
        shape = (blocks, self.num_kv_heads, self.block_size, self.head_dim)
        self.num_blocks = blocks
        layers = [empty_kv(shape, self.kv_dtype, self.device) for _ in range(self.num_layers)]
        self.k_cache, self.v_cache, self.scales = (list(x) for x in zip(*layers))

    def make_allocator(self) -> BlockManager:
        return BlockManager(self.num_blocks, self.block_size)

    @property
    def max_tokens_per_seq(self) -> int:
        return self.num_blocks * self.block_size

    def forward(self, layer, q, k, v, batch: ForwardBatch, scale: float) -> torch.Tensor:
        if self.k_cache:
            self._store(k, v, self.k_cache[layer], self.v_cache[layer], batch.slot_mapping,
                        scales=self.scales[layer])
        if not batch.is_prefill:
            return self._decode(q, self.k_cache[layer], self.v_cache[layer], batch.block_tables,
                                batch.context_lens, scale, scales=self.scales[layer])
        return prefill_attention(q, k, v, batch, scale,
                                 lambda i, n: self._gather(layer, batch.block_tables[i], n))

    def _gather(self, layer: int, block_table: torch.Tensor, length: int):
        """K and V of one sequence's first ``length`` tokens as ``[Hk, length, D]`` (dequantized
        to the model's dtype from 8-bit storage)."""
        blocks = block_table[: -(-length // self.block_size)].long()
        scales = self.scales[layer]

        def take(cache, i):
            rows = as_bytes(cache)[blocks].view(cache.dtype)
            if scales is not None:
                rows = dequantize(rows, scales[i][blocks]).to(self.dtype)
            return rows.transpose(0, 1).reshape(self.num_kv_heads, -1, self.head_dim)[:, :length]
        return take(self.k_cache[layer], 0), take(self.v_cache[layer], 1)
