"""Prefill attention shared by every backend: torch SDPA per sequence, causal over the new tokens
and bottom-right causal over a cached prefix that the backend supplies. The step's own tokens are
attended as computed (never read back from 8-bit storage), whether or not a prefix precedes them."""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from oasiskv.engine.forward_batch import ForwardBatch
from oasiskv.engine.scheduler import ScheduledBatch

#: (row in the batch, prefix length) -> K, V of that sequence's cached prefix as
#: ``[Hk, prefix, D]``
PrefixFn = Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch,
                      scale: float, prefix_kv: PrefixFn) -> torch.Tensor:
    """q ``[T, Hq, D]``, k/v ``[T, Hk, D]`` of the step's tokens (sequences back to back) ->
    ``[T, Hq, D]``.

    A sequence with ``prefix_lens[i] == 0`` attends causally over its fresh K/V; otherwise over
    ``prefix_kv(i, prefix)`` followed by its fresh K/V, with a mask letting the query at position
    ``prefix + j`` see keys ``0 .. prefix + j``.
    """
    out = torch.empty_like(q)
    group = q.shape[1] // k.shape[1]
    start = 0
    for i, (n, prefix) in enumerate(zip(batch.query_lens, batch.prefix_lens)):
        qi = q[start:start + n].transpose(0, 1)
        if prefix == 0:
            ki, vi, mask = (k[start:start + n].transpose(0, 1),
                            v[start:start + n].transpose(0, 1), None)
        else:
            ki, vi = (torch.cat([old, x[start:start + n].transpose(0, 1).to(old.dtype)], 1)
                      for old, x in zip(prefix_kv(i, prefix), (k, v)))
            pos_q = torch.arange(prefix, prefix + n, device=q.device)
            mask = torch.arange(prefix + n, device=q.device)[None, :] <= pos_q[:, None]
        # Expanded K/V heads (not enable_gqa) keep SDPA on its fused kernels for masked calls too.
        ki, vi = ki.repeat_interleave(group, dim=0), vi.repeat_interleave(group, dim=0)
        oi = F.scaled_dot_product_attention(qi.unsqueeze(0), ki.unsqueeze(0), vi.unsqueeze(0),
                                            attn_mask=mask, is_causal=mask is None, scale=scale)
        out[start:start + n] = oi[0].transpose(0, 1)
        start += n
    return out


def open_block_rows(batch: ScheduledBatch, slots: list[int], block_size: int) -> list[int]:
    """Where a prefill step's tokens go in the open blocks (``kernels/fp8.py``), one entry per token
    of ``batch`` (sequences back to back): ``slots[i] * block_size + offset`` for the tokens in the
    block that holds sequence i's last token of the step, -1 for the others (their blocks are
    complete when the step ends, read from the 8-bit storage from then on)."""
    rows = []
    for seq, n, slot in zip(batch.seqs, batch.num_tokens, slots):
        start = seq.num_computed_tokens
        last = (start + n - 1) // block_size * block_size
        rows += [-1] * max(0, last - start)
        rows += [slot * block_size + p % block_size for p in range(max(start, last), start + n)]
    return rows
