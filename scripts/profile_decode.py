"""Where a decode step's time goes: host wall time per step, and per CUDA stream the GPU busy time,
kernel count and top kernels, plus how much the streams run at the same time.

python scripts/profile_decode.py [oasiskv bench flags] [--profile-steps N] [--compare-prefetch-off]

Takes the ``oasiskv bench`` flags (exactly one context length and one concurrency; the output length
is set from the step counts), prefills that many requests (prompt token ids
``(7 i + j) mod 1000 + 1``, not the bench's random ones; with ``--shared-prompts`` every prompt is
the same but for its last block, so the prefix cache prefills it once: host work per step is the
same, the decode kernels read one shared prefix), runs 3 warm-up decode steps, times
``--timed-steps`` decode steps on the host clock, then records ``--profile-steps`` steps with
torch.profiler (CUPTI also sees kernels inside CUDA graph replays) and reads the trace: per stream,
busy time (union of kernel intervals) per step; "overlapping" is the time at least two streams run
kernels; "idle" is the time inside the kernel window no kernel runs (mostly host work between
steps). Also: the time graph replays spent in their device-side waits for the previous step's
lookahead copies (the foreground stall), memory copies (count, time, longest) and the CUDA runtime
calls the host spent most time in. With ``--compare-prefetch-off`` the same requests then run with
``prefetch=off`` (graphs recaptured when there are any): for lookahead, step t+1's selection and
fetch are skipped, the foreground-only baseline; for synchronous retrieval selection stops
altogether. GPU only; random weights.
"""
import argparse
import cProfile
import json
import os
import pstats
import sys
import tempfile
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from oasiskv.bench.decode_sweep import add_bench_flags, config_from_args, fit_defaults
from oasiskv.bench.harness import make_engine
from oasiskv.engine.llm_engine import LLMEngine
from oasiskv.sampling_params import SamplingParams


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e) for s, e in merged]


def _length(intervals) -> float:
    return sum(e - s for s, e in intervals)


def _intersect(a, b) -> list[tuple[float, float]]:
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        s, e = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if s < e:
            out.append((s, e))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def analyse(trace_path: str, steps: int, top: int) -> dict:
    """Per-stream kernel time per step from a chrome trace (microseconds in, milliseconds out)."""
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel" and "dur" in e]
    if not kernels:
        return {"error": "no kernel events in the trace"}
    by_stream: dict[str, list] = defaultdict(list)
    for e in kernels:
        by_stream[str(e.get("tid"))].append(e)
    busy = {s: _union([(e["ts"], e["ts"] + e["dur"]) for e in evs]) for s, evs in by_stream.items()}
    window = (min(e["ts"] for e in kernels), max(e["ts"] + e["dur"] for e in kernels))
    any_busy = _union([iv for ivs in busy.values() for iv in ivs])
    overlap = []
    streams = list(busy)
    for i, a in enumerate(streams):
        for b in streams[i + 1:]:
            overlap += _intersect(busy[a], busy[b])
    copies = [e for e in events if e.get("cat") == "gpu_memcpy" and "dur" in e]
    host_calls: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0])  # total, longest, count
    for e in events:
        if e.get("cat") == "cuda_runtime" and "dur" in e:
            total = host_calls[e["name"]]
            total[0], total[1], total[2] = (total[0] + e["dur"], max(total[1], e["dur"]),
                                            total[2] + 1)
    # captured steps' waits for copies
    waits = [e["dur"] for e in kernels if e["name"] == "_wait_kernel"]
    result = {"copy_waits_ms_per_step": sum(waits) / steps / 1e3,
              "memcpy": {"per_step": len(copies) / steps,
                         "ms_per_step": sum(e["dur"] for e in copies) / steps / 1e3,
                         "longest_ms": max((e["dur"] for e in copies), default=0) / 1e3},
              "host_calls": [(n, t / steps / 1e3, m / 1e3, c / steps) for n, (t, m, c) in
                             sorted(host_calls.items(), key=lambda kv: -kv[1][0])[:5]],
              "window_ms_per_step": (window[1] - window[0]) / steps / 1e3,
              "gpu_busy_ms_per_step": _length(any_busy) / steps / 1e3,
              "overlap_ms_per_step": _length(_union(overlap)) / steps / 1e3, "streams": {}}
    for s, evs in sorted(by_stream.items(), key=lambda kv: -_length(busy[kv[0]])):
        names: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
        for e in evs:
            names[e["name"]][0] += e["dur"]
            names[e["name"]][1] += 1
        ranked = sorted(names.items(), key=lambda kv: -kv[1][0])[:top]
        frequent = sorted(names.items(), key=lambda kv: -kv[1][1])[:top]
        result["streams"][s] = {
            "busy_ms_per_step": _length(busy[s]) / steps / 1e3,
            "kernels_per_step": len(evs) / steps,
            "top": [(n[:70], t / steps / 1e3, c / steps) for n, (t, c) in ranked],
            "frequent": [(n[:70], t / steps / 1e3, c / steps) for n, (t, c) in frequent]}
    return result


def report(title: str, wall_ms: float, stats: dict) -> None:
    print(f"== {title}: host wall {wall_ms:.2f} ms/step")
    if "error" in stats:
        print(stats["error"])
        return
    idle = stats["window_ms_per_step"] - stats["gpu_busy_ms_per_step"]
    print(f"   kernel window {stats['window_ms_per_step']:.2f} ms/step, "
          f"GPU busy {stats['gpu_busy_ms_per_step']:.2f}, "
          f"idle {idle:.2f}, streams overlapping {stats['overlap_ms_per_step']:.2f}")
    print(f"   foreground waiting for lookahead copies (wait_ready kernels): "
          f"{stats['copy_waits_ms_per_step']:.2f} ms/step")
    m = stats["memcpy"]
    print(f"   memcpy: {m['per_step']:.0f}/step, {m['ms_per_step']:.2f} ms/step, "
          f"longest {m['longest_ms']:.2f} ms")
    for name, ms, longest, count in stats["host_calls"]:
        print(f"   host {name}: {ms:.2f} ms/step (x{count:.0f}, longest {longest:.2f} ms)")
    for stream, s in stats["streams"].items():
        print(f"   {stream}: busy {s['busy_ms_per_step']:.2f} ms/step, "
              f"{s['kernels_per_step']:.0f} kernels/step")
        for name, ms, count in s["top"]:
            print(f"      {ms:7.3f} ms  x{count:<5.0f} {name}")
        print("      most launched:")
        for name, ms, count in s["frequent"]:
            print(f"      {ms:7.3f} ms  x{count:<5.0f} {name}")


def host_profile(engine: LLMEngine, steps: int, top: int) -> None:
    """cProfile over ``steps`` more steps: the Python functions the host spends most time in
    (their own time, ms per step; ``cudaGraphLaunch`` and waits for the GPU show up as the
    built-in calls that make them)."""
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    profiler.disable()
    stats = pstats.Stats(profiler)
    rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:top]
    print(f"   host, Python functions by own time (ms/step, {steps} steps under cProfile):")
    for (path, line, name), (_, calls, own, total, _) in rows:
        print(f"      {own / steps * 1e3:7.3f} own {total / steps * 1e3:7.3f} total "
              f"x{calls / steps:<6.0f} {os.path.basename(path)}:{line} {name}")


#: the host's stages of a step, timed by wrapping these methods (owner path from the engine, name;
#: one the engine lacks is left out, so that an older tree can be timed too)
HOST_STAGES = [("runner", "held_back"), ("scheduler", "schedule"), ("runner", "_prepare"),
               ("runner", "_rows"), ("runner.backend", "prepare"), ("runner", "_upload"),
               ("runner.block_tables", "build"), ("runner.block_tables", "fill"),
               ("runner.graphs", "run"), ("runner.backend", "during_step"),
               ("runner", "launch"), ("runner", "collect"), ("scheduler", "postprocess"),
               ("runner", "finish"), ("runner.backend.lookahead", "advance"),
               ("runner.backend.lookahead.drafter", "propose"), ("", "_stop_reason"),
               ("", "_output"), ("", "_record_step")]


def _median(ranked: list[float]) -> float:
    return ranked[len(ranked) // 2] if ranked else float("nan")


def host_stages(engine: LLMEngine, steps: int) -> None:
    """Wall time per step of each host stage (``HOST_STAGES``; nested stages count in their
    callers too) and the gap the GPU waits through with prefetch off: from the step's tokens
    reaching the host (the end of ``collect``, which waits for them) to the next replay's launch
    (the start of ``graphs.run``; its copies into the static buffers count in the gap).

    Also the GPU's own idle time there, without a profiler: a CUDA event recorded on the current
    stream as ``collect`` is entered completes when the replay's work is done, one recorded as
    ``graphs.run`` starts completes as the GPU reaches it, at once if the stream is empty; the
    time between them is the GPU idle, an upper bound: the sampling kernels and the tokens' copy
    in between count as idle. (Steps run one at a time: with async scheduling the next step is
    launched before ``collect``, and these gaps are not the GPU's.)"""
    totals: dict[str, float] = defaultdict(float)
    marks = {"tokens": None, "gaps": [], "events": [], "last": None}
    restore = []

    def event() -> torch.cuda.Event:
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    def timed(owner, name):
        original = getattr(owner, name)

        def call(*args, **kwargs):
            t0 = time.perf_counter()
            if name == "run" and marks["tokens"] is not None:
                marks["gaps"].append(t0 - marks["tokens"])
                marks["events"].append((marks["last"], event()))
            if name == "collect":
                marks["last"] = event()
            try:
                return original(*args, **kwargs)
            finally:
                t1 = time.perf_counter()
                totals[f"{type(owner).__name__}.{name}"] += t1 - t0
                if name == "collect":
                    marks["tokens"] = t1
        setattr(owner, name, call)
        restore.append((owner, name))

    for path, name in HOST_STAGES:
        owner = engine
        for part in filter(None, path.split(".")):
            owner = getattr(owner, part, None)
        if owner is not None and hasattr(owner, name):
            timed(owner, name)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / steps * 1e3
    for owner, name in restore:
        delattr(owner, name)  # (the instance attribute shadowed the class's method)
    gaps = sorted(marks["gaps"])
    idle = sorted(end.elapsed_time(start) for end, start in marks["events"])
    print(f"   host stages, wall ms/step over {steps} steps (step {wall:.2f}); tokens read -> "
          f"next replay launched: median {_median(gaps) * 1e3:.2f} ms; GPU idle between a step's "
          f"last work and the next replay (CUDA events): median {_median(idle):.2f}, max "
          f"{idle[-1] if idle else float('nan'):.2f} ms")
    for key, total in totals.items():
        print(f"      {total / steps * 1e3:7.3f} ms  {key}")


def measure(engine: LLMEngine, timed: int, profiled: int, top: int,
            python_top: int = 0, stages: bool = False) -> tuple[float, dict]:
    for _ in range(3):
        engine.step()
    # (no device sync here: with async scheduling a step is in flight between two calls, and
    # letting it finish first would make the first timed step free)
    t0 = time.perf_counter()
    for _ in range(timed):
        engine.step()
    wall_ms = (time.perf_counter() - t0) / timed * 1e3
    if python_top:
        host_profile(engine, timed, python_top)
    if stages:
        host_stages(engine, timed)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(profiled):
            engine.step()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        return wall_ms, analyse(path, profiled, top)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_bench_flags(parser)
    parser.add_argument("--timed-steps", type=int, default=10)
    parser.add_argument("--profile-steps", type=int, default=3)
    parser.add_argument("--top", type=int, default=8, help="kernels listed per stream")
    parser.add_argument("--compare-prefetch-off", action="store_true")
    parser.add_argument("--compare-sync", action="store_true",
                        help="then the same requests with async scheduling off (steps one at a "
                             "time)")
    parser.add_argument("--python-top", type=int, default=0,
                        help="also list this many Python functions by host time (cProfile)")
    parser.add_argument("--shared-prompts", action="store_true",
                        help="prompts that share all but their last block (a fast prefill)")
    parser.add_argument("--host-stages", action="store_true",
                        help="also time the host's stages of a step (wall clock, not cProfile)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("profile_decode.py needs a CUDA GPU")
    try:
        context, concurrency = int(args.context_lens), int(args.concurrency)
    except ValueError:
        sys.exit("profile_decode.py takes one --context-lens and one --concurrency (numbers)")
    phases = 1 + args.compare_prefetch_off + args.compare_sync
    timed = args.timed_steps * (1 + bool(args.python_top) + args.host_stages)
    args.output_lens = str(phases * (timed + args.profile_steps + 5) + 2)
    fit_defaults(args)
    config = config_from_args(args)
    engine = make_engine(config, args.emulated_host_gib)  # as served: no stall clock marks
    params = SamplingParams(max_tokens=int(args.output_lens), temperature=0.0, ignore_eos=True)
    for i in range(concurrency):
        own = context - (context - 1) // config.block_size * config.block_size
        shared = context - own if args.shared_prompts else 0
        engine.add_request([(7 * (j >= shared) * i + j) % 1000 + 1 for j in range(context)],
                           params)
    t0 = time.perf_counter()
    while engine.stats.num_waiting or engine.stats.last_step_prefill or not engine.stats.num_steps:
        engine.step()
    print(f"{args.model} {config.kv_mode} context={context} requests={concurrency} "
          f"async={engine.steps_ahead} draft={config.tier.draft!r} "
          f"prefetch={config.tier.prefetch} graphs={engine.runner.graphs is not None}; prefill "
          f"{time.perf_counter() - t0:.1f} s; running {len(engine.scheduler.running)}")
    wall, stats = measure(engine, args.timed_steps, args.profile_steps, args.top, args.python_top,
                          args.host_stages)
    report(f"prefetch={config.tier.prefetch}", wall, stats)
    result = {"config": vars(args),
              "phases": [{"prefetch": config.tier.prefetch, "wall_ms": wall, **stats}]}
    if args.compare_prefetch_off:
        engine.runner.backend.retrieval.active = False  # the same requests, no selection or fetch
        if engine.runner.graphs is not None:
            engine.runner.graphs._capture()
        wall, stats = measure(engine, args.timed_steps, args.profile_steps, args.top,
                              args.python_top, args.host_stages)
        report("prefetch=off (same requests"
               + (", graphs recaptured)" if engine.runner.graphs else ")"), wall, stats)
        result["phases"].append({"prefetch": "off", "wall_ms": wall, **stats})
    if args.compare_sync:
        ahead, engine.steps_ahead = engine.steps_ahead, False
        wall, stats = measure(engine, args.timed_steps, args.profile_steps, args.top,
                              args.python_top, args.host_stages)
        report(f"async scheduling off (same requests; it was {'on' if ahead else 'off'})", wall,
               stats)
        result["phases"].append({"async_scheduling": False, "wall_ms": wall, **stats})
    print(json.dumps(result))


if __name__ == "__main__":
    main()
