"""Element-wise ops of the decoder, dispatched by device (``kernels.dispatch``): Triton fusions on
CUDA, their torch references elsewhere. Same contracts and rounding."""
from __future__ import annotations

import torch

from oasiskv.kernels.dispatch import kernel


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None):
    """``norm(x)``, or ``(norm(x + residual), x + residual)`` when a residual is given;
    x ``[T, H]``."""
    return kernel("rms_norm", x.is_cuda)(x, weight, eps, residual)


def qk_norm_rope(q, k, positions, cos_sin, q_weight, k_weight, eps: float) -> None:
    """In place on q ``[T, Hq, D]`` and k ``[T, Hk, D]``: optional per-head RMSNorm, then RoPE."""
    kernel("qk_norm_rope", q.is_cuda)(q, k, positions, cos_sin, q_weight, k_weight, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``[T, 2I] -> [T, I]``: silu(gate) * up."""
    return kernel("silu_mul", gate_up.is_cuda)(gate_up)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
    """``[T, H] -> [T, H]``: each token's routed experts (``kernels/fused_moe.py``)."""
    return kernel("fused_moe", x.is_cuda)(x, w13, w2, topk_weights, topk_ids)
