"""Pure-torch references for the Triton kernels in this package (``store_kv``, ``paged_decode``, ``fused_ops``).

Same signatures and semantics as the kernels; math in fp32. The engine uses them on CPU, so they are
vectorized over the batch (they do sync the host, e.g. on ``context_lens.max()``, so they are not
CUDA-graph capturable).
"""
import torch


def store_kv_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    """Write ``k[i]``/``v[i]`` (``[N, num_kv_heads, head_dim]``) into cache slot ``slot_mapping[i]``.

    Caches: ``[num_blocks, num_kv_heads, block_size, head_dim]``, written in place with values cast to
    their dtype; slot = ``block_id * block_size + offset``; negative slots are skipped.
    """
    block_size = k_cache.shape[2]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    blk, off = slots // block_size, slots % block_size
    # Advanced indices split by a slice: the selection is [n, num_kv_heads, head_dim].
    k_cache[blk, :, off] = k[keep].to(k_cache.dtype)
    v_cache[blk, :, off] = v[keep].to(v_cache.dtype)


def paged_decode_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                     out: torch.Tensor | None = None,
                     blocks_per_split: int | None = None) -> torch.Tensor:
    """Decode attention over a paged KV cache, as ``paged_decode_attention``; returns ``out``.

    q: ``[B, num_q_heads, head_dim]``; query head h attends kv head ``h // G``. Caches:
    ``[num_blocks, num_kv_heads, block_size, head_dim]``. block_tables: ``[B, max_blocks]``, entries
    past a row's ``ceil(context_lens[b] / block_size)`` blocks are never used. context_lens: ``[B]``;
    rows with 0 give zeros. out: optional ``[B, num_q_heads, head_dim]`` target, else a new tensor of
    q's dtype. blocks_per_split is accepted for signature parity and ignored.
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
    ids = torch.where(col < (lens[:, None] + block_size - 1) // block_size, block_tables[:, :n_blk].long(), 0)
    tokens = n_blk * block_size
    # [B, n_blk, H, bs, D] -> [B, H, T, D]
    k = k_cache[ids].transpose(1, 2).reshape(batch, num_kv_heads, tokens, head_dim).float()
    v = v_cache[ids].transpose(1, 2).reshape(batch, num_kv_heads, tokens, head_dim).float()
    valid = (torch.arange(tokens, device=q.device) < lens[:, None])[:, None, :, None]  # [B, 1, T, 1]
    k = k.masked_fill(~valid, 0.0)
    v = v.masked_fill(~valid, 0.0)

    qf = q.float().reshape(batch, num_kv_heads, group, head_dim)
    scores = (qf @ k.transpose(-1, -2)) * scale  # [B, H, G, T]
    scores = scores.masked_fill(~valid.transpose(-1, -2), float("-inf"))
    o = (torch.softmax(scores, dim=-1) @ v).reshape(batch, num_q_heads, head_dim)
    out.copy_(torch.where((lens > 0)[:, None, None], o, 0.0))
    return out


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """Torch twin of ``fused_ops.rms_norm`` (same rounding points as the HF models)."""
    if residual is not None:
        x = (x.float() + residual.float()).to(x.dtype)
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    out = (normed.float() * weight.float()).to(x.dtype)
    return out if residual is None else (out, x)


def qk_norm_rope_ref(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                     q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float) -> None:
    """Torch twin of ``fused_ops.qk_norm_rope`` (in place on q and k)."""
    cos, sin = cos_sin[positions].unsqueeze(1).chunk(2, dim=-1)
    for x, w in ((q, q_weight), (k, k_weight)):
        y = rms_norm_ref(x, w, eps) if w is not None else x
        y1, y2 = y.float().chunk(2, dim=-1)
        x.copy_(torch.cat([y1 * cos - y2 * sin, y2 * cos + y1 * sin], dim=-1))


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """Torch twin of ``fused_ops.silu_mul``."""
    gate, up = gate_up.chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate.float()).to(gate.dtype).float() * up.float()).to(gate.dtype)
