"""Benchmarks: the decode throughput sweep (``oasiskv bench``), kernel timings, roofline helpers."""
