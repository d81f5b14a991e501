"""DeviceCounters: per-step counters summed on the device by kernels, read by name once a step."""
from __future__ import annotations

import torch


class DeviceCounters:
    """int64 ``tensor`` ``[len(names)]``, entry i counting ``names[i]`` (kernels add to it in that
    order). ``read`` syncs the current stream, returns the counts and zeroes them."""

    def __init__(self, names: tuple[str, ...], device: torch.device):
        self.names = names
        self.tensor = torch.zeros(len(names), dtype=torch.long, device=device)

    def read(self) -> dict[str, int]:
        values = self.tensor.tolist()
        self.tensor.zero_()
        return dict(zip(self.names, values))
