"""``oasiskv bench``: decode throughput over context length x concurrency x output length.

For each point, ``concurrency`` requests with random prompt tokens of ``context`` length are
prefilled (not timed), then every decode step is timed. Reported per point: output tok/s, TPOT (ms
per decode step; also the median and the longest step, and in the JSON every step), mean running
batch, KV bytes read per step, achieved bytes/s (weights + KV per step over step time) and its ratio
to the measured device copy bandwidth (the roofline). In oasis mode also host->HBM bytes/s over
PCIe, how full the fetch cap ran (admitted blocks over what the cap allows; random weights at long
context fill it: every head misses its whole cap, the worst case) and the foreground stall per step:
time the decode stream waited for prefetch (async) or spent selecting and fetching (synchronous
retrieval, inline), timed on the device by clock marks (graph replays included; the marks add two
one-program kernels per layer). What the side stages cost the foreground by sharing the GPU is not
stall: that is TPOT with ``--prefetch async`` minus TPOT with ``--prefetch off``. With
``--emulated-host-gib`` requests share physical host blocks (a benchmark-only capacity emulation):
every such point is labelled EMULATED in the table and the JSON. With ``--engine hf`` transformers'
``generate`` runs the same points in the same process as a baseline.
Prints a table, writes an optional PNG, and ends with one JSON line.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field

import torch
from tqdm import tqdm

from oasiskv.bench.harness import emulated_label, make_engine
from oasiskv.bench.roofline import kv_read_bytes, measure_copy_bandwidth, weight_bytes
from oasiskv.config import EngineConfig
from oasiskv.engine.llm_engine import LLMEngine
from oasiskv.kv.allocator import TieredAllocator
from oasiskv.sampling_params import SamplingParams


@dataclass
class Point:
    engine: str
    context: int
    concurrency: int
    output_len: int
    batch: float = 0.0
    tok_s: float = 0.0
    tpot_ms: float = 0.0
    step_p50_ms: float = 0.0  # the median and the longest decode step (TPOT is their mean)
    step_max_ms: float = 0.0
    kv_gb_per_step: float = 0.0
    pcie_gb_s: float = 0.0
    stall_ms: float | None = None
    cap_fill: float | None = None  # tiered: admitted blocks / what the fetch cap allows
    achieved_gb_s: float = 0.0
    roofline: float = 0.0
    note: str = ""
    step_ms: list[float] = field(default_factory=list)  # every decode step, in order (the JSON's)


def _ints(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def add_bench_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=None,
                        help="bench preset (qwen3-8b, qwen3-32b, llama-3.1-8b, qwen3-30b-a3b, "
                             "qwen3-tiny, qwen3-moe-tiny) with "
                             "random weights, or a checkpoint folder; default: qwen3-8b with a "
                             "GPU, qwen3-tiny without")
    parser.add_argument("--context-lens", default=None,
                        help="prompt lengths, comma separated; default: 16384,32768 with a GPU, "
                             "256,512 without")
    parser.add_argument("--concurrency", default="1,8,max",
                        help="requests per point; 'max' = the most that fit in the KV pool")
    parser.add_argument("--output-lens", default="128", help="generated tokens per request")
    parser.add_argument("--engine", default="oasiskv", help="oasiskv, hf, or oasiskv,hf")
    parser.add_argument("--hf-max-batch", type=int, default=8,
                        help="largest batch given to the hf baseline "
                             "(concurrency above it is capped)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--kv-cache-dtype", default="auto",
                        help="K/V storage (pool, host store, working sets): auto, fp8 or int8")
    parser.add_argument("--kv-open-block", default="model",
                        help="with 8-bit K/V (dense and oasis): each sequence's open block also "
                             "in the model's dtype (model) or not (kv)")
    parser.add_argument("--summary-dtype", default="auto",
                        help="oasis: block summaries in HBM: auto (as the KV cache), fp8 or "
                             "model (the model's dtype)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.92)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="ranks the model is split over (dense KV only)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=32768,
                        help="prefill tokens per step; >= the context avoids chunking")
    parser.add_argument("--num-kv-blocks", type=int, default=0)
    parser.add_argument("--block-size", type=int, default=0,
                        help="tokens per KV block; 0 = the engine's default for the KV mode and "
                             "dtype")
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                        help="launch each decode step before the last one's tokens are read "
                             "(dense KV)")
    parser.add_argument("--kv-mode", default="dense", help="dense or oasis (tiered KV)")
    parser.add_argument("--topk-blocks", type=int, default=128, help="oasis: K")
    parser.add_argument("--fetch-ratio", type=float, default=0.05, help="oasis: f_HBM")
    parser.add_argument("--host-kv-gib", type=float, default=0.0,
                        help="oasis: host store GiB (0 = 4)")
    parser.add_argument("--draft", default="none",
                        help="oasis: none = synchronous retrieval; previous, "
                        "ngram, model:PATH, eagle3:PATH = lookahead")
    parser.add_argument("--prefetch", default="async", help="oasis lookahead: async, inline or off")
    parser.add_argument("--guardrail-rate", type=float, default=0.0,
                        help="oasis: share of decode rows the online guardrail measures")
    parser.add_argument("--emulated-host-gib", type=float, default=0.0,
                        help="oasis, BENCHMARK ONLY: admit as if the host store held this many "
                             "GiB; requests share the physical host blocks (--host-kv-gib) so "
                             "PCIe traffic is real, contents not")
    parser.add_argument("--plot", default=None, help="write a PNG of tok/s per point here")
    parser.add_argument("--seed", type=int, default=0)


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The engine configuration the bench flags describe (also used by
    ``scripts/profile_decode.py``)."""
    contexts = [int(c) for c in _ints(args.context_lens)]
    outputs = [int(o) for o in _ints(args.output_lens)]
    from oasiskv.models.loader import preset_names
    load_format = "dummy" if args.model in preset_names() else "auto"
    return EngineConfig.from_flat(
        model=args.model, dtype=args.dtype, device=args.device, load_format=load_format,
        max_model_len=max(contexts) + max(outputs) + 1,
        gpu_memory_utilization=args.gpu_memory_utilization, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, num_kv_blocks=args.num_kv_blocks,
        block_size=args.block_size, enforce_eager=args.enforce_eager,
        async_scheduling=args.async_scheduling,
        max_graph_batch=args.max_num_seqs, kv_mode=args.kv_mode,
        kv_cache_dtype=args.kv_cache_dtype, tensor_parallel_size=args.tensor_parallel_size,
        topk_blocks=args.topk_blocks, fetch_ratio=args.fetch_ratio, host_kv_gib=args.host_kv_gib,
        draft=args.draft, prefetch=args.prefetch, guardrail_rate=args.guardrail_rate,
        summary_dtype=args.summary_dtype, kv_open_block=args.kv_open_block)


def fit_defaults(args: argparse.Namespace) -> None:
    """Fill the model and context lengths left unset for the device, and refuse at once (ValueError
    with the reason) a random-weight preset whose weights this machine's memory cannot hold."""
    from oasiskv.engine.model_runner import resolve_device
    cuda = resolve_device(args.device).type == "cuda"
    if args.model is None:
        args.model = "qwen3-8b" if cuda else "qwen3-tiny"
    if args.context_lens is None:
        args.context_lens = "16384,32768" if cuda else "256,512"
    from oasiskv.models.loader import preset_names
    if cuda or args.model not in preset_names():
        return
    from oasiskv.config import ModelConfig
    from oasiskv.models.loader import resolve_model_path
    cfg = ModelConfig.from_file(resolve_model_path(args.model) / "config.json")
    params = cfg.num_parameters()
    need = 4 * params  # float32 on a CPU
    ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if need > 0.8 * ram:
        raise ValueError(f"{args.model} has {params / 1e9:.1f}B parameters: {need / 2**30:.0f} GiB "
                         f"of float32 weights on this CPU ({ram / 2**30:.0f} GiB of RAM); bench "
                         f"qwen3-tiny here, or qwen3-8b on a GPU")


def run_from_args(args: argparse.Namespace) -> int:
    fit_defaults(args)
    contexts = [int(c) for c in _ints(args.context_lens)]
    outputs = [int(o) for o in _ints(args.output_lens)]
    concurrencies = _ints(args.concurrency)
    engines = _ints(args.engine)
    config = config_from_args(args)
    points: list[Point] = []
    env = {}
    if "oasiskv" in engines:
        engine = make_engine(config, args.emulated_host_gib)
        env = _environment(engine)
        grid = [(c, n, o) for c in contexts for n in concurrencies for o in outputs]
        for ctx, conc, out in tqdm(grid, desc="oasiskv bench", file=sys.stderr):
            points.append(bench_point(engine, ctx, conc, out, env, args.seed))
        hf_model_path, dtype, device = engine.model_path, engine.runner.dtype, engine.runner.device
        engine.close()
        del engine
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    else:
        from oasiskv.config import ModelConfig
        from oasiskv.engine.model_runner import resolve_device, resolve_dtype
        from oasiskv.models.loader import resolve_model_path
        hf_model_path = resolve_model_path(args.model)
        device = resolve_device(args.device)
        dtype = resolve_dtype(args.dtype, ModelConfig.from_file(hf_model_path / "config.json"),
                              device)
    if "hf" in engines:
        from oasiskv.bench.hf_baseline import bench_hf
        env.setdefault("copy_gb_s", measure_copy_bandwidth(device) / 1e9)
        batches = sorted({min(args.hf_max_batch, int(c)) if c != "max" else args.hf_max_batch
                          for c in concurrencies})
        for ctx in contexts:
            for batch in batches:
                for out in outputs:
                    points.append(bench_hf(hf_model_path, config.load_format == "dummy", dtype,
                                           device, ctx, batch, out, env["copy_gb_s"], args.seed))
    print_table(points, env)
    if args.plot:
        plot(points, args.plot)
    print(json.dumps({"environment": env, "model": args.model,
                      "points": [asdict(p) for p in points]}))
    return 0


def _environment(engine: LLMEngine) -> dict:
    device = engine.runner.device
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": str(engine.runner.dtype).removeprefix("torch."),
        "copy_gb_s": measure_copy_bandwidth(device) / 1e9,
        "weights_gb": weight_bytes(engine.runner.model) / 1e9,
        "kv_pool_tokens": engine.allocator.num_total_blocks * engine.config.block_size,
        "cuda_graphs": engine.runner.graphs is not None,
        "emulated_host": emulated_label(engine),
        "torch": torch.__version__,
    }


def _label(engine: LLMEngine) -> str:
    c = engine.config
    kv = "" if c.kv_cache_dtype == "auto" else "-" + c.kv_cache_dtype
    if c.kv_mode == "dense":
        return "oasiskv" + kv + ("" if engine.steps_ahead else "-sync")
    t = c.tier
    if t.lookahead:
        mode = f"{t.draft.partition(':')[0]}-{t.prefetch}"
    else:  # synchronous retrieval selects in line whatever --prefetch says, unless it is off
        mode = "sync-off" if t.prefetch == "off" else "sync"
    guard = f"-guard{t.guardrail_rate:g}" if t.guardrail_rate else ""
    kv += "-fp8sum" if c.fp8_summaries else ""
    return (f"oasis-K{t.topk_blocks}-{mode}{kv}{guard}"
            + ("-EMULATED" if emulated_label(engine) else ""))


def concurrency_limits(engine: LLMEngine, context: int, output_len: int) -> dict[str, int]:
    """How many requests of ``context + output_len`` tokens each bound lets run at once: the KV
    blocks (the HBM pool, or a tiered engine's host store), ``--max-num-seqs`` and, tiered, the
    HBM working-set slots."""
    per_request = -(-(context + output_len) // engine.config.block_size)
    limits = {"KV blocks": engine.allocator.num_total_blocks // per_request,
              "--max-num-seqs": engine.config.max_num_seqs}
    if isinstance(engine.allocator, TieredAllocator):
        limits["working-set slots"] = engine.allocator.num_seq_slots
    return limits


def bench_point(engine: LLMEngine, context: int, concurrency: str, output_len: int, env: dict,
                seed: int) -> Point:
    limits = concurrency_limits(engine, context, output_len)
    bound = min(limits, key=limits.get)
    most = max(1, limits[bound])
    n = most if concurrency == "max" else int(concurrency)
    point = Point(_label(engine), context, n, output_len)
    if n > most:
        point.note = f"does not fit: {bound} allow {limits[bound]} requests"
        return point
    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    for _ in range(n):
        engine.add_request([rng.randrange(1, vocab) for _ in range(context)], params)
    steps, seconds, batch_sum, kv_bytes, fetched, stall, timed = 0, 0.0, 0, 0, 0, 0.0, 0
    durations = []
    admitted = allowed = 0
    while engine.has_unfinished():
        lens = [len(seq) for seq in engine.scheduler.running]  # what a decode step attends to
        t0 = time.perf_counter()
        engine.step()
        dt = time.perf_counter() - t0
        s = engine.stats
        if not s.last_step_prefill:
            steps, seconds, batch_sum = steps + 1, seconds + dt, batch_sum + s.last_batch_size
            durations.append(dt)
            kv_bytes += kv_read_bytes(engine, lens)
            fetched += s.kv.get("fetched_bytes", 0)
            admitted += s.kv.get("fetched_blocks", 0)
            allowed += s.kv.get("cap_slots", 0)
            if "stall_seconds" in s.kv_samples:  # the tier's device clock (seeding is no stall)
                stall, timed = stall + s.kv_samples["stall_seconds"][0], timed + 1
    if steps:
        point.batch = batch_sum / steps
        point.tok_s = batch_sum / seconds
        point.tpot_ms = 1e3 * seconds / steps
        point.step_p50_ms = 1e3 * sorted(durations)[len(durations) // 2]
        point.step_max_ms = 1e3 * max(durations)
        point.step_ms = [round(1e3 * d, 2) for d in durations]
        point.kv_gb_per_step = kv_bytes / steps / 1e9
        weights = weight_bytes(engine.runner.model, round(point.batch)) / 1e9  # MoE: routed only
        point.achieved_gb_s = (weights + point.kv_gb_per_step) / (seconds / steps)
        point.roofline = point.achieved_gb_s / env["copy_gb_s"]
        point.pcie_gb_s = fetched / seconds / 1e9
        point.cap_fill = admitted / allowed if allowed else None
        point.stall_ms = 1e3 * stall / timed if timed else None
    notes = ([f"{engine.stats.num_preemptions} preemptions so far"]
             if engine.stats.num_preemptions else [])
    emulated = emulated_label(engine)
    point.note = "; ".join(notes + ([emulated] if emulated else []))
    return point


def print_table(points: list[Point], env: dict) -> None:
    print(f"\ndevice={env.get('device')} dtype={env.get('dtype')} "
          f"copy_bw={env.get('copy_gb_s', 0):.0f} GB/s "
          f"weights={env.get('weights_gb', 0):.2f} GB kv_pool_tokens={env.get('kv_pool_tokens')} "
          f"cuda_graphs={env.get('cuda_graphs')}")
    if env.get("emulated_host"):
        print(f"*** {env['emulated_host']}: requests share physical host blocks "
              f"(capacity emulation, benchmark only)")
    head = f"{'engine':30} {'ctx':>6} {'conc':>5} {'out':>5} {'batch':>6} {'tok/s':>9} " \
           f"{'TPOT ms':>8} {'KV GB/step':>10} {'GB/s':>8} {'roofline':>8} {'PCIe GB/s':>9} " \
           f"{'stall ms':>8} {'cap fill':>8} {'p50 ms':>7} {'max ms':>7}  note"
    print(head)
    print("-" * len(head))
    for p in points:
        print(f"{p.engine:30} {p.context:6d} {p.concurrency:5d} {p.output_len:5d} {p.batch:6.1f} "
              f"{p.tok_s:9.1f} {p.tpot_ms:8.2f} {p.kv_gb_per_step:10.2f} {p.achieved_gb_s:8.0f} "
              f"{p.roofline:8.2f} {p.pcie_gb_s:9.2f} {_opt(p.stall_ms):>8} {_opt(p.cap_fill):>8} "
              f"{p.step_p50_ms:7.2f} {p.step_max_ms:7.2f}  {p.note}")


def _opt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def plot(points: list[Point], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    for key in sorted({(p.engine, p.context) for p in points}):
        sel = [p for p in points if (p.engine, p.context) == key and p.tok_s]
        ax.plot([p.concurrency for p in sel], [p.tok_s for p in sel], marker="o",
                label=f"{key[0]} ctx={key[1]}")
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("decode tok/s")
    ax.set_xscale("log", base=2)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
