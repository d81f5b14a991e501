"""Tiered KV machinery (kv_mode=oasis): the full KV cache in a host store, per-head working sets of
K blocks in HBM, block summaries, selection with the HBM fetch cap. Only ``attention/sparse.py``
uses it."""
