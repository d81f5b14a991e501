"""A running tiered server's /metrics under load: start ``oasiskv serve`` (a bench preset with
random weights, or a checkpoint) on a loopback port, send ``--requests`` concurrent completions of
``--context`` random prompt token ids and ``--max-tokens`` tokens each, then print the tier's
telemetry and the guardrail's histograms from /metrics, and a final JSON line.

python scripts/metrics_check.py qwen3-8b --context 32768 --requests 64 --max-tokens 32 \\
    -- --kv-mode oasis --host-kv-gib 16 --draft ngram --guardrail-rate 0.01

Everything after ``--`` goes to ``oasiskv serve`` as is.
"""
import argparse
import json
import random
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

SHOWN = ("oasiskv_kv_", "oasiskv_guardrail_", "oasiskv_generation_tokens_total",
         "oasiskv_num_requests_running")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--timeout", type=float, default=900.0)
    args = parser.parse_args(argv)
    from oasiskv.models.loader import preset_names
    port = _port()
    url = f"http://127.0.0.1:{port}"
    load_format = "dummy" if args.model in preset_names() else "auto"  # presets: random weights
    cmd = [sys.executable, "-m", "oasiskv.cli", "--log-level", "WARNING", "serve", args.model,
           "--port", str(port), "--load-format", load_format,
           "--max-model-len", str(args.context + args.max_tokens + 1),
           "--max-num-seqs", str(args.requests), *extra]
    server = subprocess.Popen(cmd)
    try:
        deadline = time.monotonic() + args.timeout
        while True:
            if server.poll() is not None:
                print(f"server exited with {server.returncode}", file=sys.stderr)
                return 1
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                print("server not healthy in time", file=sys.stderr)
                return 1
            time.sleep(1)
        vocab = 250  # ids inside every model's vocabulary (the tiny presets have 256)

        def complete(i: int) -> int:
            rng = random.Random(i)
            body = {"prompt": [rng.randrange(1, vocab) for _ in range(args.context)],
                    "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True}
            resp = httpx.post(url + "/v1/completions", json=body, timeout=args.timeout)
            return resp.status_code

        start = time.monotonic()
        with ThreadPoolExecutor(args.requests) as pool:
            codes = list(pool.map(complete, range(args.requests)))
        seconds = time.monotonic() - start
        metrics = httpx.get(url + "/metrics", timeout=10).text
        shown = [line for line in metrics.splitlines() if line.startswith(SHOWN)]
        print("\n".join(shown))
        samples = [float(line.split()[-1]) for line in shown
                   if line.startswith("oasiskv_guardrail_attention_recall_count")]
        summary = {"requests": args.requests, "ok": codes.count(200), "seconds": round(seconds, 1),
                   "metric_lines": len(shown), "guardrail_samples": sum(samples)}
        print(json.dumps(summary))
        return 0 if codes.count(200) == args.requests else 1
    finally:
        server.terminate()
        server.wait(30)


if __name__ == "__main__":
    sys.exit(main())
