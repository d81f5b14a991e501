"""A running tiered server's /metrics under load: start ``oasiskv serve`` (a bench preset with
random weights, or a checkpoint) on a loopback port, send ``--requests`` concurrent completions of
``--context`` random prompt token ids and ``--max-tokens`` tokens each, then print the tier's
telemetry and the guardrail's histograms from /metrics, and a final JSON line.

python scripts/metrics_check.py qwen3-8b --context 32768 --requests 64 --max-tokens 32 \\
    -- --kv-mode oasis --host-kv-gib 16 --draft ngram --guardrail-rate 0.01

Everything after ``--`` goes to ``oasiskv serve`` as is.
"""
import json
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
from served import Server, parse

SHOWN = ("oasiskv_kv_", "oasiskv_guardrail_", "oasiskv_generation_tokens_total",
         "oasiskv_num_requests_running")


def main() -> int:
    args, extra = parse(__doc__, requests=64, max_tokens=32, timeout=900.0)
    try:
        server = Server(args, extra)
    except RuntimeError as exc:
        print(exc, file=sys.stderr)
        return 1
    url = server.url
    try:
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
        metrics = server.metrics_text()
        shown = [line for line in metrics.splitlines() if line.startswith(SHOWN)]
        print("\n".join(shown))
        samples = [float(line.split()[-1]) for line in shown
                   if line.startswith("oasiskv_guardrail_attention_recall_count")]
        summary = {"requests": args.requests, "ok": codes.count(200), "seconds": round(seconds, 1),
                   "metric_lines": len(shown), "guardrail_samples": sum(samples)}
        print(json.dumps(summary))
        return 0 if codes.count(200) == args.requests else 1
    finally:
        server.stop()


if __name__ == "__main__":
    sys.exit(main())
