"""HostStore: every block of every running sequence, in host memory (pinned when CUDA is present).

Layout ``[num_host_blocks, num_layers, Hk, B, D]`` per K and V (see ``layout.py``). On CUDA the Triton
kernels read and write it directly through unified virtual addressing; elsewhere torch indexes it.
Size comes from a setting (``host_kv_gib``), never from MemTotal: GPU hosts report far less than they
have until memory is touched. Pinning ~100 GB takes tens of seconds at start-up.
"""
from __future__ import annotations

import logging

import torch

from oasiskv.kv.layout import TieredLayout

logger = logging.getLogger(__name__)


class HostStore:
    def __init__(self, layout: TieredLayout, num_blocks: int, pin: bool):
        if num_blocks < 1:
            raise ValueError("the host store needs at least one block: raise host_kv_gib")
        self.layout, self.num_blocks = layout, num_blocks
        shape = (num_blocks, layout.num_layers, layout.num_kv_heads, layout.block_size, layout.head_dim)
        self.k = torch.empty(shape, dtype=layout.dtype, pin_memory=pin)
        self.v = torch.empty(shape, dtype=layout.dtype, pin_memory=pin)
        logger.info("host store: %d blocks, %.2f GiB%s", num_blocks,
                    2 * self.k.numel() * self.k.element_size() / 2**30, " pinned" if pin else "")

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views ``[num_host_blocks, Hk, B, D]`` of one layer's K and V (strided, last two dims contiguous)."""
        return self.k[:, layer], self.v[:, layer]

    def read_blocks(self, layer: int, blocks: torch.Tensor, device: torch.device):
        """K and V of ``blocks`` (host ids ``[n]``) at ``layer`` as ``[n, Hk, B, D]`` on ``device``."""
        idx = blocks.cpu().long()
        k, v = self.k[idx, layer], self.v[idx, layer]
        return k.to(device, non_blocking=True), v.to(device, non_blocking=True)
