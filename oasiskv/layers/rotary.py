"""Rotary position embedding (HF "rotate_half" convention), with Llama-3 frequency scaling."""
from __future__ import annotations

import math

import torch

from oasiskv.config import RopeConfig


def inv_frequencies(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    """Inverse frequencies ``[head_dim // 2]`` (fp32), scaled per Llama 3.x when ``rope.scaling`` is
    set."""
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if not rope.scaling:
        return inv_freq.float()
    s = rope.scaling
    factor, low, high = s["factor"], s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled).float()


class RotaryEmbedding(torch.nn.Module):
    """Holds ``cos_sin`` fp32 ``[max_positions, head_dim]``: cos of the head_dim/2 frequencies, then
    sin. Applied by ``layers.ops.qk_norm_rope`` (rotate-half convention)."""

    def __init__(self, head_dim: int, max_positions: int, rope: RopeConfig):
        super().__init__()
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32),
                            inv_frequencies(head_dim, rope))
        self.register_buffer("cos_sin", torch.cat([freqs.cos(), freqs.sin()], dim=-1),
                             persistent=False)
