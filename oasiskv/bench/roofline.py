"""Roofline helpers: measured copy bandwidth of the device and the bytes one decode step must
read."""
from __future__ import annotations

import time

import torch


def measure_copy_bandwidth(device: torch.device, nbytes: int = 1 << 30, iters: int = 10) -> float:
    """Bytes/s of a large device-to-device copy, counting bytes read plus bytes written."""
    if device.type != "cuda":
        nbytes = min(nbytes, 256 << 20)
    src = torch.empty(nbytes // 2, dtype=torch.float16, device=device).uniform_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            dst.copy_(src)
        end.record()
        end.synchronize()
        seconds = start.elapsed_time(end) / 1e3
    else:
        t0 = time.perf_counter()
        for _ in range(iters):
            dst.copy_(src)
        seconds = time.perf_counter() - t0
    return 2 * nbytes * iters / seconds


def weight_bytes(model: torch.nn.Module, tokens: int | None = None) -> int:
    """Bytes of parameters one decode step of ``tokens`` tokens reads: all of them, except an untied
    input embedding (only a few rows of it are gathered) and, in MoE layers, the experts no token
    is routed to: a layer of E experts, k per token, is expected to touch E (1 - (1 - k/E)^tokens)
    of them under uniform routing (random weights route about uniformly); every expert when
    ``tokens`` is None."""
    from oasiskv.layers.moe import Experts
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if getattr(model, "lm_head", None) is not None:
        total -= model.embed_tokens.weight.numel() * model.embed_tokens.weight.element_size()
    moe = getattr(getattr(model, "cfg", None), "moe", None)
    if tokens is None or moe is None:
        return total
    untouched = (1 - moe.top_k / moe.num_experts) ** tokens
    for experts in (m for m in model.modules() if isinstance(m, Experts)):
        total -= round(untouched * sum(p.numel() * p.element_size()
                                       for p in experts.parameters()))
    return total


def kv_read_bytes(engine, context_lens: list[int]) -> int:
    """KV bytes one decode step's attention reads for sequences of these lengths: all of it (dense),
    or the working sets and summaries (tiered, ``TieredKV.decode_read_bytes``)."""
    tiered = getattr(engine.runner.backend, "kv", None)
    if tiered is not None:
        return tiered.decode_read_bytes(context_lens)
    return sum(context_lens) * engine.runner.backend.bytes_per_block() // engine.config.block_size
