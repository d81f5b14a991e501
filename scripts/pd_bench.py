"""Disaggregated serving under load: one node (``--role both``) against a prefill worker plus a
decode worker (``--role prefill`` / ``--role decode``, prompt KV over NIXL), and optionally the
same with a memory worker every prompt's KV is offloaded to (``--setups ...,pd-memory``), or with
a decode-host cache on the decode worker (``pd-cache:F``: ``--f-host F``; ``pd-partial:F``: the
same with partial admission, ``--pd-transfer partial``), same load.

python scripts/pd_bench.py qwen3-8b --context 32768 --requests 32 --max-tokens 64 \\
    --prefill-gpu 1 --decode-gpu 0 -- --kv-mode oasis --host-kv-gib 96 --draft ngram

Each setup gets ``--requests`` concurrent streamed completions of ``--context`` prompt token ids
(random ones, or with ``--text FILE``, a JSON ``{"docs": [...]}`` of held-out text, consecutive
windows of it in the model's tokens: a trained model's selections then have its real locality)
and ``--max-tokens`` tokens each, greedy. Reported per setup: TTFT (mean, p99), decode tok/s (tokens
after each request's first, over the time from the first first-token to the last token), the
largest running batch seen on /metrics (polled), and for the decode worker the bytes read at
admission, NIXL reads and their rate (read GB/s: bytes over the summed transfer seconds) with the
p99 transfer time (histogram bucket bound), and the remote tier's bandwidth over the load (GB/s
mean / p99: the decode worker's timeline, ``GET /v1/kv/timeline``, of every byte it read over
NIXL, admission and decode-host cache reads, each transfer's spread over its duration, in 10 ms
bins from the first request's start to the last token; the mean is every byte over that span, the
p99 the nearest-rank 99th percentile of the bins' rates, idle bins included: the paper's Fig. 13
point, a link idle between admission bursts has a p99 far above its mean); with a decode-host
cache also the blocks it read again
(misses, GB, transfers, their p99), its evictions, the reads a step stopped waiting for
(deferred) and those started while a step's graph replayed (overlapped), and the most host rows
in use at once (of its rows), and how many completions have the first setup's text. A table,
then one JSON line.
Everything after ``--`` goes to every ``oasiskv serve`` as is (both workers need the same KV
flags). A bench preset runs with
random weights (``--load-format dummy``), the same in every process; the GPUs given run the
workers (``CUDA_VISIBLE_DEVICES``), the single node on the decode GPU.
"""
import json
import random
import shlex
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
from served import Server, parse


def _p99(values: list[float]) -> float:
    ranked = sorted(values)
    return ranked[min(len(ranked) - 1, int(0.99 * len(ranked)))]


def _histogram_p99(m: dict[str, float], name: str) -> float | None:
    """The upper bound of the bucket holding the 99th percentile of histogram ``name``."""
    count = m.get(f"{name}_count", 0)
    if not count:
        return None
    buckets = sorted((float(k.split("{")[1].rstrip("}")), v) for k, v in m.items()
                     if k.startswith(f"{name}_bucket{{") and "+Inf" not in k)
    return next((le for le, v in buckets if v >= 0.99 * count), float("inf"))


def _timeline_now(front: Server) -> float | None:
    """The decode worker's clock, which its bandwidth timeline is kept in; None for a server
    without one (a single node, a tree before it)."""
    resp = httpx.get(front.url + "/v1/kv/timeline", timeout=10)
    return resp.json()["now"] if resp.status_code == 200 else None


def _bandwidth(front: Server, start: float) -> dict:
    """Mean and p99 GB/s of the decode worker's remote reads over its timeline's bins from
    ``start`` (its clock) to now, idle bins included."""
    from oasiskv.kv.timeline import rate_summary  # (the served tree's: it serves the timeline)
    resp = httpx.get(front.url + "/v1/kv/timeline", params={"start": start}, timeout=30)
    resp.raise_for_status()
    t = resp.json()
    mean, p99 = rate_summary(t["bins"], t["bin_s"])
    return {"remote_gb_s_mean": mean / 1e9, "remote_gb_s_p99": p99 / 1e9,
            "remote_timeline_s": len(t["bins"]) * t["bin_s"], "timeline_bin_s": t["bin_s"]}


def prompts(args) -> list[list[int]]:
    """``--requests`` prompts of ``--context`` token ids: random, or windows of ``--text``."""
    if not args.text:
        return [[random.Random(i).randrange(1, 250) for _ in range(args.context)]
                for i in range(args.requests)]
    from transformers import AutoTokenizer

    from oasiskv.models.loader import resolve_model_path
    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model_path(args.model)))
    with open(args.text) as f:
        ids = tokenizer.encode("\n".join(json.load(f)["docs"]), add_special_tokens=False)
    if len(ids) < args.requests * args.context:
        raise SystemExit(f"{args.text} has {len(ids)} tokens, fewer than {args.requests} x "
                         f"{args.context}")
    return [ids[i * args.context:(i + 1) * args.context] for i in range(args.requests)]


def run_load(args, front: Server, batch: list[list[int]]) -> dict:
    """The load of ``batch`` (prompts) against ``front``; returns the measured point."""
    peak, stop = [0.0], threading.Event()

    rows = [0.0]

    def poll() -> None:
        while not stop.is_set():
            try:
                m = front.metrics()
                peak[0] = max(peak[0], m["oasiskv_num_requests_running"])
                rows[0] = max(rows[0], m.get("oasiskv_pd_cache_rows_in_use", 0.0))
            except (httpx.HTTPError, KeyError):
                pass
            stop.wait(0.5)

    def one(i: int) -> tuple[float, float, float, int, str]:
        body = {"prompt": batch[i], "max_tokens": args.max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True}
        start, first, last, tokens, text = time.monotonic(), None, None, 0, ""
        with httpx.stream("POST", front.url + "/v1/completions", json=body,
                          timeout=args.timeout) as resp:
            if resp.status_code != 200:
                raise RuntimeError(f"HTTP {resp.status_code}: {resp.read()[:300]!r}")
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    last = time.monotonic()
                    first = first or last
                    tokens += 1
                    event = json.loads(line[6:])
                    if "choices" not in event:  # (an error event ends the stream)
                        raise RuntimeError(f"request {i} failed: {event.get('error')}")
                    text += event["choices"][0]["text"]
        return start, first, last, tokens, text

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    since = _timeline_now(front)
    with ThreadPoolExecutor(args.requests) as pool:
        results = list(pool.map(one, range(args.requests)))
    link = _bandwidth(front, since) if since is not None else {}
    stop.set()
    ttft = [first - start for start, first, *_ in results]
    span = max(r[2] for r in results) - min(r[1] for r in results)
    decoded = sum(r[3] - 1 for r in results)
    m = front.metrics()
    point = {"ttft_mean_s": sum(ttft) / len(ttft), "ttft_p99_s": _p99(ttft),
             "decode_tok_s": decoded / span if span > 0 else 0.0, "peak_batch": peak[0],
             "texts": [r[4] for r in results], **link}
    if "oasiskv_pd_admission_bytes_total" in m:
        nbytes, seconds = (m["oasiskv_pd_admission_bytes_total"],
                           m.get("oasiskv_pd_remote_read_seconds_sum", 0.0))
        read = nbytes - m.get("oasiskv_pd_handoff_bytes_total", 0.0)  # (NIXL's part)
        point |= {"admission_gb": nbytes / 1e9, "remote_reads": m["oasiskv_pd_remote_reads_total"],
                  "read_gb_s": read / seconds / 1e9 if seconds else None,
                  "remote_read_p99_s": _histogram_p99(m, "oasiskv_pd_remote_read_seconds")}
    if "oasiskv_pd_cache_rows" in m:
        point |= {"cache_misses": m["oasiskv_pd_cache_misses_total"],
                  "cache_read_gb": m.get("oasiskv_pd_cache_read_bytes_total", 0.0) / 1e9,
                  "cache_reads": m.get("oasiskv_pd_cache_reads_total", 0.0),
                  "cache_read_p99_s": _histogram_p99(m, "oasiskv_pd_cache_read_seconds"),
                  "cache_evictions": m["oasiskv_pd_cache_evictions_total"],
                  "cache_deferred": m["oasiskv_pd_cache_deferred_reads_total"],
                  # (a tree without the remote-fetch stage has no such counter)
                  "cache_overlapped": m.get("oasiskv_pd_cache_overlapped_reads_total", 0.0),
                  "cache_rows_peak": rows[0], "cache_rows": m["oasiskv_pd_cache_rows"]}
    return point


def _flags(parser) -> None:
    parser.add_argument("--prefill-gpu", default=None, help="CUDA_VISIBLE_DEVICES of the prefill "
                                                            "worker (default: inherited)")
    parser.add_argument("--decode-gpu", default=None, help="... of the decode worker and the "
                                                           "single node (default: inherited)")
    parser.add_argument("--prefill-flags", default="",
                        help="more serve flags for the prefill worker only (e.g. its share of a "
                             "GPU both workers use: --gpu-memory-utilization counts the other "
                             "process's memory as used, so the worker started second, the "
                             "decode worker, asks for both shares)")
    parser.add_argument("--memory-flags", default="",
                        help="more serve flags for the memory worker only (setup pd-memory; it "
                             "runs no model and takes no GPU memory)")
    parser.add_argument("--decode-flags", default="",
                        help="more serve flags for the decode worker only (e.g. a smaller "
                             "--host-kv-gib for the pd-cache setups)")
    parser.add_argument("--text", default=None,
                        help='prompts from this JSON {"docs": [...]} of held-out text instead of '
                             'random token ids')
    parser.add_argument("--setups", default="single,pd",
                        help="which setups to run, in order: single, pd, pd-memory (pd with a "
                             "memory worker that every prompt's KV is offloaded to), pd-cache:F "
                             "(pd with --f-host F on the decode worker), pd-partial:F (the same "
                             "with --pd-transfer partial)")


def main() -> int:
    args, extra = parse(__doc__, requests=32, max_tokens=64, timeout=1800.0, add=_flags)
    batch = prompts(args)
    points, failed = {}, {}
    for setup in args.setups.split(","):
        servers = []
        try:
            if setup == "single":
                servers.append(Server(args, extra, args.decode_gpu))
            elif setup in ("pd", "pd-memory") or setup.startswith(("pd-cache:", "pd-partial:")):
                offload, cache = [], []
                if setup.startswith(("pd-cache:", "pd-partial:")):
                    cache = ["--f-host", setup.split(":", 1)[1], *shlex.split(args.decode_flags)]
                if setup.startswith("pd-partial:"):
                    cache += ["--pd-transfer", "partial"]
                if setup == "pd-memory":
                    memory = Server(args, extra, args.prefill_gpu, "--role", "memory",
                                    *shlex.split(args.memory_flags))
                    servers.append(memory)
                    offload = ["--memory-url", memory.url, "--offload-below-blocks", str(2**40)]
                prefill = Server(args, extra, args.prefill_gpu, "--role", "prefill", *offload,
                                 *shlex.split(args.prefill_flags))
                servers.append(prefill)
                servers.append(Server(args, extra, args.decode_gpu, "--role", "decode",
                                      "--prefill-url", prefill.url, *cache))
            else:
                raise SystemExit(f"unknown setup {setup!r} (single, pd, pd-memory, pd-cache:F, "
                                 "pd-partial:F)")
            points[setup] = run_load(args, servers[-1], batch)
        except RuntimeError as exc:  # (a worker that did not start: the other setups still run)
            failed[setup] = str(exc)
            print(f"setup {setup} failed: {exc}", file=sys.stderr)
        finally:
            for s in reversed(servers):  # the front first: it lets go of its leases on the others
                s.stop()
    columns = (("admission_gb", "admission GB", 13), ("remote_reads", "reads", 6),
               ("read_gb_s", "read GB/s", 10), ("remote_read_p99_s", "read p99 s", 11),
               ("remote_gb_s_mean", "GB/s mean", 10), ("remote_gb_s_p99", "GB/s p99", 9),
               ("cache_misses", "cache misses", 13), ("cache_read_gb", "cache GB", 9),
               ("cache_reads", "cache reads", 12), ("cache_read_p99_s", "cache p99 s", 12),
               ("cache_evictions", "evictions", 10), ("cache_deferred", "deferred", 9),
               ("cache_overlapped", "overlapped", 11), ("cache_rows_peak", "rows peak", 10),
               ("cache_rows", "rows", 8))
    if "--emulated-host-gib" in args.prefill_flags:
        print("*** EMULATED prefill host: its prompts share physical host blocks (capacity "
              "emulation, benchmark only: random weights)")
    first = next(iter(points.values()))["texts"] if points else []
    for p in points.values():
        p["same_text"] = sum(a == b for a, b in zip(p.pop("texts"), first))
    print(f"{'setup':16} {'TTFT mean s':>12} {'TTFT p99 s':>11} {'decode tok/s':>13} "
          f"{'peak batch':>11} {'same text':>10} "
          + " ".join(f"{title:>{w}}" for _, title, w in columns))
    for setup, p in points.items():
        cells = [f"{p.get(k):>{w}.3f}" if isinstance(p.get(k), float) else f"{'-':>{w}}"
                 for k, _, w in columns]
        print(f"{setup:16} {p['ttft_mean_s']:12.3f} {p['ttft_p99_s']:11.3f} "
              f"{p['decode_tok_s']:13.1f} {p['peak_batch']:11.0f} "
              f"{p['same_text']:>4}/{len(first):<5} " + " ".join(cells))
    for setup, reason in failed.items():
        print(f"{setup:16} failed: {reason}")
    print(json.dumps({"model": args.model, "context": args.context, "requests": args.requests,
                      "prefill_flags": args.prefill_flags,
                      "max_tokens": args.max_tokens, "flags": extra, "points": points,
                      "failed": failed}))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
