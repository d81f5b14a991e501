"""Triton fusions of the decoder's element-wise work (one launch instead of five to twenty each).

At decode, weights and KV dominate the bytes but these small ops dominate the kernel count: unfused,
a Qwen3 layer launches ~50 kernels. Each function here has a torch twin in ``reference.py`` with the
same rounding: inputs upcast to fp32, results rounded to the input dtype where the HF models round.

- ``rms_norm(x, weight, eps, residual=None)``: ``[T, H]``; with ``residual`` first forms
  ``s = round(x + residual)`` and returns ``(norm(s), s)``.
- ``qk_norm_rope(q, k, positions, cos_sin, q_weight, k_weight, eps)``: in place on ``q [T, Hq, D]``
  and ``k [T, Hk, D]`` (views with last-dim stride 1): optional per-head RMSNorm, then rotate-half
  RoPE.
- ``silu_mul(gate_up)``: ``[T, 2I] -> [T, I]``, ``silu(gate) * up``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, stride_x, stride_r, stride_o,
                     n_cols, eps, HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        s = x + tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        s_rounded = s.to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * n_cols + cols, s_rounded, mask=mask)
        x = s_rounded.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / n_cols + eps)
    normed = (x * rstd).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None):
    """RMSNorm of ``x [T, H]`` (or of ``x + residual``); see the module docstring for the
    contract."""
    assert x.dim() == 2 and x.stride(1) == 1
    rows, cols = x.shape
    out = torch.empty((rows, cols), dtype=x.dtype, device=x.device)
    res_out = torch.empty_like(out) if residual is not None else out
    if rows:
        _rms_norm_kernel[(rows,)](x, residual if residual is not None else x, weight, out, res_out,
                                  x.stride(0), residual.stride(0) if residual is not None else 0,
                                  out.stride(0), cols, eps, HAS_RES=residual is not None,
                                  BLOCK=triton.next_power_of_2(cols),
                                  num_warps=4 if cols <= 2048 else 8)
    return out if residual is None else (out, res_out)


@triton.jit
def _qk_norm_rope_kernel(q_ptr, k_ptr, pos_ptr, cos_sin_ptr, qw_ptr, kw_ptr, stride_qt, stride_qh,
                         stride_kt, stride_kh, num_q_heads, eps,
                         HALF: tl.constexpr, HAS_NORM: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    is_q = h < num_q_heads
    if is_q:
        base = q_ptr + t * stride_qt + h * stride_qh
        w_ptr = qw_ptr
    else:
        base = k_ptr + t * stride_kt + (h - num_q_heads) * stride_kh
        w_ptr = kw_ptr
    offs = tl.arange(0, HALF)
    x1 = tl.load(base + offs).to(tl.float32)
    x2 = tl.load(base + HALF + offs).to(tl.float32)
    if HAS_NORM:  # HF order: normalize, round to the model dtype, scale by the weight, round again
        rstd = 1.0 / tl.sqrt((tl.sum(x1 * x1, 0) + tl.sum(x2 * x2, 0)) / (2 * HALF) + eps)
        dt = q_ptr.dtype.element_ty
        x1 = ((x1 * rstd).to(dt).to(tl.float32)
              * tl.load(w_ptr + offs).to(tl.float32)).to(dt).to(tl.float32)
        x2 = ((x2 * rstd).to(dt).to(tl.float32)
              * tl.load(w_ptr + HALF + offs).to(tl.float32)).to(dt).to(tl.float32)
    pos = tl.load(pos_ptr + t)
    cos = tl.load(cos_sin_ptr + pos * (2 * HALF) + offs)
    sin = tl.load(cos_sin_ptr + pos * (2 * HALF) + HALF + offs)
    tl.store(base + offs, (x1 * cos - x2 * sin).to(q_ptr.dtype.element_ty))
    tl.store(base + HALF + offs, (x2 * cos + x1 * sin).to(q_ptr.dtype.element_ty))


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                 q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float) -> None:
    """In place: optional per-head RMSNorm (both weights or neither), then RoPE.

    q ``[T, Hq, D]``, k ``[T, Hk, D]`` (same dtype, last-dim stride 1), positions ``[T]`` int64,
    cos_sin fp32 ``[max_pos, D]`` (cos of the D/2 frequencies, then sin).
    """
    tokens, num_q_heads, head_dim = q.shape
    assert (q.stride(2) == 1 and k.stride(2) == 1 and cos_sin.is_contiguous()
            and cos_sin.dtype == torch.float32)
    if not tokens:
        return
    has_norm = q_weight is not None
    _qk_norm_rope_kernel[(tokens, num_q_heads + k.shape[1])](
        q, k, positions, cos_sin, q_weight if has_norm else q, k_weight if has_norm else k,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), num_q_heads, eps,
        HALF=head_dim // 2, HAS_NORM=has_norm, num_warps=1)


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, stride_x, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    # torch's silu rounds to the model dtype before the product: keep that rounding
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * n_cols + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``[T, 2I] -> [T, I]``: ``silu(gate_up[:, :I]) * gate_up[:, I:]``."""
    rows, width = gate_up.shape
    assert gate_up.stride(1) == 1 and width % 2 == 0
    out = torch.empty((rows, width // 2), dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton.next_power_of_2(width // 2))
    if rows:
        _silu_mul_kernel[(rows, triton.cdiv(width // 2, block))](gate_up, out, gate_up.stride(0),
                                                                 width // 2, BLOCK=block)
    return out
