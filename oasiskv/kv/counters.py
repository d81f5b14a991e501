"""DeviceCounters: per-step counters summed on the device by kernels, read by name once a step."""
from __future__ import annotations

import torch


class DeviceCounters:
    """int64 ``tensor`` ``[rows, len(names)]`` (a row per layer, say): entry (r, i) counts
    ``names[i]`` of row r, kernels add to a row in that order. ``read`` syncs the current stream,
    returns the counts and zeroes them."""

    def __init__(self, names: tuple[str, ...], device: torch.device, rows: int = 1):
        self.names = names
        self.tensor = torch.zeros((rows, len(names)), dtype=torch.long, device=device)

    def read(self) -> tuple[dict[str, int], dict[str, list[int]]]:
        """(totals by name, per-row counts by name)."""
        values = self.tensor.tolist()
        self.tensor.zero_()
        per_row = {name: [row[i] for row in values] for i, name in enumerate(self.names)}
        return {name: sum(rows) for name, rows in per_row.items()}, per_row
