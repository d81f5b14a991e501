"""HostStore: every block of every running sequence, in host memory (pinned when CUDA is present).

Layout ``[num_host_blocks, num_layers, Hk, B, D]`` per K and V (see ``layout.py``). On CUDA the
Triton kernels read and write it directly through unified virtual addressing; elsewhere torch
indexes it. Size comes from a setting (``host_kv_gib``), never from MemTotal: GPU hosts report far
less than they have until memory is touched. Pinning ~100 GB takes tens of seconds at start-up.

Host block ids index rows of ``k``/``v`` through ``physical_blocks`` / ``physical_slots`` (here the
identity): a store that answers for more ids than it holds rows overrides them.
"""
from __future__ import annotations

import logging
import weakref

import torch

from oasiskv.kernels.fp8 import empty_kv
from oasiskv.kv.layout import TieredLayout

logger = logging.getLogger(__name__)


class HostStore:
    """``num_blocks`` host blocks (ids 0..num_blocks-1), page-locked when ``pin``."""

    #: whether a block can leave its row while a block table names it (a decode-host cache,
    #: ``kv/host_cache.py``): then the backend has the blocks each step's captured copies will read
    #: made resident first, runs the cache's LRU pass, and ends the sequences whose reads failed
    evicts = False

    def __init__(self, layout: TieredLayout, num_blocks: int, pin: bool):
        if num_blocks < 1:
            raise ValueError("the host store needs at least one block: raise host_kv_gib")
        self.layout, self.num_blocks = layout, num_blocks
        shape = (num_blocks, layout.num_layers, layout.num_kv_heads, layout.block_size,
                 layout.head_dim)
        #: 8-bit storage: float32 ``(k_scale, v_scale)`` ``[num_blocks, num_layers, Hk, B]``
        try:
            self.k, self.v, self.scales = empty_kv(shape, layout.storage_dtype)
        except (RuntimeError, MemoryError):
            gib = num_blocks * layout.host_block_bytes / 2**30
            raise RuntimeError(f"cannot allocate the host store ({gib:.1f} GiB, --host-kv-gib) in "
                               f"this machine's memory: lower --host-kv-gib") from None
        tensors = self.tensors()
        if pin:
            for t in tensors:
                _page_lock(self, t)
        logger.info("host store: %d blocks, %.2f GiB (%s)%s", num_blocks,
                    sum(t.numel() * t.element_size() for t in tensors) / 2**30,
                    str(layout.storage_dtype).removeprefix("torch."), " pinned" if pin else "")

    def tensors(self) -> list[torch.Tensor]:
        """K, V, then the 8-bit row scales (K, V) when present: every tensor a block's bytes live
        in, each ``[num_blocks, num_layers, ...]`` (a remote tier's descriptors keep this order)."""
        return [self.k, self.v, *(self.scales or ())]

    def physical_blocks(self, ids: torch.Tensor, layer: int | None = None,
                        ensure: bool = True) -> torch.Tensor:
        """Host block ids (negative = none) -> rows of ``k``/``v``, whose bytes at ``layer``
        (None: every layer) the caller reads (``ensure`` False: the caller made them resident
        already)."""
        return ids

    def rows_of(self, ids: list[int]) -> list[int]:
        """Host block ids (resident ones) -> rows of ``k``/``v``, on the host (what a transfer
        into the store addresses)."""
        return list(ids)

    def physical_slots(self, slots: torch.Tensor) -> torch.Tensor:
        """Token slots ``block * B + offset`` (negative = none) -> slots in the rows of
        ``k``/``v``."""
        return slots

    def flush(self) -> None:
        """Send row-table changes to the device (a store whose rows move has some)."""

    def poll(self) -> bool:
        """Settle background work that finished (a cache's reads); True while some still runs.
        A store that keeps every block has none."""
        return False

    def take_failed(self) -> dict[int, str]:
        """The blocks whose bytes could not be had since the last call, with why (none
        here)."""
        return {}

    def located(self, block: int) -> bool:
        """Whether another tier holds ``block``'s bytes, so that they stay sound whatever was
        read here (none does here)."""
        return False

    def layer_scales(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Views ``[num_blocks, Hk, B]`` of one layer's K and V row scales (8-bit), else None."""
        return None if self.scales is None else tuple(s[:, layer] for s in self.scales)

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views ``[num_blocks, Hk, B, D]`` of one layer's K and V (strided, last two dims
        contiguous)."""
        return self.k[:, layer], self.v[:, layer]


def _page_lock(owner: object, t: torch.Tensor) -> None:
    """Register ``t``'s memory with CUDA (page-locked, mapped for the device at the same address
    under unified addressing) until ``owner`` is collected. torch's pinned allocator would round
    each allocation up to a power of two, wasting up to half of a large store."""
    cudart = torch.cuda.cudart()
    nbytes = t.numel() * t.element_size()
    err = cudart.cudaHostRegister(t.data_ptr(), nbytes, 0)
    if int(err) != 0:
        raise RuntimeError(f"cannot page-lock {nbytes / 2**30:.1f} GiB of host memory for the "
                           f"host store (cudaHostRegister error {int(err)}): lower host_kv_gib")
    weakref.finalize(owner, _unlock, t)


def _unlock(t: torch.Tensor) -> None:
    """Undo ``_page_lock`` once no queued copy can still read ``t`` (which stays alive until
    then)."""
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()
    torch.cuda.cudart().cudaHostUnregister(t.data_ptr())
