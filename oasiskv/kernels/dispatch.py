"""Pick a kernel by device: the Triton implementation for CUDA tensors, its torch reference
otherwise.

Triton modules are imported only when a CUDA tensor asks for them, so CPU-only installs never need a
working Triton. Every name maps to (Triton module, function, reference function) with one signature.
"""
from __future__ import annotations

import importlib

from oasiskv.kernels import reference

_KERNELS = {
    "store_kv": ("store_kv", "store_kv", "store_kv_ref"),
    "paged_decode_attention": ("paged_decode", "paged_decode_attention", "paged_decode_ref"),
    "rms_norm": ("fused_ops", "rms_norm", "rms_norm_ref"),
    "qk_norm_rope": ("fused_ops", "qk_norm_rope", "qk_norm_rope_ref"),
    "silu_mul": ("fused_ops", "silu_mul", "silu_mul_ref"),
    "fused_moe": ("fused_moe", "fused_moe", "fused_moe_ref"),
    "sparse_decode_attention": ("sparse_decode", "sparse_decode_attention", "sparse_decode_ref"),
    "block_scores": ("block_scores", "block_scores", "block_scores_ref"),
    "gather_blocks": ("uva_gather", "gather_blocks", "gather_blocks_ref"),
    "block_minmax": ("summaries", "block_minmax", "block_minmax_ref"),
    "select_blocks": ("select_blocks", "select_blocks", "select_blocks_ref"),
    "promote_local": ("promote_local", "promote_local", "promote_local_ref"),
    "wait_ready": ("wait_ready", "wait_ready", "wait_ready_ref"),
    "clock_add": ("device_clock", "clock_add", "clock_add_ref"),
    "publish": ("publish", "publish", "publish_ref"),
}


def kernel(name: str, cuda: bool):
    """The function implementing ``name``: Triton when ``cuda``, else the torch reference."""
    module, fn, ref = _KERNELS[name]
    if not cuda:
        return getattr(reference, ref)
    return getattr(importlib.import_module(f"oasiskv.kernels.{module}"), fn)
