"""Host -> HBM gather bandwidth of ``gather_blocks`` reading pinned memory through UVA, and how well
it overlaps model kernels on another stream (GPU only).

Run ``python -m oasiskv.bench.uva_gather``. Conditions: a 2 GiB pinned host store in the tiered
layout ``[num_host_blocks, num_layers, Hk, B, D]`` per K and V (bf16, Hk 8, B 16, D 128: 4 KiB per
slice), one gather of 65,536 random slices (32,768 random (block, kv head) items of one layer, K and
V each) into a working set. Swept: the grid bound ``num_programs``, ``items_per_iter`` (items in
flight per program), and the side stream's priority (normal or high), plus one program per item for
contrast. Times are medians of CUDA-event timings. GB/s counts bytes read from the host; they are
printed next to the PCIe Gen5 x16 limit (~55 GB/s for one large cudaMemcpy on the H200 here) and
next to a large pinned -> device ``copy_`` measured in the same run.

Overlap, against two foregrounds on the current stream, each sized to about the gather's time:
``mm`` (4096^2 bf16 matmuls: compute bound, all SMs) and ``decode`` (a 128-row bf16 linear layer
over a 4096 x 28672 weight, like a decode step's MLP: memory bound); the gather alone on a side
stream, and both launched together; overlap = (fg + gather - both) / min(fg, gather), 1 = fully
hidden, 0 = serial, negative = worse than serial. Then the same with cuBLAS told to leave SMs free
(``torch._C._set_sm_carveout_experimental``). Prints tables, then one JSON line. Expected about a
minute on an H200 (mostly pinning and filling the store).

``python -m oasiskv.bench.uva_gather --fp8``: bandwidth only, for FP8 slices (2 KiB of e4m3 values
plus 64 B of row scales each) from a store of the same byte size, over ``FP8_VARIANTS``.
"""
import json
import statistics
import sys

import torch

NUM_LAYERS, NUM_KV_HEADS, BLOCK_SIZE, HEAD_DIM = 4, 8, 16, 128
DTYPE = torch.bfloat16
HOST_GIB = 2.0            # K and V stores together
NUM_ITEMS = 32768         # (block, kv head) items per gather: 65,536 slices with K and V
# (num_programs, items_per_iter, side stream priority: 0 normal, -1 high)
VARIANTS = ((16, 1, 0), (32, 1, 0), (64, 1, 0), (132, 1, 0), (8, 4, 0), (16, 4, 0), (32, 4, 0),
            (8, 8, 0), (16, 4, -1), (32, 4, -1), (64, 1, -1))
# FP8 slices are half as large: more of them in flight keep the bytes in flight
FP8_VARIANTS = ((8, 4), (8, 8), (8, 16), (16, 4), (16, 8), (32, 4))
CARVEOUTS = (0, 16, 32)
PCIE_LIMIT_GBPS = 55.0    # one large cudaMemcpy, PCIe Gen5 x16 (docs: DESIGN section 3.7)
REPS = 10


def _median_ms(fn, stream: torch.cuda.Stream, reps: int = REPS) -> float:
    """Median over ``reps`` of ``fn`` timed with CUDA events on ``stream`` (one warm-up call
    first)."""
    with torch.cuda.stream(stream):
        fn()
        times = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            fn()
            end.record(stream)
            times.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in times)


def _together_ms(foreground, background, side: torch.cuda.Stream, reps: int = REPS) -> float:
    """Median time from launching ``background`` on ``side`` and ``foreground`` on the current
    stream until both are done."""
    main = torch.cuda.current_stream()
    times = []
    for _ in range(reps + 1):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(main)
        side.wait_event(start)
        with torch.cuda.stream(side):
            background()
        foreground()
        main.wait_stream(side)
        end.record(main)
        times.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in times[1:])


def _host_store():
    per_block = NUM_LAYERS * NUM_KV_HEADS * BLOCK_SIZE * HEAD_DIM * DTYPE.itemsize
    num_blocks = int(HOST_GIB * 2**30 / 2 / per_block)
    shape = (num_blocks, NUM_LAYERS, NUM_KV_HEADS, BLOCK_SIZE, HEAD_DIM)
    host_k = torch.empty(shape, dtype=DTYPE, pin_memory=True)
    host_v = torch.empty(shape, dtype=DTYPE, pin_memory=True)
    for host in (host_k, host_v):  # finite bf16 bit patterns in [0, 2): no NaN, exact to compare
        host.view(torch.int16).random_(0, 0x4000)
    return host_k, host_v


def fp8_bandwidth() -> None:
    """GB/s of FP8 gathers (values and scales) for each of FP8_VARIANTS."""
    from oasiskv.kernels.fp8 import FP8
    from oasiskv.kernels.uva_gather import gather_blocks

    dev, gen = torch.device("cuda"), torch.Generator().manual_seed(0)
    per_block = NUM_LAYERS * NUM_KV_HEADS * BLOCK_SIZE * HEAD_DIM
    shape = (int(HOST_GIB * 2**30 / 2 / per_block), NUM_LAYERS, NUM_KV_HEADS, BLOCK_SIZE, HEAD_DIM)
    host = [torch.empty(shape, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
    for h in host:
        h.random_(0, 0x70)  # finite e4m3 bit patterns
    host = [h.view(FP8) for h in host]
    host_scales = [torch.rand(shape[:-1], pin_memory=True) for _ in range(2)]
    num_seqs = -(-NUM_ITEMS // (NUM_KV_HEADS * 129))
    ws_shape = (num_seqs, NUM_KV_HEADS, 129, BLOCK_SIZE, HEAD_DIM)
    ws = [torch.zeros(ws_shape, dtype=torch.uint8, device=dev).view(FP8) for _ in range(2)]
    ws_scales = [torch.zeros(ws_shape[:-1], device=dev) for _ in range(2)]
    src_block = torch.randint(shape[0], (NUM_ITEMS,), generator=gen, dtype=torch.int32).to(dev)
    src_head = torch.randint(NUM_KV_HEADS, (NUM_ITEMS,), generator=gen, dtype=torch.int32).to(dev)
    dst_slot = (torch.randperm(num_seqs * NUM_KV_HEADS * 129, generator=gen)[:NUM_ITEMS]
                .to(torch.int32).to(dev))
    moved = 2 * NUM_ITEMS * BLOCK_SIZE * (HEAD_DIM + 4)
    print(f"FP8 uva gather on {torch.cuda.get_device_name()}: {2 * NUM_ITEMS:,} slices x "
          f"{BLOCK_SIZE * (HEAD_DIM + 4)} B (values + scales) = {moved / 2**20:.0f} MiB per gather")
    print(f"{'programs':>8} {'items':>5} {'gather ms':>9} {'GB/s':>6}")
    rows = []
    for programs, items in FP8_VARIANTS:
        ms = _median_ms(lambda: gather_blocks(  # noqa: B023
            *host, 1, *ws, src_block, src_head, dst_slot, num_programs=programs,  # noqa: B023
            items_per_iter=items, scales=(*host_scales, *ws_scales)),
            torch.cuda.current_stream())
        rows.append({"programs": programs, "items": items, "ms": ms, "gbps": moved / ms / 1e6})
        print(f"{programs:>8} {items:>5} {ms:>9.3f} {moved / ms / 1e6:>6.1f}", flush=True)
    print(json.dumps({"bench": "uva_gather", "dtype": "fp8", "results": rows}))


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("oasiskv.bench.uva_gather needs a CUDA GPU (torch.cuda.is_available() is False)")
    if "--fp8" in sys.argv[1:]:
        fp8_bandwidth()
        return
    from oasiskv.kernels.uva_gather import gather_blocks

    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    host_k, host_v = _host_store()
    num_blocks, layer = host_k.shape[0], 1
    slots_per_seq = NUM_KV_HEADS * 129  # K = 128 resident slots + the local one
    num_seqs = -(-NUM_ITEMS // slots_per_seq)
    ws_shape = (num_seqs, NUM_KV_HEADS, 129, BLOCK_SIZE, HEAD_DIM)
    ws_k = torch.zeros(ws_shape, dtype=DTYPE, device=dev)
    ws_v = torch.zeros_like(ws_k)
    src_block = torch.randint(num_blocks, (NUM_ITEMS,), generator=gen, dtype=torch.int32).to(dev)
    src_head = torch.randint(NUM_KV_HEADS, (NUM_ITEMS,), generator=gen, dtype=torch.int32).to(dev)
    dst_slot = (torch.randperm(num_seqs * slots_per_seq, generator=gen)[:NUM_ITEMS]
                .to(torch.int32).to(dev))
    slice_bytes = BLOCK_SIZE * HEAD_DIM * DTYPE.itemsize
    moved = 2 * NUM_ITEMS * slice_bytes

    main_stream = torch.cuda.current_stream()
    big = torch.empty(host_k.shape, dtype=DTYPE, device=dev)
    copy_ms = _median_ms(lambda: big.copy_(host_k, non_blocking=True), main_stream,  # noqa: F821
                         reps=5)
    copy_gbps = host_k.numel() * host_k.element_size() / copy_ms / 1e6
    del big

    a = torch.randn(4096, 4096, device=dev, dtype=DTYPE)
    b, c = torch.randn_like(a), torch.empty_like(a)
    x = torch.randn(128, 4096, device=dev, dtype=DTYPE)
    w = torch.randn(28672, 4096, device=dev, dtype=DTYPE)
    y = torch.empty(128, 28672, device=dev, dtype=DTYPE)
    units = {"mm": lambda: torch.mm(a, b, out=c), "decode": lambda: torch.matmul(x, w.t(), out=y)}
    unit_ms = {name: _median_ms(unit, main_stream) for name, unit in units.items()}

    def gather(programs, items):
        return lambda: gather_blocks(host_k, host_v, layer, ws_k, ws_v, src_block, src_head,
                                     dst_slot, num_programs=programs, items_per_iter=items)

    def overlap(fg_name, fn, gather_ms, side):
        unit = units[fg_name]
        reps = max(1, round(gather_ms / unit_ms[fg_name]))
        foreground = lambda: [unit() for _ in range(reps)]  # noqa: E731
        fg_ms = _median_ms(foreground, main_stream)
        both_ms = _together_ms(foreground, fn, side)
        return fg_ms, both_ms, (fg_ms + gather_ms - both_ms) / min(fg_ms, gather_ms)

    name = torch.cuda.get_device_name()
    print(f"uva gather on {name}: {2 * NUM_ITEMS:,} random slices x {slice_bytes // 1024} KiB "
          f"({NUM_ITEMS:,} (block, kv head) items, K and V) = {moved / 2**20:.0f} MiB per gather; "
          f"host store {2 * host_k.numel() * host_k.element_size() / 2**30:.1f} GiB pinned, bf16, "
          f"Hk {NUM_KV_HEADS}, B {BLOCK_SIZE}, D {HEAD_DIM}")
    print(f"pinned -> device copy_ of {host_k.numel() * host_k.element_size() / 2**30:.1f} GiB: "
          f"{copy_gbps:.1f} GB/s (PCIe Gen5 x16 limit ~{PCIE_LIMIT_GBPS:.0f} GB/s)")
    print(f"{'programs':>8} {'items':>5} {'prio':>5} {'gather ms':>9} {'GB/s':>6} {'%PCIe':>6} "
          + " ".join(f"{f + ' fg/both ms':>17} {'overlap':>7}" for f in units))
    rows = []
    for programs, items, priority in VARIANTS + ((NUM_ITEMS, 1, 0),):
        side = torch.cuda.Stream(priority=priority)
        fn = gather(programs, items)
        ms = _median_ms(fn, side)
        gbps = moved / ms / 1e6
        row = {"num_programs": programs, "items_per_iter": items, "priority": priority,
               "gather_ms": ms, "gbps": gbps}
        cells = []
        for fg_name in units:
            fg_ms, both_ms, ov = overlap(fg_name, fn, ms, side)
            row[fg_name] = {"fg_ms": fg_ms, "both_ms": both_ms, "overlap": ov}
            cells.append(f"{fg_ms:>8.3f}/{both_ms:<8.3f} {ov:>7.2f}")
        rows.append(row)
        label = f"{programs}" if programs != NUM_ITEMS else f"{programs}*"
        print(f"{label:>8} {items:>5} {'high' if priority else 'norm':>5} {ms:>9.3f} {gbps:>6.1f} "
              f"{100 * gbps / PCIE_LIMIT_GBPS:>5.0f}% " + " ".join(cells), flush=True)
    print("* one program per item (the unbounded grid the persistent kernel replaces)")

    best = max(rows[:-1], key=lambda r: r["decode"]["overlap"])
    programs, items, priority = best["num_programs"], best["items_per_iter"], best["priority"]
    side = torch.cuda.Stream(priority=priority)
    fn = gather(programs, items)
    ms = _median_ms(fn, side)
    print(f"cuBLAS SM carve-out, gather {programs} programs x {items} items, "
          f"priority {priority}: fg/both ms, overlap")
    carve = []
    for carveout in CARVEOUTS:
        torch._C._set_sm_carveout_experimental(carveout or None)
        cells, entry = [], {"carveout": carveout}
        for fg_name in units:
            fg_ms, both_ms, ov = overlap(fg_name, fn, ms, side)
            entry[fg_name] = {"fg_ms": fg_ms, "both_ms": both_ms, "overlap": ov}
            cells.append(f"{fg_name} {fg_ms:.3f}/{both_ms:.3f} {ov:.2f}")
        carve.append(entry)
        print(f"  carve-out {carveout:>3} SMs: " + "   ".join(cells), flush=True)
    torch._C._set_sm_carveout_experimental(None)

    # The last gather's result must equal torch indexing of the host store (bit-exact).
    check = slice(0, 512)
    want = host_k[src_block[check].long().cpu(), layer, src_head[check].long().cpu()]
    got = ws_k.view(-1, BLOCK_SIZE, HEAD_DIM)[dst_slot[check].long()].cpu()
    correct = bool(torch.equal(got.view(torch.int16), want.view(torch.int16)))
    print(f"correct: {correct}")
    print(json.dumps({"bench": "uva_gather", "device": name, "dtype": "bfloat16",
                      "num_kv_heads": NUM_KV_HEADS, "block_size": BLOCK_SIZE, "head_dim": HEAD_DIM,
                      "slices": 2 * NUM_ITEMS, "bytes_per_gather": moved, "copy_gbps": copy_gbps,
                      "pcie_limit_gbps": PCIE_LIMIT_GBPS, "correct": correct, "results": rows,
                      "carveout": carve}))


if __name__ == "__main__":
    main()
