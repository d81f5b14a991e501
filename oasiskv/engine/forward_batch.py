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
    """Host list / numpy array -> tensor on ``device``: through pinned memory and a non-blocking
    copy on CUDA (ordered on the current stream before any later use), as is elsewhere."""
    if isinstance(data, np.ndarray):
        host = torch.from_numpy(data)
    else:
        host = torch.tensor(data, dtype=dtype)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


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
