"""Micro-benchmark of ``paged_decode_attention`` against torch SDPA on contiguous KV (GPU only).

Run ``python -m oasiskv.bench.kernels``. Shape: Qwen3-8B attention (32 q heads, 8 kv heads, head_dim
128, bf16, block 16), batch 1/8/32/64 x context 4K/16K/32K (all rows the full context; combos whose
paged cache plus its contiguous copy would exceed ``_MAX_BYTES`` are skipped). Times are medians
from ``triton.testing.do_bench`` over a CUDA-graph replay of one call (the engine captures decode in
graphs; eager timing of small cases would measure Python launch cost); GB/s counts the K+V bytes
attended. Each point also sweeps forced split counts (best s) to check the split heuristic. Prints a
table (with the measured wave size), then one JSON line.
"""
import json
import math
import sys

import torch
import torch.nn.functional as F

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
DTYPE = torch.bfloat16
BATCHES = (1, 8, 24, 32, 48, 64)
SWEEP_SPLITS = (1, 2, 3, 4, 6, 8, 12, 16, 32, 64)
SWEEP_CONTEXT = 16384  # the split sweep runs at this context only
CONTEXTS = (4096, 16384, 32768)
_MAX_BYTES = 40e9


def _graph_median_ms(fn) -> float:
    """Median time of ``fn`` captured in a CUDA graph (as the engine runs decode), launch cost
    excluded."""
    import triton.testing

    fn()  # compile / warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return triton.testing.do_bench(graph.replay, return_mode="median")


def _bench_one(batch: int, context: int) -> dict:
    """Time one (batch, context) point; returns ms and GB/s for the kernel and SDPA."""
    from oasiskv.kernels.paged_decode import default_num_splits, paged_decode_attention

    dev = torch.device("cuda")
    blocks_per_row = context // BLOCK_SIZE
    num_blocks = batch * blocks_per_row
    shape = (num_blocks, NUM_KV_HEADS, BLOCK_SIZE, HEAD_DIM)
    k_cache = torch.empty(shape, dtype=DTYPE, device=dev).normal_()
    v_cache = torch.empty(shape, dtype=DTYPE, device=dev).normal_()
    tables = torch.randperm(num_blocks, device=dev).to(torch.int32).view(batch, blocks_per_row)
    lens = torch.full((batch,), context, dtype=torch.int32, device=dev)
    q = torch.randn(batch, NUM_Q_HEADS, HEAD_DIM, dtype=DTYPE, device=dev)
    out = torch.empty_like(q)
    scale = 1.0 / math.sqrt(HEAD_DIM)

    ms = _graph_median_ms(lambda: paged_decode_attention(
        q, k_cache, v_cache, tables, lens, scale, out=out))  # noqa: F821
    from oasiskv.kernels.paged_decode import _waves
    wave = next(iter(_waves.values()), None)
    sweep = {s: _graph_median_ms(lambda s=s: paged_decode_attention(
                 q, k_cache, v_cache, tables, lens, scale, out=out, num_splits=s))  # noqa: F821
             for s in SWEEP_SPLITS
             if s <= blocks_per_row * BLOCK_SIZE // 256 and context == SWEEP_CONTEXT}
    best = min(sweep, key=sweep.get) if sweep else 1

    # The same KV gathered contiguous: [B, kv_heads, T, D]; SDPA broadcasts kv heads over q heads
    # (GQA).
    def contiguous(cache):
        return cache[tables.long()].transpose(1, 2).reshape(batch, NUM_KV_HEADS, context,
                                                            HEAD_DIM)

    k, v = contiguous(k_cache), contiguous(v_cache)
    del k_cache, v_cache
    q4 = q.unsqueeze(2)
    sdpa_ms = _graph_median_ms(lambda: F.scaled_dot_product_attention(q4, k, v, scale=scale,
                                                                      enable_gqa=True))

    kv_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * q.element_size()
    return {"batch": batch, "context": context,
            "splits": default_num_splits(batch, NUM_KV_HEADS, blocks_per_row, BLOCK_SIZE,
                                         wave or 512),
            "wave": wave, "best_splits": best if sweep else None,
            "best_gbps": kv_bytes / sweep.get(best, ms) / 1e6,
            "ms": ms, "gbps": kv_bytes / ms / 1e6, "sdpa_ms": sdpa_ms,
            "sdpa_gbps": kv_bytes / sdpa_ms / 1e6}


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("oasiskv.bench.kernels needs a CUDA GPU (torch.cuda.is_available() is False)")
    rows = []
    print(f"paged_decode_attention: {NUM_Q_HEADS}q/{NUM_KV_HEADS}kv heads, head_dim {HEAD_DIM}, "
          f"bf16, block {BLOCK_SIZE}, on {torch.cuda.get_device_name()}")
    print(f"{'batch':>5} {'context':>7} {'splits':>6} {'ms':>8} {'GB/s':>7} {'best s':>6} "
          f"{'best GB/s':>9} {'sdpa ms':>8} {'sdpa GB/s':>9}")
    for batch in BATCHES:
        for context in CONTEXTS:
            cache_bytes = (2 * batch * context * NUM_KV_HEADS * HEAD_DIM
                           * torch.finfo(DTYPE).bits // 8)
            if 2 * cache_bytes > _MAX_BYTES:
                continue
            r = _bench_one(batch, context)
            rows.append(r)
            print(f"{batch:>5} {context:>7} {r['splits']:>6} {r['ms']:>8.4f} {r['gbps']:>7.0f} "
                  f"{str(r['best_splits'] or '-'):>6} {r['best_gbps']:>9.0f} {r['sdpa_ms']:>8.4f} "
                  f"{r['sdpa_gbps']:>9.0f}", flush=True)
            torch.cuda.empty_cache()
    print(f"measured wave: {rows[0]['wave'] if rows else None} programs resident at once")
    print(json.dumps({"bench": "paged_decode_attention", "num_q_heads": NUM_Q_HEADS,
                      "num_kv_heads": NUM_KV_HEADS, "head_dim": HEAD_DIM, "dtype": "bfloat16",
                      "block_size": BLOCK_SIZE, "device": torch.cuda.get_device_name(),
                      "results": rows}))


if __name__ == "__main__":
    main()
