"""Attention layer: the model's view of attention. It owns nothing but its shape; the attention
backend of the current forward context (``engine.forward_batch``) stores K/V and computes the
output."""
from __future__ import annotations

import torch

from oasiskv.engine.forward_batch import get_forward_context


class Attention(torch.nn.Module):
    def __init__(self, layer_idx: int, num_heads: int, num_kv_heads: int, head_dim: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim ** -0.5

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q ``[T, Hq, D]``, k/v ``[T, Hk, D]`` (post-RoPE) -> ``[T, Hq, D]``."""
        ctx = get_forward_context()
        return ctx.backend.forward(self.layer_idx, q, k, v, ctx.batch, self.scale)
