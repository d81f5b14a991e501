"""ForwardBatch: everything attention needs about one step, and the scope that makes it visible.

The model runner builds one ``ForwardBatch`` per step and runs the model inside
``with forward_context(batch, backend):``; attention layers read it through ``get_forward_context()``.
Nothing else is threaded through model signatures. The context is per-thread and only valid inside
the ``with`` block.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from oasiskv.attention.base import AttentionBackend


@dataclass
class ForwardBatch:
    """Per-step metadata. T = tokens in the step, B = sequences.

    input_ids, positions: ``[T]`` int64. slot_mapping: ``[T]`` int64 cache slot of each token's K/V
    (negative = padding, not stored). block_tables: ``[B, max_blocks]`` int32. context_lens: ``[B]``
    int32 tokens each sequence attends to after this step's tokens are stored (0 = padding row).
    Prefill only: query_lens / prefix_lens (host lists, per sequence: new tokens, tokens already cached).
    seq_slots: ``[B]`` int32 per-sequence KV state slot (``Sequence.kv_slot``; -1 when the backend keeps
    none). last_chunk: host list, True where this step computes a sequence's last uncomputed token.
    Decode with lookahead: after the B real rows come draft rows (a guessed next token at position
    + 1, never stored); ``draft_of`` ``[D]`` gives each draft row's real row. ``context_lens`` etc. cover
    the real rows only.
    """
    is_prefill: bool
    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    query_lens: list[int] = field(default_factory=list)
    prefix_lens: list[int] = field(default_factory=list)
    seq_slots: torch.Tensor | None = None
    last_chunk: list[bool] = field(default_factory=list)
    draft_of: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]


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
        raise RuntimeError("attention called outside forward_context(): run the model through ModelRunner")
    return ctx
