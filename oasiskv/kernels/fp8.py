"""8-bit KV storage: ``kv_cache_dtype=fp8`` (e4m3 values) or ``int8``, with one float32 scale per
stored row.

A stored row is one token's K (or V) for one kv head: ``head_dim`` values. Writing it
(``store_kv``) takes its absolute maximum ``a`` and stores ``x * (M / a)`` rounded to the format
(M its largest value, so no value saturates: 448 for ``float8_e4m3fn``, rounded to nearest, ties
to even; 127 for ``int8``, to the nearest integer, ties to even) and the scale ``a / M``; reading
it (decode kernels, summaries, prefill) multiplies back. Why two formats: e4m3 keeps about 6% of
each value (3 mantissa bits) whatever its size, int8 keeps 0.4% of the row's largest value for
every value of the row. Keys are dominated by their large components, so int8 keys move a trained
model less (the fixture target, 4K windows, top-1 agreement with bf16 dense: e4m3 K and V 0.987,
int8 K and V 0.995); both take the same bytes. Why per row (token,
kv head): decode appends one token at a time, so a row's scale is fixed when it is written and no
block is ever re-quantised; an outlier token or head costs only its own precision; no calibration
is needed. Cost: 4 bytes per ``head_dim`` bytes (3% at head_dim 128). Scales live beside the values
in tensors of the same leading shape without the last dimension (a cache ``[N, Hk, B, D]`` has
scales ``[N, Hk, B]``) and travel with them (the UVA gather copies both).

The V layout: a dense pool's 8-bit V keeps each block's bytes token-minor. A tensor of 8-bit V
rows has the shape of its K twin (``[..., B, D]``, B tokens of D values per block, the last two
dims contiguous), but value (t, d) of a block lives at byte ``d * B + t`` of it (``v_rows`` views
it in token order; ``stored_v`` writes rows so). Why: decode multiplies the weights ``[G, B]`` by
the values ``[B, D]``, a dot that reduces over tokens, and a tensor-core operand pairs
neighbouring tokens of one dimension in a register. Stored token-major, 8-bit values reach those
pairs only one byte per shared-memory load (16-bit values have a transposing matrix load, bytes
have none); token-minor, they load as words, and with 32-token blocks FP8 paged decode reads 3.8
TB/s where it read 2.9 (docs/benchmarks.md section 30). The tiered store (host store, working
sets, local blocks) keeps 8-bit V in token order, as K: decode writes each token's row into the
host store across PCIe, where a token-minor row is D one-byte writes (at 64 x 32K on an H100 the
store kernel then took 5.9 ms of a 29 ms step, 0.36 before the V layout), and sparse decode's
one-warp tiles read token-order sets faster (docs/benchmarks.md section 39). Whole blocks move as
bytes between the host store, working sets and transfers, which share the order. Scales keep one
per token, in token order.

Open blocks (``kv_open_block=model``): e4m3's flips of the model's top-1 sit mostly in the query's
own block, the most recent 1-16 tokens (docs/benchmarks.md section 24: keeping those exact takes a
bf16 model from 1.6-2.2 points of top-1 disagreement with bf16 dense to 0.7-0.8). So beside an
8-bit pool or 8-bit working sets each running sequence also keeps the block it is writing into
("open") in the model's dtype, in a slot of its own (``OpenBlocks``); every token is written to
both, and decode (paged or sparse) reads a row's last block from the open one. The 8-bit copy of
the block is complete when the block fills, so nothing is converted when a sequence moves to its
next block.

The e4m3 scale search (K/V rows; ``quantize_rows(..., search=True)``, which ``store_kv`` and its
reference follow): a float format's error does not depend on the scale's size, but within one
octave the scale decides where each value falls on the e4m3 grid. ``a / 448`` makes only the
largest value exact; each row instead takes, of the SCALE_STEPS candidates ``a / 448 * 2^(j /
SCALE_STEPS)`` (all within one octave above it, so nothing saturates), the one whose rounding
leaves the least squared error. On the fixture's keys and values that removes 35% and 32% of the
squared error, and dense FP8's top-1 disagreement with bf16 dense on 16 x 4K windows goes from 1.3
points to under 1 (docs/benchmarks.md section 29). Zero bytes and nothing for the readers: the
scale is still one float32 per row. Writing costs SCALE_STEPS roundings per row, in the store
kernel: one division per candidate (its inverse; each value is multiplied by it), the GPU's own
e4m3 conversion, and each error as one fused multiply-add, exact in float32.

This module is the torch side: the dtype, the rounding rule kernels and references share, and
helpers that check scale tensors and dequantize gathered rows.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
INT8 = torch.int8
INT8_MAX = 127.0
#: the 8-bit storage dtypes, each with its largest stored magnitude
QUANT_MAX = {FP8: FP8_MAX, INT8: INT8_MAX}
#: a row's scale never goes below this (an all-zero row: any positive scale stores zeros)
MIN_AMAX = 1e-30
#: candidate scales per octave of an e4m3 K/V row's scale search (``quantize_rows``; a power of
#: two: the store kernel tries them all at once)
SCALE_STEPS = 32
_STEPS: dict[torch.device, torch.Tensor] = {}


def quantized(dtype: torch.dtype) -> bool:
    """Whether ``dtype`` storage is 8-bit rows with scales."""
    return dtype in QUANT_MAX


def row_bytes(head_dim: int, dtype: torch.dtype) -> int:
    """Bytes one stored row of ``head_dim`` values takes in ``dtype`` storage (8-bit: + its
    scale)."""
    return head_dim * dtype.itemsize + (4 if quantized(dtype) else 0)


def storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """``--kv-cache-dtype``: ``auto`` stores K/V in the model's dtype, ``fp8`` as e4m3 + scales,
    ``int8`` as int8 + scales."""
    return {"fp8": FP8, "int8": INT8}.get(kv_cache_dtype, model_dtype)


def empty_rows(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu",
               zero: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Storage for rows ``shape`` (``[..., D]``) in ``dtype`` -> (values, scale): ``scale`` is
    float32 ``shape[:-1]`` for 8-bit storage, else None."""
    make = torch.zeros if zero else torch.empty
    if not quantized(dtype):
        return make(shape, dtype=dtype, device=device), None
    return (make(shape, dtype=torch.uint8, device=device).view(dtype),
            make(shape[:-1], dtype=torch.float32, device=device))


def empty_kv(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu",
             zero: bool = False):
    """K and V storage ``shape`` (``[..., D]``) in ``dtype`` -> (k, v, scales): ``scales`` is the
    float32 ``(k_scale, v_scale)`` pair ``shape[:-1]`` for 8-bit storage, else None."""
    (k, k_scale), (v, v_scale) = (empty_rows(shape, dtype, device, zero) for _ in range(2))
    return k, v, None if k_scale is None else (k_scale, v_scale)


def as_bytes(x: torch.Tensor) -> torch.Tensor:
    """A view to index and copy with: FP8 tensors as uint8 (not every device indexes FP8)."""
    return x.view(torch.uint8) if x.dtype == FP8 else x


def scale_steps(device: torch.device | str = "cpu") -> torch.Tensor:
    """The e4m3 scale search's candidate multipliers ``2 ** (j / SCALE_STEPS)``, j = 0 ..
    SCALE_STEPS - 1, as float32 (the kernel reads these very values, so both round alike)."""
    device = torch.device(device)
    if device not in _STEPS:  # made once per device (a captured graph reads them)
        _STEPS[device] = torch.tensor([2.0 ** (j / SCALE_STEPS) for j in range(SCALE_STEPS)],
                                      dtype=torch.float32, device=device)
    return _STEPS[device]


def quantize_rows(x: torch.Tensor, dtype: torch.dtype = FP8,
                  search: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``[..., D]`` -> (``dtype`` values ``[..., D]``, float32 scales ``[...]``). Both
    divisions are IEEE on every device (CUDA torch divides by a Python number as a multiply by its
    reciprocal, one ulp off the kernels' scales, which moves values that sit near a rounding tie).
    ``search`` (e4m3 only; the rule ``store_kv`` and its reference follow for K/V rows): the scale
    ``s`` is the one of ``amax / 448 * scale_steps()`` whose rounding leaves the row the least
    squared error (summed in float64, so the order of the sum does not pick; the first of equal
    ones); each candidate's values are ``x * (1 / s)``, one IEEE division per candidate, not per
    value."""
    x, top = x.float(), QUANT_MAX[dtype]
    amax = x.abs().amax(-1).clamp(min=MIN_AMAX)
    scale = amax / torch.full_like(amax, top)
    if search and dtype == FP8:
        return _searched_e4m3(x, scale)
    q = (x / scale[..., None]).clamp(-top, top)
    return (q.round() if dtype == INT8 else q).to(dtype), scale


def _searched_e4m3(x: torch.Tensor, base: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_rows(x, FP8, search=True)`` for float32 rows ``x`` and their plain scales
    ``base``."""
    def at(step: torch.Tensor):  # (values, scale, squared error) at the scale base * step
        scale = base * step
        inverse = torch.ones_like(scale) / scale  # (IEEE: a tensor divides a tensor)
        q = (x * inverse[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        return q, scale, (q.double() * scale.double()[..., None] - x.double()).square().sum(-1)

    steps = scale_steps(x.device)
    q, scale, cost = at(steps[0])
    for step in steps[1:]:
        q_j, scale_j, cost_j = at(step)
        better = cost_j < cost  # (strictly: the first of equal ones stays)
        q = torch.where(better[..., None], as_bytes(q_j), as_bytes(q)).view(FP8)
        scale, cost = torch.where(better, scale_j, scale), torch.where(better, cost_j, cost)
    return q, scale


def v_rows(stored: torch.Tensor) -> torch.Tensor:
    """8-bit V storage ``[..., B, D]`` (each block's bytes in the V layout: ``[D, B]``) -> its rows
    in token order ``[..., B, D]``, a view (reads and writes go through to ``stored``, whose last
    two dims must be contiguous)."""
    *lead, block, dim = stored.shape
    return stored.view(*lead, dim, block).transpose(-1, -2)


def stored_v(rows: torch.Tensor) -> torch.Tensor:
    """8-bit V rows ``[..., B, D]`` in token order -> a new contiguous tensor holding them in the V
    layout (``v_rows`` of it gives ``rows`` back)."""
    out = torch.empty(rows.shape, dtype=rows.dtype, device=rows.device)
    as_bytes(v_rows(out)).copy_(as_bytes(rows))
    return out


def dequantize(values: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """Stored rows ``[..., D]`` and their scales ``[...]`` (None: 16/32-bit storage) -> float32."""
    return values.float() if scale is None else values.float() * scale[..., None]


_PLACEHOLDERS: dict[tuple, torch.Tensor] = {}


def check_scales(scales: tuple[torch.Tensor, torch.Tensor] | None, cache: torch.Tensor,
                 device: torch.device):
    """The (k, v) scale tensors a kernel running on ``device`` gets for ``cache`` ``[..., D]``: the
    given ones, checked (float32, shape ``cache.shape[:-1]``, last-dim stride 1), or placeholders
    on ``device`` never read."""
    if scales is None:
        assert not quantized(cache.dtype), f"a {cache.dtype} cache needs its scales"
        key = (torch.device(device), cache.dim() - 1)
        if key not in _PLACEHOLDERS:  # made once (a decode step's kernels each need one)
            _PLACEHOLDERS[key] = torch.empty((1,) * key[1], dtype=torch.float32, device=device)
        return _PLACEHOLDERS[key], _PLACEHOLDERS[key]
    assert quantized(cache.dtype), f"scales given for a {cache.dtype} cache"
    for s in scales:
        assert s.dtype == torch.float32 and s.shape == cache.shape[:-1] and s.stride(-1) == 1, (
            f"scales {tuple(s.shape)} {s.dtype} do not fit cache {tuple(cache.shape)}")
    return scales


def check_scale(scale: torch.Tensor | None, values: torch.Tensor,
                device: torch.device) -> torch.Tensor:
    """``check_scales`` for one tensor of rows ``values`` ``[..., D]`` and its ``scale`` (e.g. a
    block's keys, or FP8 summaries)."""
    return check_scales(None if scale is None else (scale, scale), values, device)[0]


@dataclass
class OpenBlocks:
    """Each decode row's open block in the model's dtype, beside an 8-bit cache: ``k``, ``v``
    ``[num_slots, Hk, block_size, D]`` (the cache's layout, one block per sequence slot), ``slots``
    int32 ``[B]`` the slot of each row (a padding row's: a scratch slot). Row b's last block,
    ``(context_lens[b] - 1) // block_size``, is read from block ``slots[b]`` of ``k``/``v``."""
    k: torch.Tensor
    v: torch.Tensor
    slots: torch.Tensor

    def check(self, cache: torch.Tensor, batch: int) -> None:
        """Assert that these open blocks fit ``cache`` ``[N, Hk, block_size, D]`` and ``batch``
        rows."""
        for x in (self.k, self.v):
            assert x.shape[1:] == cache.shape[1:] and x.is_contiguous() and not quantized(
                x.dtype), f"open blocks {tuple(x.shape)} {x.dtype} do not fit {tuple(cache.shape)}"
        assert self.slots.shape == (batch,) and self.slots.dtype == torch.int32
