"""Selection: a ranking of blocks -> which blocks each head fetches and which slots they replace.

Pure tensor logic, batched over (row, kv-head), no host syncs. For each head: the top-K blocks by
score are the wanted set; wanted blocks already resident are hits (their slots' "last selected"
stamps are refreshed); wanted blocks not resident are misses, admitted highest score first up to
``cap`` per head (the HBM fetch cap; ``cap = K`` when seeding), each into an empty slot or else the
least recently selected slot that holds no wanted block. Misses past the cap are deferred: not
fetched this step. The local block is not among the K slots, so it is never evicted.

On CUDA the same policy runs as one Triton kernel per layer (``kernels/select_blocks.py``); this
torch form is its reference and the CPU path.

Invariants (tests check them): at most ``cap`` admissions per head; a block is resident in at most
one slot per head; a hit's slot is never a victim.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

_EMPTY_FIRST = torch.iinfo(torch.int64).min
_PROTECTED = torch.iinfo(torch.int64).max


@dataclass
class Selection:
    """``src_block``/``dst_slot`` ``[N, Hk, cap]``: logical block to fetch and the slot it lands in
    (-1 = nothing). Counts are device scalars (summed over rows and heads)."""
    src_block: torch.Tensor
    dst_slot: torch.Tensor
    hits: torch.Tensor
    misses: torch.Tensor
    admitted: torch.Tensor


def plan_selection(scores: torch.Tensor, ws_map: torch.Tensor, ws_last: torch.Tensor, k: int,
                   cap: int, now: int) -> Selection:
    """Plan one layer's selection and update the residency tables in place.

    scores ``[N, Hk, M]`` float32, -inf for blocks that do not exist; ws_map ``[N, Hk, K]`` int
    logical block per slot (-1 empty); ws_last ``[N, Hk, K]`` int64 last-selected stamps; ``now``
    the step's stamp (an int or a 0-d device tensor).
    ``ws_map``/``ws_last`` are per-row copies (gathered by the caller) and are updated in place.
    """
    n, heads, m = scores.shape
    k_eff = min(k, m)
    top_scores, top_blocks = scores.topk(k_eff, dim=-1)              # sorted, best first
    wanted = top_scores > float("-inf")
    # [N, Hk, M + 1], -1 = not resident
    slot_of = _slot_of_block(ws_map, m)
    top_slot = slot_of.gather(-1, top_blocks)
    hit = wanted & (top_slot >= 0)
    miss = wanted & (top_slot < 0)

    # victims: empty slots first, then least recently selected; slots holding a wanted block are
    # protected
    key = torch.where(ws_map < 0, torch.full_like(ws_last, _EMPTY_FIRST), ws_last)
    key = scatter_where(key, hit, top_slot, _PROTECTED)
    victims = key.argsort(dim=-1, stable=True)                         # [N, Hk, K]
    scatter_where(ws_last, hit, top_slot, now, out=ws_last)

    # misses are in score order already
    rank = miss.long().cumsum(-1) - 1
    admit = miss & (rank < cap)
    dst = victims.gather(-1, rank.clamp(min=0, max=k - 1))
    scatter_where(ws_map, admit, dst, top_blocks, out=ws_map)
    scatter_where(ws_last, admit, dst, now, out=ws_last)

    src_block = torch.full((n, heads, cap + 1), -1, dtype=torch.long, device=scores.device)
    dst_slot = torch.full_like(src_block, -1)
    pos = torch.where(admit, rank, cap)
    src_block.scatter_(-1, pos, torch.where(admit, top_blocks, -1))
    dst_slot.scatter_(-1, pos, torch.where(admit, dst, -1))
    return Selection(src_block[..., :cap], dst_slot[..., :cap], hit.sum(), miss.sum(), admit.sum())


def scatter_where(table: torch.Tensor, mask: torch.Tensor, index: torch.Tensor, value, out=None):
    """``table[..., index[..., i]] = value[..., i]`` where ``mask[..., i]`` (rows of the last dim),
    through a scratch column so masked-out entries write nowhere. Returns the result (``out`` if
    given)."""
    ext = torch.cat([table, table.new_zeros(*table.shape[:-1], 1)], dim=-1)
    values = (value.expand_as(index) if isinstance(value, torch.Tensor)
              else torch.full_like(index, value))
    ext.scatter_(-1, torch.where(mask, index, table.shape[-1]).long(), values.to(table.dtype))
    result = ext[..., :-1]
    return out.copy_(result) if out is not None else result


def _slot_of_block(ws_map: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """Inverse of ``ws_map``: ``[N, Hk, num_blocks + 1]`` slot holding each block, -1 if none
    (column ``num_blocks`` absorbs empty slots)."""
    n, heads, k = ws_map.shape
    inv = torch.full((n, heads, num_blocks + 1), -1, dtype=torch.long, device=ws_map.device)
    target = torch.where((ws_map >= 0) & (ws_map < num_blocks), ws_map.long(), num_blocks)
    inv.scatter_(-1, target, torch.arange(k, device=ws_map.device).expand(n, heads, k))
    inv[..., num_blocks] = -1
    return inv
