"""DenseBackend: the paged HBM KV pool and dense attention over it.

Storage per layer: ``k_cache``/``v_cache`` ``[num_blocks, Hk, block_size, D]`` (one (block, kv-head)
slice is contiguous). Decode uses the paged decode kernel (Triton on CUDA, the torch reference on
CPU); prefill uses ``prefill_attention`` over the cached prefix gathered from the pool.

Open blocks (an 8-bit pool with ``kv_open_block=model``, ``kernels/fp8.py``): per layer also
``open_k``/``open_v`` ``[max_num_seqs + 1, Hk, block_size, D]`` in the model's dtype, one block per
sequence slot (the allocator's, ``BlockManager.slot_of``; the last one is the scratch slot of graph
padding rows). Each step's tokens are stored in the pool and, for the tokens of each sequence's
last block, at their offset in its slot; decode reads each row's last block from there, and
prefill a prefix's partly written last block. The step's meta is an ``OpenStep``.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from oasiskv.attention.base import SlotBackend, StepPlan
from oasiskv.attention.prefill import open_block_rows, prefill_attention
from oasiskv.config import EngineConfig
from oasiskv.engine.block_manager import BlockManager
from oasiskv.engine.forward_batch import ForwardBatch, to_device_many
from oasiskv.engine.scheduler import ScheduledBatch
from oasiskv.kernels.dispatch import kernel
from oasiskv.kernels.fp8 import (OpenBlocks, as_bytes, dequantize, empty_kv, quantized, row_bytes,
                                 storage_dtype, v_rows)

logger = logging.getLogger(__name__)

CPU_KV_BYTES = 4 << 30


@dataclass
class OpenStep:
    """A step's open-block metadata (``ForwardBatch.meta``): ``slots`` int32 ``[B]`` each
    sequence's slot; ``rows`` int64 ``[T]`` where each row's K/V goes in the open blocks (slot *
    block_size + offset, -1: not in its sequence's last block); decode steps derive it from the
    slots and positions on the device (``DenseBackend.forward``)."""
    slots: torch.Tensor
    rows: torch.Tensor | None = None


class DenseBackend(SlotBackend):
    steps_ahead = True

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
        #: sequence slots with an open block each (0: none kept)
        self.open_slots = (config.max_num_seqs if quantized(self.kv_dtype)
                           and config.kv_open_block == "model" else 0)
        self.open_k: list[torch.Tensor] = []
        self.open_v: list[torch.Tensor] = []
        self.allocator: BlockManager | None = None
        self._statics: dict[int, OpenStep] = {}

    def bytes_per_block(self) -> int:
        return (2 * self.num_layers * self.num_kv_heads * self.block_size
                * row_bytes(self.head_dim, self.kv_dtype))

    def _open_shape(self) -> tuple[int, int, int, int]:
        return (self.open_slots + 1, self.num_kv_heads, self.block_size, self.head_dim)

    def allocate(self, budget_bytes: int | None) -> None:
        per_block = self.bytes_per_block()
        open_bytes = (2 * self.num_layers * math.prod(self._open_shape()) * self.dtype.itemsize
                      if self.open_slots else 0)
        if self.config.num_kv_blocks:
            blocks = self.config.num_kv_blocks
        else:
            budget = CPU_KV_BYTES if budget_bytes is None else budget_bytes - open_bytes
            blocks = budget // per_block
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
        if self.open_slots:
            logger.info("open blocks in %s: %d slots (%.2f GiB)", str(self.dtype)[6:],
                        self.open_slots, open_bytes / 2**30)
            self.open_k, self.open_v = ([torch.zeros(self._open_shape(), dtype=self.dtype,
                                                     device=self.device)
                                         for _ in range(self.num_layers)] for _ in range(2))

    def make_allocator(self) -> BlockManager:
        self.allocator = BlockManager(self.num_blocks, self.block_size,
                                      num_seq_slots=self.open_slots or None)
        return self.allocator

    @property
    def max_tokens_per_seq(self) -> int:
        return self.num_blocks * self.block_size

    # ---- one step --------------------------------------------------------------------------------
    def prepare(self, batch: ScheduledBatch) -> StepPlan:
        if not self.open_slots or self.allocator is None:
            return StepPlan()
        slots = [self.allocator.slot_of[s.seq_id] for s in batch.seqs]
        arrays = [(slots, torch.int32)]
        if batch.is_prefill:
            arrays.append((open_block_rows(batch, slots, self.block_size), torch.long))
        return StepPlan(OpenStep(*to_device_many(arrays, self.device)))

    def forward(self, layer, q, k, v, batch: ForwardBatch, scale: float) -> torch.Tensor:
        step: OpenStep | None = batch.meta
        # (prefill: the cached prefixes are read before this step's tokens overwrite a slot's
        # open block)
        prefixes = ({i: self._prefix(layer, batch, i) for i, n in enumerate(batch.prefix_lens)
                     if n} if batch.is_prefill else {})
        if self.k_cache:
            if step is not None and not batch.is_prefill and layer == 0:
                # one row per sequence, in its last block
                step.rows = step.slots.long() * self.block_size + batch.positions % self.block_size
            self._store(k, v, self.k_cache[layer], self.v_cache[layer], batch.slot_mapping,
                        scales=self.scales[layer],
                        open_block=None if step is None else (self.open_k[layer],
                                                              self.open_v[layer], step.rows))
        if not batch.is_prefill:
            opened = (None if step is None else
                      OpenBlocks(self.open_k[layer], self.open_v[layer], step.slots))
            return self._decode(q, self.k_cache[layer], self.v_cache[layer], batch.block_tables,
                                batch.context_lens, scale, scales=self.scales[layer],
                                open_block=opened)
        return prefill_attention(q, k, v, batch, scale, lambda i, n: prefixes[i])

    def _prefix(self, layer: int, batch: ForwardBatch, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V ``[Hk, prefix, D]`` of prefill row ``i``'s cached prefix: from the pool
        (dequantized to the model's dtype from 8-bit storage), a partly written last block from
        its open block when those are kept."""
        prefix, bs = batch.prefix_lens[i], self.block_size
        blocks = batch.block_tables[i][: -(-prefix // bs)].long()
        scales, step = self.scales[layer], batch.meta

        def take(j: int) -> torch.Tensor:
            cache = (self.k_cache, self.v_cache)[j][layer]
            rows = as_bytes(cache)[blocks].view(cache.dtype)
            if scales is not None:
                rows = dequantize(v_rows(rows) if j else rows, scales[j][blocks]).to(self.dtype)
            if step is not None and prefix % bs:
                rows[-1] = (self.open_k, self.open_v)[j][layer][step.slots[i].long()]
            return rows.transpose(0, 1).reshape(self.num_kv_heads, -1, self.head_dim)[:, :prefix]
        return take(0), take(1)

    # ---- CUDA graphs: static slots (padding rows: the scratch slot) ------------------------------
    def init_graphs(self, buckets: list[int]) -> dict[int, OpenStep | None]:
        if not self.open_slots:
            return dict.fromkeys(buckets)
        slots = torch.full((max(buckets),), self.open_slots, dtype=torch.int32,
                           device=self.device)
        self._statics = {bs: OpenStep(slots[:bs]) for bs in buckets}
        return dict(self._statics)

    def prepare_replay(self, meta: OpenStep | None, num_seqs: int, bucket: int) -> bool:
        if meta is not None:
            static = self._statics[bucket]
            static.slots[:num_seqs].copy_(meta.slots)
            static.slots[num_seqs:].fill_(self.open_slots)
        return True
