"""DenseBackend: the paged HBM KV pool and dense attention over it.

Storage per layer: ``k_cache``/``v_cache`` ``[num_blocks, Hk, block_size, D]`` (one (block, kv-head)
slice is contiguous). Decode uses the paged decode kernel (Triton on CUDA, the torch reference on
CPU). Prefill uses torch SDPA per sequence: over the fresh K/V when the sequence has no cached
prefix, else over its K/V gathered from the cache with a bottom-right causal mask.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from oasiskv.attention.base import AttentionBackend
from oasiskv.engine.forward_batch import ForwardBatch
from oasiskv.kernels import reference


class DenseBackend(AttentionBackend):
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
                 dtype: torch.dtype, device: torch.device):
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.block_size, self.dtype, self.device = block_size, dtype, device
        self.k_cache: list[torch.Tensor] = []
        self.v_cache: list[torch.Tensor] = []
        if device.type == "cuda":
            from oasiskv.kernels.paged_decode import paged_decode_attention
            from oasiskv.kernels.store_kv import store_kv
            self._store, self._decode = store_kv, paged_decode_attention
        else:
            self._store, self._decode = reference.store_kv_ref, reference.paged_decode_ref

    def bytes_per_block(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.block_size * self.head_dim * self.dtype.itemsize

    def allocate(self, num_blocks: int) -> None:
        shape = (num_blocks, self.num_kv_heads, self.block_size, self.head_dim)
        self.k_cache = [torch.empty(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
        self.v_cache = [torch.empty(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]

    def forward(self, layer, q, k, v, batch: ForwardBatch, scale: float) -> torch.Tensor:
        if self.k_cache:
            self._store(k, v, self.k_cache[layer], self.v_cache[layer], batch.slot_mapping)
        if not batch.is_prefill:
            return self._decode(q, self.k_cache[layer], self.v_cache[layer], batch.block_tables,
                                batch.context_lens, scale)
        return self._prefill(layer, q, k, v, batch, scale)

    def _prefill(self, layer, q, k, v, batch: ForwardBatch, scale: float) -> torch.Tensor:
        out = torch.empty_like(q)
        group = q.shape[1] // k.shape[1]
        start = 0
        for i, (n, prefix) in enumerate(zip(batch.query_lens, batch.prefix_lens)):
            qi = q[start:start + n].transpose(0, 1)
            if prefix == 0:
                ki, vi, mask = k[start:start + n].transpose(0, 1), v[start:start + n].transpose(0, 1), None
            else:  # bottom-right causal: query at position prefix + j sees keys 0 .. prefix + j
                ki, vi = self._gather(layer, batch.block_tables[i], prefix + n)
                pos_q = torch.arange(prefix, prefix + n, device=q.device)
                mask = torch.arange(prefix + n, device=q.device)[None, :] <= pos_q[:, None]
            # Expanded K/V heads (not enable_gqa) keep SDPA on its fused kernels for masked calls too.
            ki, vi = ki.repeat_interleave(group, dim=0), vi.repeat_interleave(group, dim=0)
            oi = F.scaled_dot_product_attention(qi.unsqueeze(0), ki.unsqueeze(0), vi.unsqueeze(0),
                                                attn_mask=mask, is_causal=mask is None, scale=scale)
            out[start:start + n] = oi[0].transpose(0, 1)
            start += n
        return out

    def _gather(self, layer: int, block_table: torch.Tensor, length: int):
        """K and V of one sequence's first ``length`` tokens as ``[Hk, length, D]``."""
        blocks = block_table[: -(-length // self.block_size)].long()

        def take(cache):
            return cache[blocks].transpose(0, 1).reshape(self.num_kv_heads, -1, self.head_dim)[:, :length]
        return take(self.k_cache[layer]), take(self.v_cache[layer])
