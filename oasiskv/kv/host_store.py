"""HostStore: every block of every running sequence, in host memory (pinned when CUDA is present).

Layout ``[num_host_blocks, num_layers, Hk, B, D]`` per K and V (see ``layout.py``). On CUDA the Triton
kernels read and write it directly through unified virtual addressing; elsewhere torch indexes it.
Size comes from a setting (``host_kv_gib``), never from MemTotal: GPU hosts report far less than they
have until memory is touched. Pinning ~100 GB takes tens of seconds at start-up.

Emulated capacity (benchmarks only): with ``num_physical < num_blocks`` the store answers for
``num_blocks`` host block ids but holds ``num_physical``; id b lives in physical block
b mod num_physical, so requests share physical blocks. Bytes moved and access patterns are real, the
contents are not: only for random-weight throughput runs, and every output says so.
"""
from __future__ import annotations

import logging
import weakref

import torch

from oasiskv.kv.layout import TieredLayout

logger = logging.getLogger(__name__)


class HostStore:
    def __init__(self, layout: TieredLayout, num_blocks: int, pin: bool, num_physical: int | None = None):
        num_physical = num_blocks if num_physical is None else num_physical
        if num_physical < 1:
            raise ValueError("the host store needs at least one block: raise host_kv_gib")
        self.layout, self.num_blocks, self.num_physical = layout, num_blocks, min(num_physical, num_blocks)
        self.emulated = self.num_physical < num_blocks
        shape = (self.num_physical, layout.num_layers, layout.num_kv_heads, layout.block_size, layout.head_dim)
        self.k, self.v = torch.empty(shape, dtype=layout.dtype), torch.empty(shape, dtype=layout.dtype)
        if pin:
            for t in (self.k, self.v):
                _page_lock(self, t)
        logger.info("host store: %d blocks, %.2f GiB%s", self.num_physical,
                    2 * self.k.numel() * self.k.element_size() / 2**30, " pinned" if pin else "")
        if self.emulated:
            logger.warning("EMULATED host capacity: %d block ids share %d physical blocks (benchmark only: "
                           "KV contents are shared between requests)", num_blocks, self.num_physical)

    def physical_blocks(self, ids: torch.Tensor) -> torch.Tensor:
        """Host block ids (negative = none) -> rows of ``k``/``v`` (the ids themselves unless emulated)."""
        return torch.where(ids >= 0, ids % self.num_physical, ids) if self.emulated else ids

    def physical_slots(self, slots: torch.Tensor) -> torch.Tensor:
        """Token slots ``block * B + offset`` (negative = none) -> slots in the physical store."""
        span = self.num_physical * self.layout.block_size
        return torch.where(slots >= 0, slots % span, slots) if self.emulated else slots

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views ``[num_physical, Hk, B, D]`` of one layer's K and V (strided, last two dims contiguous)."""
        return self.k[:, layer], self.v[:, layer]

    def read_blocks(self, layer: int, blocks: torch.Tensor, device: torch.device):
        """K and V of ``blocks`` (host ids ``[n]``) at ``layer`` as ``[n, Hk, B, D]`` on ``device``."""
        idx = self.physical_blocks(blocks.cpu().long())
        k, v = self.k[idx, layer], self.v[idx, layer]
        return k.to(device, non_blocking=True), v.to(device, non_blocking=True)


def _page_lock(owner: object, t: torch.Tensor) -> None:
    """Register ``t``'s memory with CUDA (page-locked, mapped for the device at the same address under
    unified addressing) until ``owner`` is collected. torch's pinned allocator would round each
    allocation up to a power of two, wasting up to half of a large store."""
    cudart = torch.cuda.cudart()
    nbytes = t.numel() * t.element_size()
    err = cudart.cudaHostRegister(t.data_ptr(), nbytes, 0)
    if int(err) != 0:
        raise RuntimeError(f"cannot page-lock {nbytes / 2**30:.1f} GiB of host memory for the host store "
                           f"(cudaHostRegister error {int(err)}): lower host_kv_gib")
    weakref.finalize(owner, _unlock, t)


def _unlock(t: torch.Tensor) -> None:
    """Undo ``_page_lock`` once no queued copy can still read ``t`` (which stays alive until then)."""
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()
    torch.cuda.cudart().cudaHostUnregister(t.data_ptr())
