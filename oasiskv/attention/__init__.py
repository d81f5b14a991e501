"""Attention backends: the seam where the KV storage and attention kernels plug into the model."""
