"""Pure-torch references for the Triton kernels in this package (``store_kv``, ``paged_decode``,
``fused_ops``, ``fused_moe``, and the sparse path: ``sparse_decode``, ``block_scores``,
``uva_gather``, ``summaries``, ``select_blocks``, ``promote_local``, ``wait_ready``,
``device_clock``, ``publish``).

Same signatures and semantics as the kernels; math in fp32. The engine uses them on CPU, so they are
vectorized over the batch (they do sync the host, e.g. on ``context_lens.max()``, so they are not
CUDA-graph capturable).
"""
import time

import torch

from oasiskv.kernels.fp8 import OpenBlocks, as_bytes, dequantize, quantize_rows, v_rows


def store_kv_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor,
                 scales: tuple[torch.Tensor, torch.Tensor] | None = None,
                 open_block: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                 v_layout: bool = True, mirror: tuple | None = None) -> None:
    """Write ``k[i]``/``v[i]`` (``[N, num_kv_heads, head_dim]``) into cache slot
    ``slot_mapping[i]``, and with ``open_block`` ``(open_k, open_v, open_slots)`` also, cast and
    unquantised, into slot ``open_slots[i]`` of ``open_k``/``open_v``.

    Caches: ``[num_blocks, num_kv_heads, block_size, head_dim]`` (or strided views of that shape,
    e.g. a layer of the host store), written in place with values cast to their dtype; slot =
    ``block_id * block_size + offset``; negative slots are skipped. 8-bit caches: rows quantised
    (``quantize_rows(..., search=True)``) with ``scales`` ``(k_scale, v_scale)`` ``[num_blocks,
    num_kv_heads, block_size]`` written too, V in the V layout (``fp8.v_rows``) or, with
    ``v_layout=False``, in token order. ``mirror`` ``(mirror_k, mirror_v, mirror_slots,
    mirror_scales)``: the same stored rows and scales also into those caches.
    """
    if open_block is not None:
        store_kv_ref(k, v, *open_block)
    if mirror is not None:  # (quantising is deterministic: the same rows and scales again)
        store_kv_ref(k, v, *mirror[:3], scales=mirror[3], v_layout=v_layout)
    block_size = k_cache.shape[2]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    blk, off = slots // block_size, slots % block_size
    # Advanced indices split by a slice: the selection is [n, num_kv_heads, head_dim].
    if scales is not None and v_layout:
        v_cache = v_rows(v_cache)
    for x, cache, i in ((k, k_cache, 0), (v, v_cache, 1)):
        if scales is None:
            cache[blk, :, off] = x[keep].to(cache.dtype)
        else:
            cache[blk, :, off], scales[i][blk, :, off] = quantize_rows(x[keep], cache.dtype,
                                                                       search=True)


def paged_decode_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                     out: torch.Tensor | None = None,
                     blocks_per_split: int | None = None, num_splits: int | None = None,
                     scales: tuple[torch.Tensor, torch.Tensor] | None = None,
                     open_block: OpenBlocks | None = None) -> torch.Tensor:
    """Decode attention over a paged KV cache, as ``paged_decode_attention``; returns ``out``.

    q: ``[B, num_q_heads, head_dim]``; query head h attends kv head ``h // G``. Caches:
    ``[num_blocks, num_kv_heads, block_size, head_dim]``. block_tables: ``[B, max_blocks]``, entries
    past a row's ``ceil(context_lens[b] / block_size)`` blocks are never used. context_lens:
    ``[B]``; rows with 0 give zeros. out: optional ``[B, num_q_heads, head_dim]`` target, else a new
    tensor of q's dtype. 8-bit caches come with ``scales`` ``[num_blocks, num_kv_heads,
    block_size]`` each (V in the V layout, ``fp8.v_rows``); with ``open_block`` each row's last
    block comes from its open block
    (``OpenBlocks``). blocks_per_split and num_splits are accepted for signature parity and
    ignored.
    """
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads, block_size = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lens = context_lens.long()
    max_len = int(lens.max()) if batch else 0
    if max_len == 0:
        return out.zero_()

    n_blk = -(-max_len // block_size)
    col = torch.arange(n_blk, device=q.device)
    ids = torch.where(col < (lens[:, None] + block_size - 1) // block_size,
                      block_tables[:, :n_blk].long(), 0)
    tokens = n_blk * block_size
    # [B, n_blk, H, bs, D] -> [B, H, T, D]
    if scales is not None:
        v_cache = v_rows(v_cache)
    k, v = (dequantize(cache[ids], None if scales is None else scales[i][ids])
            for i, cache in enumerate((k_cache, v_cache)))  # [B, n_blk, H, bs, D]
    if open_block is not None:
        rows = torch.nonzero(lens > 0)[:, 0]
        last = (lens[rows] - 1) // block_size
        slots = open_block.slots.long()[rows]
        k[rows, last], v[rows, last] = open_block.k[slots].float(), open_block.v[slots].float()
    k, v = (x.transpose(1, 2).reshape(batch, num_kv_heads, tokens, head_dim) for x in (k, v))
    # [B, 1, T, 1]
    valid = (torch.arange(tokens, device=q.device) < lens[:, None])[:, None, :, None]
    k = k.masked_fill(~valid, 0.0)
    v = v.masked_fill(~valid, 0.0)

    qf = q.float().reshape(batch, num_kv_heads, group, head_dim)
    scores = (qf @ k.transpose(-1, -2)) * scale  # [B, H, G, T]
    scores = scores.masked_fill(~valid.transpose(-1, -2), float("-inf"))
    o = (torch.softmax(scores, dim=-1) @ v).reshape(batch, num_q_heads, head_dim)
    out.copy_(torch.where((lens > 0)[:, None, None], o, 0.0))
    return out


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None):
    """Torch twin of ``fused_ops.rms_norm`` (same rounding points as the HF models)."""
    if residual is not None:
        x = (x.float() + residual.float()).to(x.dtype)
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    out = (normed.float() * weight.float()).to(x.dtype)
    return out if residual is None else (out, x)


def qk_norm_rope_ref(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                     cos_sin: torch.Tensor, q_weight: torch.Tensor | None,
                     k_weight: torch.Tensor | None, eps: float) -> None:
    """Torch twin of ``fused_ops.qk_norm_rope`` (in place on q and k)."""
    cos, sin = cos_sin[positions].unsqueeze(1).chunk(2, dim=-1)
    for x, w in ((q, q_weight), (k, k_weight)):
        y = rms_norm_ref(x, w, eps) if w is not None else x
        y1, y2 = y.float().chunk(2, dim=-1)
        x.copy_(torch.cat([y1 * cos - y2 * sin, y2 * cos + y1 * sin], dim=-1))


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """Torch twin of ``fused_ops.silu_mul``."""
    gate, up = gate_up.chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate.float()).to(gate.dtype).float()
            * up.float()).to(gate.dtype)


def fused_moe_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """Torch twin of ``fused_moe.fused_moe``: for each token and each of its k experts e,
    ``silu_mul(x @ w13[e]^T)`` rounded to x's dtype, ``@ w2[e]^T`` in fp32 times the routing
    weight, summed over the k experts in fp32 and rounded to x's dtype. One pass per expert that
    has tokens (the rows routed to it)."""
    tokens, top_k = topk_ids.shape
    flat = topk_ids.reshape(-1).long()
    y = torch.zeros(tokens * top_k, x.shape[1], dtype=torch.float32, device=x.device)
    for e in flat.unique().tolist():
        pairs = (flat == e).nonzero().squeeze(1)
        h = silu_mul_ref((x[pairs // top_k].float() @ w13[e].float().T).to(x.dtype))
        y[pairs] = (h.float() @ w2[e].float().T) * topk_weights.reshape(-1)[pairs, None].float()
    return y.view(tokens, top_k, -1).sum(1).to(x.dtype)


# ---------------------------------------------------------------- sparse (tiered-KV) decode path


def sparse_decode_ref(q: torch.Tensor, ws_k: torch.Tensor, ws_v: torch.Tensor,
                      ws_map: torch.Tensor, seq_slots: torch.Tensor, local_lens: torch.Tensor,
                      scale: float, out: torch.Tensor | None = None, num_splits: int | None = None,
                      draft_rows: torch.Tensor | None = None, extra_k: torch.Tensor | None = None,
                      extra_v: torch.Tensor | None = None,
                      scales: tuple[torch.Tensor, torch.Tensor] | None = None,
                      open_block: OpenBlocks | None = None) -> torch.Tensor:
    """Decode attention over per-head working sets, as ``sparse_decode_attention``; returns
    ``out``.

    q: ``[Nq, Hq, D]``; query head h attends kv head ``h // G``. ws_k, ws_v: ``[S, Hk, W, B, D]``.
    ws_map: ``[S, Hk, W]``, -1 = empty slot. seq_slots: ``[N]``, -1 = padding row. local_lens:
    ``[N]``. Row n, kv head h attends the B tokens of every slot ``j < W-1`` with
    ``ws_map[s, h, j] >= 0`` and the first ``local_lens[n]`` tokens of slot W-1; rows with nothing
    to attend give zeros. draft_rows ``[N]`` (q row of row n's draft, -1 none): a draft row attends
    what its row attends plus its own ``extra_k/extra_v`` ``[Nq, Hk, D]`` entry (nothing for a
    padding row's draft). 8-bit working sets (V in token order, as K) come with ``scales``
    ``[S, Hk, W, B]`` each; with ``open_block`` row n's local tokens come from its block
    ``open_block.slots[n]``. num_splits is accepted for signature parity and ignored.
    """
    num_rows, num_q_heads, head_dim = q.shape
    n = seq_slots.shape[0]
    _, num_kv_heads, num_slots, block_size, _ = ws_k.shape
    group = num_q_heads // num_kv_heads
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if n == 0:
        return out
    owner = torch.arange(num_rows, device=q.device)  # the row whose working set each q row reads
    extra_ok = torch.zeros(num_rows, dtype=torch.bool, device=q.device)
    if draft_rows is not None:
        has = draft_rows >= 0
        drafts = draft_rows[has].long()
        owner[drafts] = torch.arange(n, device=q.device)[has]
        extra_ok[drafts] = seq_slots[has] >= 0
    seq = seq_slots.long()[owner]
    rows = seq.clamp(min=0)
    slot_ok = ws_map[rows] >= 0  # [Nq, Hk, W]; the local slot's entry is replaced below
    tok_ok = slot_ok[..., None].expand(-1, -1, -1, block_size).clone()  # [Nq, Hk, W, B]
    # [Nq, B]
    local_ok = torch.arange(block_size, device=q.device) < local_lens.long()[owner][:, None]
    tok_ok[:, :, num_slots - 1] = local_ok[:, None, :]
    tokens = num_slots * block_size
    valid = (tok_ok & (seq >= 0)[:, None, None, None]).reshape(num_rows, num_kv_heads, tokens)

    k, v = (dequantize(ws[rows], None if scales is None else scales[i][rows])
            for i, ws in enumerate((ws_k, ws_v)))  # [Nq, Hk, W, B, D]
    if open_block is not None:
        opened = open_block.slots.long().clamp(min=0)[owner]
        k[:, :, -1], v[:, :, -1] = open_block.k[opened].float(), open_block.v[opened].float()
    k, v = (x.reshape(num_rows, num_kv_heads, tokens, head_dim) for x in (k, v))
    if draft_rows is not None:  # one more token per q row: its own key/value, valid on draft rows
        k = torch.cat([k, extra_k.float()[:, :, None]], dim=2)
        v = torch.cat([v, extra_v.float()[:, :, None]], dim=2)
        valid = torch.cat([valid, extra_ok[:, None, None].expand(-1, num_kv_heads, 1)], dim=2)
    k, v = k.masked_fill(~valid[..., None], 0.0), v.masked_fill(~valid[..., None], 0.0)
    qf = q.float().reshape(num_rows, num_kv_heads, group, head_dim)
    scores = (qf @ k.transpose(-1, -2)) * scale  # [Nq, Hk, G, T]
    scores = scores.masked_fill(~valid[:, :, None, :], float("-inf"))
    probs = torch.where(valid.any(-1)[:, :, None, None], torch.softmax(scores, dim=-1), 0.0)
    out.copy_((probs @ v).reshape(num_rows, num_q_heads, head_dim))
    return out


def block_scores_ref(q: torch.Tensor, summaries: torch.Tensor, block_tables: torch.Tensor,
                     num_blocks: torch.Tensor, alpha: float,
                     out: torch.Tensor | None = None,
                     summary_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Summary scores, as ``block_scores``: float32 ``[N, Hk, max_blocks]``; returns ``out``.

    ``out[n, h, b]`` = sum over the G query heads g of kv head h of ``q_g . c + alpha * |q_g| . r``
    with c, r the center and radius of ``summaries[block_tables[n, b], h]`` (rows max, min; FP8
    rows times ``summary_scale``), for ``b < num_blocks[n]``; -inf past it (those table entries are
    not used).
    """
    n, num_q_heads, head_dim = q.shape
    num_kv_heads = summaries.shape[1]
    max_blocks = block_tables.shape[1]
    if out is None:
        out = torch.empty((n, num_kv_heads, max_blocks), dtype=torch.float32, device=q.device)
    used = torch.arange(max_blocks, device=q.device) < num_blocks.long()[:, None]  # [N, max_blocks]
    ids = torch.where(used, block_tables.long(), 0)
    box = dequantize(as_bytes(summaries)[ids].view(summaries.dtype),
                     None if summary_scale is None else summary_scale[ids])  # [N, mb, Hk, 2, D]
    center, radius = (box[..., 0, :] + box[..., 1, :]) / 2, (box[..., 0, :] - box[..., 1, :]) / 2
    qf = q.float().reshape(n, num_kv_heads, -1, head_dim)
    q_sum, q_abs = qf.sum(2), qf.abs().sum(2)  # [N, Hk, D]
    scores = (torch.einsum("nhd,nbhd->nhb", q_sum, center)
              + alpha * torch.einsum("nhd,nbhd->nhb", q_abs, radius))
    out.copy_(scores.masked_fill(~used[:, None, :], float("-inf")))
    return out


def gather_blocks_ref(host_k: torch.Tensor, host_v: torch.Tensor, layer: int, ws_k: torch.Tensor,
                      ws_v: torch.Tensor, src_block: torch.Tensor, src_head: torch.Tensor,
                      dst_slot: torch.Tensor, num_programs: int = 64,
                      items_per_iter: int = 1,
                      scales: tuple[torch.Tensor, ...] | None = None) -> None:
    """Copy ``host[src_block[i], layer, src_head[i]]`` (``[B, D]``) into slot ``dst_slot[i]`` of the
    working set flattened as ``[S * Hk * W, B, D]``, K and V, as ``gather_blocks``; items with a
    negative ``src_block`` are skipped. Host and working set may live on different devices.
    8-bit slices travel with their row scales (``scales`` = host K, host V, working-set K, V).
    num_programs and items_per_iter are accepted for signature parity and ignored.
    """
    keep = src_block >= 0
    pairs = [(host_k, ws_k), (host_v, ws_v)]
    if scales is not None:
        pairs += [(scales[0], scales[2]), (scales[1], scales[3])]
    for host, ws in pairs:
        src = host[src_block[keep].long().to(host.device), layer,
                   src_head[keep].long().to(host.device)]
        ws.view(-1, *host.shape[3:])[dst_slot[keep].long().to(ws.device)] = \
            src.to(ws.device, ws.dtype)


def wait_ready_ref(done: torch.Tensor, target: torch.Tensor, timed_out: torch.Tensor,
                   max_polls: int) -> None:
    """As ``wait_ready`` where nothing runs concurrently: ``done`` cannot advance while this waits,
    so it either holds already or the wait times out (``timed_out[0] = 1``)."""
    if done.item() < target.item():
        timed_out.fill_(1)


def publish_ref(src: torch.Tensor, dst: torch.Tensor, flag: torch.Tensor) -> None:
    """As ``publish``: ``dst[:n] = src``, then ``flag[0] = 1`` (on CPU tensors, in issue order)."""
    assert src.dtype == dst.dtype == torch.int64 and src.dim() == dst.dim() == 1
    assert dst.numel() >= src.numel() and flag.dtype == torch.int32 and flag.numel() == 1
    dst[:src.numel()] = src
    flag.fill_(1)


def clock_add_ref(acc: torch.Tensor, sign: int) -> None:
    """As ``clock_add`` with the host clock (ns): on CPU tensors work is done when issued, so a pair
    of marks around it times it."""
    assert acc.dtype == torch.int64 and acc.numel() == 1 and sign in (-1, 1)
    acc += sign * time.perf_counter_ns()


def block_minmax_ref(src: torch.Tensor, idx0: torch.Tensor, idx1: torch.Tensor,
                     summaries: torch.Tensor, dst_block: torch.Tensor, dst_head: torch.Tensor,
                     num_tokens: torch.Tensor | None = None,
                     src_scale: torch.Tensor | None = None,
                     summary_scale: torch.Tensor | None = None) -> None:
    """Element-wise max (row 0) and min (row 1) over the tokens of ``src[idx0[i], idx1[i]]``
    (``[B, D]``) into ``summaries[dst_block[i], dst_head[i]]``, as ``block_minmax``; items with a
    negative ``dst_block`` (or ``num_tokens[i] == 0``) are skipped; only the first ``num_tokens[i]``
    tokens count when given. src and summaries may live on different devices. An FP8 ``src`` comes
    with ``src_scale`` ``[I0, I1, B]``; FP8 ``summaries`` with ``summary_scale``
    ``[num_host_blocks, Hk, 2]`` (each row quantised as ``quantize_rows`` does).
    """
    block_size = src.shape[2]
    keep = dst_block >= 0
    if num_tokens is not None:
        keep &= num_tokens > 0
    # [m, B, D]
    at = idx0[keep].long().to(src.device), idx1[keep].long().to(src.device)
    blocks = dequantize(src[at], None if src_scale is None else src_scale[at])
    blocks = blocks.to(summaries.device)
    if num_tokens is None:
        hi, lo = blocks.amax(1), blocks.amin(1)
    else:
        tok_ok = (torch.arange(block_size, device=blocks.device)
                  < num_tokens[keep].long().to(blocks.device)[:, None])[..., None]  # [m, B, 1]
        hi = blocks.masked_fill(~tok_ok, float("-inf")).amax(1)
        lo = blocks.masked_fill(~tok_ok, float("inf")).amin(1)
    dst = dst_block[keep].long().to(summaries.device), dst_head[keep].long().to(summaries.device)
    rows = torch.stack([hi, lo], dim=1)  # [m, 2, D]
    if summary_scale is None:
        summaries[dst] = rows.to(summaries.dtype)
    else:
        values, summary_scale[dst] = quantize_rows(rows)
        as_bytes(summaries)[dst] = as_bytes(values)


def select_blocks_ref(scores: torch.Tensor, ws_map: torch.Tensor, ws_last: torch.Tensor,
                      slots: torch.Tensor, block_tables: torch.Tensor, k: int, cap: int,
                      now: torch.Tensor,
                      counters: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Capped selection for rows ``slots``, as ``select_blocks``: ``kv.selection.plan_selection`` on
    per-row copies of the tables, written back; returns (host block ids, slots) ``[N, Hk, cap]``, -1
    past the admitted blocks; adds hits, misses, admitted to ``counters[:3]``. ``scores`` is left
    as is."""
    from oasiskv.kv.selection import plan_selection  # the policy's specification
    slots = slots.long()
    map_rows, last_rows = ws_map[slots, :, :k], ws_last[slots]
    sel = plan_selection(scores, map_rows, last_rows, k, cap, now)
    ws_map[slots, :, :k] = map_rows
    ws_last[slots] = last_rows
    host_ids = (block_tables.long().gather(1, sel.src_block.clamp(min=0).flatten(1))
                .view_as(sel.src_block))
    counters[:3] += torch.stack([sel.hits, sel.misses, sel.admitted])
    return torch.where(sel.src_block >= 0, host_ids, -1), sel.dst_slot


def promote_local_ref(ws_k: torch.Tensor, ws_v: torch.Tensor,
                      scales: tuple[torch.Tensor, torch.Tensor] | None, ws_map: torch.Tensor,
                      ws_last: torch.Tensor, slots: torch.Tensor, done: torch.Tensor,
                      block: torch.Tensor, now: torch.Tensor) -> None:
    """As ``promote_local``: each ``done`` row's local block (slot W-1), per head, into the first
    empty slot, else the least recently selected one; vectorized over rows."""
    K = ws_map.shape[2] - 1
    if slots.shape[0] == 0:
        return
    rows = slots.long()
    held, last = ws_map[rows, :, :K], ws_last[rows]
    key = torch.where(held < 0, torch.full_like(last, torch.iinfo(torch.int64).min), last)
    victim = key.argmin(dim=-1)                                        # [N, Hk]
    done_rows, victim = rows[done], victim[done]
    if done_rows.numel() == 0:
        return
    heads = torch.arange(ws_map.shape[1], device=ws_map.device)[None, :]
    r = done_rows[:, None]
    for cache in (ws_k, ws_v, *(scales or ())):
        cache = as_bytes(cache)
        cache[r, heads, victim] = cache[r, heads, K]
    ws_map[r, heads, victim] = block[done].to(ws_map.dtype)[:, None]
    ws_last[r, heads, victim] = now.to(ws_last.dtype)
