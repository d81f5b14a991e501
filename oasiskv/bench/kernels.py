"""Micro-benchmarks of decode-side kernels (GPU only).

``python -m oasiskv.bench.kernels [--kv-cache-dtype auto|fp8|int8] [--batches 8,24]
[--contexts 32768] [--block-size 16]``: ``paged_decode_attention`` against torch SDPA on
contiguous KV. Shape: Qwen3-8B attention (32 q heads, 8 kv heads, head_dim 128, bf16 queries,
blocks of 16 tokens unless told), batch
1/8/24/32/48/64 x context 4K/16K/32K (all rows the full context; combos whose paged cache plus its
contiguous copy would exceed ``_MAX_BYTES`` are skipped). ``fp8`` / ``int8``: the cache is 8-bit
with per-row scales (SDPA still reads the bf16 original). Times are medians from
``triton.testing.do_bench`` over a CUDA-graph replay of one call (the engine captures decode in
graphs; eager timing of small cases would measure Python launch cost); GB/s counts the K+V bytes
attended (8-bit: values and scales). Points at 16K also sweep forced split counts (best s) to check
the split heuristic (``--sweep-splits``: every point, each count printed). ``--open-block``
(8-bit): each row's last block is read from a bf16 open block, as the engine does by default.
Prints a table (with the measured wave size), then one JSON line.

``python -m oasiskv.bench.kernels --scores``: ``block_scores`` (the summary scan of tiered decode)
at 128 rows x 32K (2,048 blocks each, 8 kv heads, bf16 summaries, or FP8 with ``--summary-dtype
fp8``, one layer), for each launch config (block-table entries x warps per program); GB/s counts
the summary bytes read (FP8: values and scales).

``python -m oasiskv.bench.kernels --select``: ``select_blocks`` (the capped top-K selection) at 128
rows x 2,048 blocks x 8 kv heads, K = 128, cap 7, one layer, for 1, 2, 4 and 8 warps per program.

``python -m oasiskv.bench.kernels --store``: ``store_kv`` (one layer's new K/V rows into the paged
cache) at 46, 128 and 8,192 tokens, bf16 / e4m3 (searched scale) / int8 storage; the 8-bit ones
also with each row copied to its open block, in the same launch and in a second one, into a
pinned host cache (the tiered host store, through UVA) with V in token order and in the V layout,
and into both caches in one launch (tiered decode's store).

``python -m oasiskv.bench.kernels --sparse [--kv-cache-dtype ...]``: ``sparse_decode_attention``
at the 128 x 32K tiered point (128 rows, each with a draft row; K = 128, every slot held; 8-bit:
with open blocks), one layer, for each launch config in ``LAUNCHES``; GB/s counts the working-set
bytes attended (8-bit: values and scales).
"""
import argparse
import functools
import json
import math
import sys

import torch
import torch.nn.functional as F

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
DTYPE = torch.bfloat16
BATCHES = (1, 8, 24, 32, 48, 64)
SWEEP_SPLITS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 14, 16, 24, 32, 64)
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


# (tokens per iteration, warps, stages, register cap) tried at the first point with --sweep-launch
# (and by --sparse): 1-2 warps per program too, whose online softmax needs no reduction across
# warps; and register caps that fit one more program per SM (offline: 64 / 2 / 3 compiles to 248
# registers, 4 programs per SM, and to 200 with the cap, 5 per SM, spilling 24 bytes;
# ``scripts/compile_kernels.py``)
LAUNCHES = ([(t, w, s, 0) for t in (32, 64, 128) for w in (1, 2, 4, 8) for s in (2, 3, 4)
             if 8 <= t // w <= 64]
            + [(64, 2, 3, 200), (64, 2, 4, 200), (32, 2, 4, 200), (64, 4, 3, 128),
               (128, 4, 3, 200)])


def _launch_ms(fn, launch: tuple[int, int, int, int]) -> float | None:
    """``_graph_median_ms(fn)``, or None (printed) when ``launch`` does not compile or run (e.g.
    its shared memory exceeds the device's)."""
    try:
        return _graph_median_ms(fn)
    except Exception as e:  # noqa: BLE001 (a config the device cannot run is a result)
        print(f"   launch {launch}: failed ({type(e).__name__}: {str(e)[:120]})", flush=True)
        torch.cuda.synchronize()
        return None


def _bench_one(batch: int, context: int, kv: torch.dtype | None,
               sweep_launch: bool = False, block_size: int = BLOCK_SIZE,
               sweep_splits: bool = False, open_block: bool = False) -> dict:
    """Time one (batch, context) point, the cache in ``kv`` (8-bit) or bf16 (None), in blocks of
    ``block_size`` tokens; returns ms and GB/s for the kernel and SDPA. The forced split counts
    are swept at SWEEP_CONTEXT, or with ``sweep_splits`` at every context. ``open_block`` (8-bit):
    each row's last block is read from an open block in bf16, as the engine's default does."""
    from oasiskv.kernels.fp8 import OpenBlocks, quantize_rows, row_bytes, stored_v
    from oasiskv.kernels.paged_decode import default_num_splits, paged_decode_attention

    dev = torch.device("cuda")
    blocks_per_row = context // block_size
    num_blocks = batch * blocks_per_row
    shape = (num_blocks, NUM_KV_HEADS, block_size, HEAD_DIM)
    k_cache = torch.empty(shape, dtype=DTYPE, device=dev).normal_()
    v_cache = torch.empty(shape, dtype=DTYPE, device=dev).normal_()
    tables = torch.randperm(num_blocks, device=dev).to(torch.int32).view(batch, blocks_per_row)
    lens = torch.full((batch,), context, dtype=torch.int32, device=dev)
    q = torch.randn(batch, NUM_Q_HEADS, HEAD_DIM, dtype=DTYPE, device=dev)
    out = torch.empty_like(q)
    scale = 1.0 / math.sqrt(HEAD_DIM)
    stored, scales, opened = (k_cache, v_cache), None, None
    if kv is not None:
        (kq, ks), (vq, vs) = quantize_rows(k_cache, kv), quantize_rows(v_cache, kv)
        stored, scales = (kq, stored_v(vq)), (ks, vs)
        if open_block:
            opened = OpenBlocks(*(torch.randn((batch,) + shape[1:], dtype=DTYPE, device=dev)
                                  for _ in range(2)),
                                torch.arange(batch, dtype=torch.int32, device=dev))

    def attend(**kw):
        return paged_decode_attention(q, *stored, tables, lens, scale, out=out,  # noqa: F821
                                      scales=scales, open_block=opened, **kw)  # noqa: F821

    ms = _graph_median_ms(attend)
    from oasiskv.kernels.paged_decode import _waves
    wave = next(iter(_waves.values()), None)
    sweep = {s: _graph_median_ms(lambda s=s: attend(num_splits=s))
             for s in SWEEP_SPLITS
             if s <= blocks_per_row * block_size // 256
             and (sweep_splits or context == SWEEP_CONTEXT)}
    best = min(sweep, key=sweep.get) if sweep else 1
    launches = {}
    if sweep_launch:
        for launch in LAUNCHES:
            ms_launch = _launch_ms(lambda launch=launch: attend(launch=launch), launch)
            if ms_launch is not None:
                launches[launch] = ms_launch
                print(f"   launch {launch}: {ms_launch:.4f} ms", flush=True)

    # The same KV gathered contiguous: [B, kv_heads, T, D]; SDPA broadcasts kv heads over q heads
    # (GQA).
    def contiguous(cache):
        return cache[tables.long()].transpose(1, 2).reshape(batch, NUM_KV_HEADS, context,
                                                            HEAD_DIM)

    k, v = contiguous(k_cache), contiguous(v_cache)
    del k_cache, v_cache, stored, scales, opened  # the closure's cells too: SDPA's copies need room
    q4 = q.unsqueeze(2)
    sdpa_ms = _graph_median_ms(lambda: F.scaled_dot_product_attention(q4, k, v, scale=scale,
                                                                      enable_gqa=True))

    kv_bytes = 2 * batch * context * NUM_KV_HEADS * row_bytes(
        HEAD_DIM, kv or DTYPE)
    sdpa_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * q.element_size()
    return {"batch": batch, "context": context,
            "splits": default_num_splits(batch, NUM_KV_HEADS, blocks_per_row, block_size,
                                         wave or 512),
            "wave": wave, "best_splits": best if sweep else None,
            "best_gbps": kv_bytes / sweep.get(best, ms) / 1e6,
            "ms": ms, "gbps": kv_bytes / ms / 1e6, "sdpa_ms": sdpa_ms,
            "split_ms": {str(s): t for s, t in sweep.items()},
            "launches": {str(k): kv_bytes / v / 1e6 for k, v in launches.items()},
            "sdpa_gbps": sdpa_bytes / sdpa_ms / 1e6}


SCORE_ROWS, SCORE_BLOCKS = 128, 2048
# (block-table entries per tile, tiles per program, warps, stages)
SCORE_CONFIGS = ([(b, 1, w, 1) for b in (32, 64, 128) for w in (2, 4, 8)]
                 + [(b, t, w, s) for b in (16, 32, 64) for t in (4, 16) for w in (2, 4)
                    for s in (2, 3)])


def bench_scores(fp8: bool = False) -> dict:
    """``block_scores`` launch configs at SCORE_ROWS x SCORE_BLOCKS blocks (one layer); ``fp8``:
    FP8 summaries with their row scales (bytes read count both)."""
    from oasiskv.kernels import block_scores as scan
    from oasiskv.kernels.fp8 import quantize_rows

    dev = torch.device("cuda")
    n, m = SCORE_ROWS, SCORE_BLOCKS
    summaries = torch.randn(n * m, NUM_KV_HEADS, 2, HEAD_DIM, dtype=DTYPE, device=dev)
    scale = None
    if fp8:
        summaries, scale = quantize_rows(summaries)
    tables = torch.randperm(n * m, device=dev).to(torch.int32).view(n, m)
    num_blocks = torch.full((n,), m, dtype=torch.int32, device=dev)
    q = torch.randn(n, NUM_Q_HEADS, HEAD_DIM, dtype=DTYPE, device=dev)
    out = torch.empty(n, NUM_KV_HEADS, m, dtype=torch.float32, device=dev)
    read = summaries.numel() * summaries.element_size() + (0 if scale is None else
                                                          scale.numel() * 4)
    print(f"block_scores: {n} rows x {m} blocks, {NUM_KV_HEADS} kv heads, "
          f"{'FP8' if fp8 else 'bf16'} summaries "
          f"({read / 1e9:.2f} GB per layer), on {torch.cuda.get_device_name()}")
    print(f"{'blocks':>6} {'tiles':>5} {'warps':>5} {'stages':>6} {'ms':>8} {'GB/s':>7}")
    rows = []
    default = (scan._BLOCK_B, scan._TILES, scan._NUM_WARPS, scan._NUM_STAGES)
    for config in SCORE_CONFIGS:
        block_b, tiles, warps, stages = config
        ms = _graph_median_ms(lambda: scan.block_scores(
            q, summaries, tables, num_blocks, 1.0, out=out, summary_scale=scale, block_b=block_b,
            tiles=tiles, num_warps=warps, num_stages=stages))
        rows.append({"block_b": block_b, "tiles": tiles, "num_warps": warps,
                     "num_stages": stages, "ms": ms, "gbps": read / ms / 1e6})
        mark = " (default)" if config == default else ""
        print(f"{block_b:>6} {tiles:>5} {warps:>5} {stages:>6} {ms:>8.4f} "
              f"{read / ms / 1e6:>7.0f}{mark}", flush=True)
    return {"bench": "block_scores", "rows": n, "blocks": m, "results": rows}


SELECT_ROWS, SELECT_K, SELECT_CAP = 128, 128, 7  # 128 x 32K, K = 128, f = 0.05
STORE_TOKENS = (46, 128, 8192)  # dense FP8's 32K decode batch, the tiered one, a prefill chunk


def bench_store() -> dict:
    """``store_kv`` (one layer's K and V rows of STORE_TOKENS tokens, bf16 in, 8 kv heads x
    HEAD_DIM) into a paged cache of 32-token blocks, slots in random order, for each storage
    dtype (bf16, e4m3 with the searched scale, int8); the 8-bit ones also with each row copied
    to an open block (``+open``: in the same launch; ``+open x2``: a second launch), and into a
    pinned host cache, V in token order (``host``, the tiered host store's) or in the V layout
    (``host, V layout``: each V row D one-byte writes across PCIe), and into both the host cache
    and the device cache in one launch (``host+local``: tiered decode's store)."""
    from oasiskv.kernels.fp8 import FP8, INT8, empty_kv
    from oasiskv.kernels.store_kv import store_kv
    dev, block = torch.device("cuda"), 32
    print(f"store_kv: {NUM_KV_HEADS} kv heads x {HEAD_DIM}, bf16 in, {block}-token blocks, on "
          f"{torch.cuda.get_device_name()}")
    print(f"{'tokens':>6} {'dtype':>22} {'us':>9}")
    rows = []
    for tokens in STORE_TOKENS:
        k, v = (torch.randn(tokens, NUM_KV_HEADS, HEAD_DIM, dtype=DTYPE, device=dev)
                for _ in range(2))
        blocks = -(-tokens // block)
        slots = torch.randperm(blocks * block, device=dev)[:tokens]
        open_k, open_v = (torch.empty((tokens, NUM_KV_HEADS, block, HEAD_DIM), dtype=DTYPE,
                                      device=dev) for _ in range(2))
        open_rows = torch.arange(tokens, device=dev) * block
        for kv in (DTYPE, FP8, INT8):
            k_cache, v_cache, scales = empty_kv((blocks, NUM_KV_HEADS, block, HEAD_DIM), kv, dev)
            runs = {"": lambda: store_kv(k, v, k_cache, v_cache, slots, scales)}
            if kv != DTYPE:  # with each row's copy into its open block: in the launch, or a second
                runs["+open"] = lambda: store_kv(k, v, k_cache, v_cache, slots, scales,
                                                 open_block=(open_k, open_v, open_rows))
                runs["+open x2"] = lambda: (store_kv(k, v, k_cache, v_cache, slots, scales),
                                            store_kv(k, v, open_k, open_v, open_rows))
                host_k, host_v, host_scales = (
                    x.pin_memory() if torch.is_tensor(x) else tuple(s.pin_memory() for s in x)
                    for x in empty_kv((blocks, NUM_KV_HEADS, block, HEAD_DIM), kv))
                for label, v_layout in (("host", False), ("host, V layout", True)):
                    runs[f" {label}"] = functools.partial(store_kv, k, v, host_k, host_v, slots,
                                                          host_scales, v_layout=v_layout)
                runs[" host+local"] = functools.partial(  # (tiered decode: the local blocks too)
                    store_kv, k, v, host_k, host_v, slots, host_scales, v_layout=False,
                    mirror=(k_cache, v_cache, slots, scales))
            for label, fn in runs.items():
                us = 1e3 * _graph_median_ms(fn)
                name = str(kv).removeprefix("torch.") + label
                rows.append({"tokens": tokens, "dtype": name, "us": us})
                print(f"{tokens:>6} {name:>22} {us:>9.1f}", flush=True)
    return {"bench": "store_kv", "results": rows}


def bench_sparse(kv: torch.dtype | None) -> dict:
    """``sparse_decode_attention`` launch configs over one layer's working sets of SELECT_ROWS
    sequences (SELECT_K + 1 slots each, all held) with a draft row each; 8-bit ``kv``: with
    open blocks."""
    from oasiskv.kernels.fp8 import OpenBlocks, quantize_rows
    from oasiskv.kernels.paged_decode import launch_config
    from oasiskv.kernels.sparse_decode import sparse_decode_attention

    dev, n, slots = torch.device("cuda"), SELECT_ROWS, SELECT_K + 1
    shape = (n + 1, NUM_KV_HEADS, slots, BLOCK_SIZE, HEAD_DIM)  # (+ the padding rows' slot)
    ws, scales = [], []
    for _ in range(2):  # K, V (8-bit V in token order too: the tiered store's)
        x = torch.randn(shape, dtype=DTYPE, device=dev)
        values, scale = quantize_rows(x, kv) if kv is not None else (x, None)
        ws.append(values)
        scales.append(scale)
        del x
    ws_map = torch.arange(slots, dtype=torch.int32, device=dev).expand(shape[:3]).contiguous()
    seq_slots = torch.arange(n, dtype=torch.int32, device=dev)
    local_lens = torch.randint(1, BLOCK_SIZE + 1, (n,), dtype=torch.int32, device=dev)
    q = torch.randn(2 * n, NUM_Q_HEADS, HEAD_DIM, dtype=DTYPE, device=dev)
    extra = dict(draft_rows=torch.arange(n, 2 * n, dtype=torch.int32, device=dev),
                 extra_k=torch.randn(2 * n, NUM_KV_HEADS, HEAD_DIM, dtype=DTYPE, device=dev),
                 extra_v=torch.randn(2 * n, NUM_KV_HEADS, HEAD_DIM, dtype=DTYPE, device=dev))
    if kv is not None:
        extra["scales"] = tuple(scales)
        extra["open_block"] = OpenBlocks(*(torch.randn(shape[:2] + shape[3:], dtype=DTYPE,
                                                       device=dev) for _ in range(2)), seq_slots)
    out = torch.empty_like(q)
    read = n * NUM_KV_HEADS * slots * BLOCK_SIZE * 2 * (
        HEAD_DIM * ws[0].element_size() + (4 if kv is not None else 0))
    name = str(kv or DTYPE).removeprefix("torch.")
    print(f"sparse_decode_attention: {n} rows + {n} draft rows, K = {SELECT_K}, {name} working "
          f"sets ({read / 1e9:.2f} GB per layer), on {torch.cuda.get_device_name()}")
    print(f"{'tokens':>6} {'warps':>5} {'stages':>6} {'regs':>4} {'ms':>8} {'GB/s':>7}")
    rows, default = [], launch_config(None, kv is not None)
    for launch in LAUNCHES:
        ms = _launch_ms(lambda: sparse_decode_attention(
            q, *ws, ws_map, seq_slots, local_lens, HEAD_DIM ** -0.5, out=out, launch=launch,
            **extra), launch)
        if ms is None:
            continue
        rows.append({"launch": launch, "ms": ms, "gbps": read / ms / 1e6})
        mark = " (default)" if launch == default else ""
        print(f"{launch[0]:>6} {launch[1]:>5} {launch[2]:>6} {launch[3] or '-':>4} {ms:>8.4f} "
              f"{read / ms / 1e6:>7.0f}{mark}", flush=True)
    return {"bench": "sparse_decode_attention", "rows": n, "k": SELECT_K, "kv_cache_dtype": name,
            "results": rows}


def bench_select() -> dict:
    """``select_blocks`` (top-K, hits, capped admissions; one layer) at SELECT_ROWS rows x
    SCORE_BLOCKS blocks x 8 kv heads, half the slots filled, for each ``num_warps``. The timed graph
    restores the scores (the kernel's scratch) before each call; that copy is timed alone and
    subtracted."""
    from oasiskv.kernels.select_blocks import select_blocks
    dev = torch.device("cuda")
    n, m, k, cap = SELECT_ROWS, SCORE_BLOCKS, SELECT_K, SELECT_CAP
    gen = torch.Generator(dev).manual_seed(0)
    pristine = torch.randn(n, NUM_KV_HEADS, m, device=dev, generator=gen)
    scores = pristine.clone()
    ws_map = torch.randint(0, m, (n, NUM_KV_HEADS, k + 1), device=dev, generator=gen,
                           dtype=torch.int32)
    ws_map[:, :, k // 2:] = -1
    ws_last = torch.randint(0, 50, (n, NUM_KV_HEADS, k), device=dev, generator=gen)
    slots = torch.arange(n, device=dev)
    tables = torch.randperm(n * m, device=dev).to(torch.int32).view(n, m)
    now, counters = torch.tensor(100, device=dev), torch.zeros(3, dtype=torch.long, device=dev)
    copy_ms = _graph_median_ms(lambda: scores.copy_(pristine))
    print(f"select_blocks: {n} rows x {m} blocks x {NUM_KV_HEADS} kv heads, K {k}, cap {cap}, "
          f"on {torch.cuda.get_device_name()} (score restore {copy_ms:.4f} ms, subtracted)")
    rows = []
    for warps in (1, 2, 4, 8):
        ms = _graph_median_ms(lambda: (scores.copy_(pristine), select_blocks(
            scores, ws_map, ws_last, slots, tables, k, cap, now, counters,
            num_warps=warps))) - copy_ms
        rows.append({"num_warps": warps, "ms": ms})
        print(f"num_warps {warps}: {ms:.4f} ms", flush=True)
    return {"bench": "select_blocks", "rows": n, "blocks": m, "k": k, "cap": cap,
            "results": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kv-cache-dtype", choices=("auto", "fp8", "int8"), default="auto")
    parser.add_argument("--batches", default=",".join(map(str, BATCHES)))
    parser.add_argument("--contexts", default=",".join(map(str, CONTEXTS)))
    parser.add_argument("--scores", action="store_true", help="the summary-scan benchmark instead")
    parser.add_argument("--select", action="store_true",
                        help="the selection benchmark (select_blocks) instead")
    parser.add_argument("--summary-dtype", choices=("auto", "fp8"), default="auto",
                        help="--scores: summaries in the model's dtype (bf16) or FP8")
    parser.add_argument("--store", action="store_true",
                        help="the KV store benchmark (store_kv, each storage dtype) instead")
    parser.add_argument("--sparse", action="store_true",
                        help="the sparse decode benchmark (its launch configs) instead")
    parser.add_argument("--sweep-splits", action="store_true",
                        help="sweep forced split counts at every point (else at 16K only)")
    parser.add_argument("--open-block", action="store_true",
                        help="8-bit caches: each row's last block from an open block in bf16")
    parser.add_argument("--block-size", type=int, default=BLOCK_SIZE,
                        help="tokens per KV block of the paged benchmark")
    parser.add_argument("--sweep-launch", action="store_true",
                        help="also time each launch config in LAUNCHES at the first point")
    args = parser.parse_args()
    from oasiskv.kernels.fp8 import storage_dtype
    if not torch.cuda.is_available():
        sys.exit("oasiskv.bench.kernels needs a CUDA GPU (torch.cuda.is_available() is False)")
    if args.scores:
        print(json.dumps(bench_scores(args.summary_dtype == "fp8")))
        return
    if args.select:
        print(json.dumps(bench_select()))
        return
    if args.store:
        print(json.dumps(bench_store()))
        return
    kv = storage_dtype(args.kv_cache_dtype, DTYPE)
    kv = kv if kv != DTYPE else None
    if args.sparse:
        print(json.dumps(bench_sparse(kv)))
        return
    rows = []
    print(f"paged_decode_attention: {NUM_Q_HEADS}q/{NUM_KV_HEADS}kv heads, head_dim {HEAD_DIM}, "
          f"bf16 q, {str(kv or DTYPE).removeprefix('torch.')} cache, block {args.block_size}, on "
          f"{torch.cuda.get_device_name()}")
    print(f"{'batch':>5} {'context':>7} {'splits':>6} {'ms':>8} {'GB/s':>7} {'best s':>6} "
          f"{'best GB/s':>9} {'sdpa ms':>8} {'sdpa GB/s':>9}")
    for batch in map(int, args.batches.split(",")):
        for context in map(int, args.contexts.split(",")):
            cache_bytes = (2 * batch * context * NUM_KV_HEADS * HEAD_DIM
                           * torch.finfo(DTYPE).bits // 8)
            if 2 * cache_bytes > _MAX_BYTES:
                continue
            r = _bench_one(batch, context, kv, args.sweep_launch and not rows, args.block_size,
                           args.sweep_splits, args.open_block)
            rows.append(r)
            print(f"{batch:>5} {context:>7} {r['splits']:>6} {r['ms']:>8.4f} {r['gbps']:>7.0f} "
                  f"{str(r['best_splits'] or '-'):>6} {r['best_gbps']:>9.0f} {r['sdpa_ms']:>8.4f} "
                  f"{r['sdpa_gbps']:>9.0f}", flush=True)
            if args.sweep_splits:
                print("   splits: " + ", ".join(f"{s}: {t:.4f}" for s, t in r["split_ms"].items()))
            torch.cuda.empty_cache()
    print(f"measured wave: {rows[0]['wave'] if rows else None} programs resident at once")
    print(json.dumps({"bench": "paged_decode_attention", "num_q_heads": NUM_Q_HEADS,
                      "num_kv_heads": NUM_KV_HEADS, "head_dim": HEAD_DIM,
                      "kv_cache_dtype": args.kv_cache_dtype, "open_block": args.open_block,
                      "block_size": args.block_size, "device": torch.cuda.get_device_name(),
                      "results": rows}))


if __name__ == "__main__":
    main()
