"""ForwardBatch: everything attention needs about one step, and the scope that makes it visible.

The model runner builds one ``ForwardBatch`` per step and runs the model inside
``with forward_context(batch, backend):``; attention layers read it through
``get_forward_context()``. Nothing else is threaded through model signatures. The context is
per-thread and only valid inside the ``with`` block.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from oasiskv.attention.base import AttentionBackend


@dataclass
class StepRows:
    """A step's rows on the host, before they move to the device: token ids, positions and cache
    slots per row (the sequences' tokens, then the backend's extra rows), tokens each sequence
    attends to (``context_lens``, per sequence); and the backend's ``StepPlan.meta``."""
    ids: list[int]
    positions: list[int]
    slots: list[int]
    context_lens: list[int]
    meta: Any = None


@dataclass
class ForwardBatch:
    """Per-step metadata. T = rows in the step, B = sequences.

    input_ids, positions: ``[T]`` int64. slot_mapping: ``[T]`` int64 cache slot of each row's K/V
    (negative = not stored). block_tables: ``[B, max_blocks]`` int32. context_lens: ``[B]`` int32
    tokens each sequence attends to after this step's tokens are stored (0 = graph padding row).
    Prefill only: query_lens / prefix_lens (host lists, per sequence: new tokens, tokens already
    cached). The first rows are the sequences' tokens, back to back; a backend may add rows after
    them (``StepPlan.extra_*``), which are never stored or sampled. ``meta``: the backend's own
    per-step metadata (``AttentionBackend.prepare``), opaque to everything else.
    """
    is_prefill: bool
    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    query_lens: list[int] = field(default_factory=list)
    prefix_lens: list[int] = field(default_factory=list)
    meta: Any = None

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_seqs(self) -> int:
        return self.context_lens.shape[0]


def to_device(data, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Host list / numpy array -> ``dtype`` tensor on ``device`` (``to_device_many`` of one)."""
    return to_device_many([(data, dtype)], device)[0]


_NUMPY = {torch.int64: np.int64, torch.int32: np.int32, torch.float32: np.float32}
_ALIGN = 16  # bytes between packed arrays: every dtype's views stay aligned
_RING = 8  # pinned staging buffers per thread and device, reused in turn


def packed_offsets(sizes: list[int]) -> tuple[list[int], int]:
    """Byte offsets of arrays of ``sizes`` bytes packed back to back in one buffer, each aligned
    so that every dtype's view of it stays aligned, and the buffer's size."""
    offsets, total = [], 0
    for n in sizes:
        offsets.append(total)
        total += -(-n // _ALIGN) * _ALIGN
    return offsets, total


def to_device_many(arrays: list[tuple[Any, torch.dtype]],
                   device: torch.device) -> list[torch.Tensor]:
    """Host lists / numpy arrays, each with its dtype (int64, int32 or float32) -> tensors on
    ``device`` of the same shapes. On CUDA all of them go as one non-blocking copy (ordered on the
    current stream before any later use) from a pinned staging buffer that is reused (its previous
    copy waited for first, long done by then), and come back as views of one device buffer: a step's
    index arrays cost one transfer and no pinned allocation. On CPU: plain tensors (a numpy array's
    shares its memory)."""
    if device.type != "cuda":
        return [torch.from_numpy(data) if isinstance(data, np.ndarray)
                else torch.tensor(data, dtype=dtype) for data, dtype in arrays]
    hosts = [np.ascontiguousarray(data, dtype=_NUMPY[dtype]) for data, dtype in arrays]
    offsets, total = packed_offsets([host.nbytes for host in hosts])
    ring = _rings.__dict__.setdefault(device, _PinnedRing())
    slot, staging = ring.take(total)
    flat = staging.numpy()
    for host, offset in zip(hosts, offsets):
        flat[offset:offset + host.nbytes] = host.reshape(-1).view(np.uint8)
    dev = staging[:total].to(device, non_blocking=True)
    ring.copied(slot)
    return [dev[offset:offset + host.nbytes].view(dtype).view(host.shape)
            for host, offset, (_, dtype) in zip(hosts, offsets, arrays)]


class _PinnedRing:
    """``_RING`` pinned byte buffers, each with an event recorded after the copy out of it."""

    def __init__(self):
        self.buffers: list[torch.Tensor | None] = [None] * _RING
        self.events = [torch.cuda.Event() for _ in range(_RING)]
        self.next = 0

    def take(self, nbytes: int) -> tuple[int, torch.Tensor]:
        """The next buffer (index, uint8 tensor of at least ``nbytes``), its last copy done."""
        slot, self.next = self.next, (self.next + 1) % _RING
        self.events[slot].synchronize()  # (a never-recorded event returns at once)
        buffer = self.buffers[slot]
        if buffer is None or buffer.numel() < nbytes:
            buffer = self.buffers[slot] = torch.empty(max(2 * nbytes, 1 << 16), dtype=torch.uint8,
                                                      pin_memory=True)
        return slot, buffer

    def copied(self, slot: int) -> None:
        self.events[slot].record()


_rings = threading.local()  # device -> _PinnedRing, per thread


@dataclass
class ForwardContext:
    batch: ForwardBatch
    backend: "AttentionBackend"


_local = threading.local()


@contextmanager
def forward_context(batch: ForwardBatch, backend: "AttentionBackend"):
    previous = getattr(_local, "ctx", None)
    _local.ctx = ForwardContext(batch, backend)
    try:
        yield _local.ctx
    finally:
        _local.ctx = previous


def get_forward_context() -> ForwardContext:
    ctx = getattr(_local, "ctx", None)
    if ctx is None:
        raise RuntimeError("attention called outside forward_context(): run the model through "
                           "ModelRunner")
    return ctx
