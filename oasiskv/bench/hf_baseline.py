"""The transformers baseline of ``oasiskv bench``: ``generate`` on the same workload.

Decode throughput is isolated from prefill by timing ``generate`` twice, with ``out`` and with 1 new
token: decode tok/s = batch * (out - 1) / (t_out - t_1). The batch is capped (``hf_max_batch``)
because transformers keeps a contiguous cache per request and runs out of memory long before a
paged pool.
"""
from __future__ import annotations

import gc
import time
from pathlib import Path

import torch

from oasiskv.bench.decode_sweep import Point

_cache: dict = {}


def _model(path: Path, dummy: bool, dtype: torch.dtype, device: torch.device):
    key = (str(path), dtype, str(device))
    if key not in _cache:
        from transformers import AutoConfig, AutoModelForCausalLM
        _cache.clear()
        gc.collect()
        if dummy:
            cfg = AutoConfig.from_pretrained(str(path))
            with torch.device(device):
                model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
        else:
            model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).to(device)
        _cache[key] = model.eval()
    return _cache[key]


def _timed_generate(model, ids: torch.Tensor, new_tokens: int) -> float:
    if ids.device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                   pad_token_id=0, attention_mask=torch.ones_like(ids))
    if ids.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


@torch.inference_mode()
def bench_hf(path: Path, dummy: bool, dtype: torch.dtype, device: torch.device, context: int,
             batch: int, output_len: int, copy_gb_s: float, seed: int) -> Point:
    point = Point("hf", context, batch, output_len)
    model = _model(path, dummy, dtype, device)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    ids = torch.randint(1, model.config.vocab_size, (batch, context), generator=gen).to(device)
    try:
        _timed_generate(model, ids[:, :16], 2)  # warm-up
        t1 = _timed_generate(model, ids, 1)
        tn = _timed_generate(model, ids, output_len)
    except torch.OutOfMemoryError:
        point.note = "out of memory"
        return point
    finally:
        if device.type == "cuda":
            torch.cuda.empty_cache()
    steps = output_len - 1
    step_s = max(tn - t1, 1e-9) / steps
    cfg = model.config
    kv_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * \
        getattr(cfg, "head_dim", cfg.hidden_size // cfg.num_attention_heads) * dtype.itemsize
    point.batch = batch
    point.tok_s = batch / step_s
    point.tpot_ms = step_s * 1e3
    point.kv_gb_per_step = batch * (context + output_len / 2) * kv_per_token / 1e9
    point.achieved_gb_s = (_weight_bytes(model) / 1e9 + point.kv_gb_per_step) / step_s
    point.roofline = point.achieved_gb_s / copy_gb_s
    return point


def _weight_bytes(model) -> int:
    """Parameter bytes a decode step reads (an untied input embedding is only gathered from)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if not model.config.tie_word_embeddings:
        emb = model.get_input_embeddings().weight
        total -= emb.numel() * emb.element_size()
    return total
