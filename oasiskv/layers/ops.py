"""Element-wise ops of the decoder, dispatched by device: Triton fusions (``kernels.fused_ops``) on
CUDA, their torch references (``kernels.reference``) elsewhere. Same contracts and rounding."""
from __future__ import annotations

import torch

from oasiskv.kernels import reference


def _fused():
    from oasiskv.kernels import fused_ops
    return fused_ops


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """``norm(x)``, or ``(norm(x + residual), x + residual)`` when a residual is given; x ``[T, H]``."""
    return (_fused().rms_norm if x.is_cuda else reference.rms_norm_ref)(x, weight, eps, residual)


def qk_norm_rope(q, k, positions, cos_sin, q_weight, k_weight, eps: float) -> None:
    """In place on q ``[T, Hq, D]`` and k ``[T, Hk, D]``: optional per-head RMSNorm, then RoPE."""
    (_fused().qk_norm_rope if q.is_cuda else reference.qk_norm_rope_ref)(
        q, k, positions, cos_sin, q_weight, k_weight, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``[T, 2I] -> [T, I]``: silu(gate) * up."""
    return (_fused().silu_mul if gate_up.is_cuda else reference.silu_mul_ref)(gate_up)
