"""Host time of the decode step's stages that need no GPU, at the batch and context of a serving
point: the n-gram drafter's guesses (``spec/ngram.py``) and the block tables a CUDA graph's input
mirror is filled with (``engine/block_tables.py``).

Drafter: ``R`` sequences of ``P`` random tokens each are indexed (the first guess after prefill),
then every step appends one token to each (a copy of an earlier one with probability
``--copied``, else random: the share of n-gram hits) and times one guess per sequence. Also timed:
the fold of the ``REBUILD_TOKENS`` tokens the dict collects into the arrays of one ``P``-token
sequence, which happens once per that many steps per sequence.

Block tables: ``R`` tables of ``P / 16`` blocks; each step 1/16 of them gains a block (16-token
blocks); timed: ``fill`` of every row (a fresh output) and of a kept mirror (``written``).
Prints tables and a JSON line.

    python scripts/host_bench.py --requests 128 --prompt-len 32768 --steps 200 --copied 0 0.5
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time
import types

import numpy as np

from oasiskv.engine.block_tables import BlockTableRows
from oasiskv.spec.ngram import REBUILD_TOKENS, NgramIndex

VOCAB = 151936  # Qwen3's


def steady(requests: int, prompt_len: int, steps: int, copied: float) -> tuple[float, float]:
    """(median, p90) seconds of one step's guesses for ``requests`` sequences."""
    rng = random.Random(0)
    seqs = [[rng.randrange(VOCAB) for _ in range(prompt_len)] for _ in range(requests)]
    index = [NgramIndex() for _ in seqs]
    for seq, idx in zip(seqs, index):
        idx.guess(seq)
    times = []
    for _ in range(steps):
        for seq in seqs:
            seq.append(seq[rng.randrange(len(seq) - 3)] if rng.random() < copied
                       else rng.randrange(VOCAB))
        start = time.perf_counter()
        for seq, idx in zip(seqs, index):
            idx.guess(seq)
        times.append(time.perf_counter() - start)
    times.sort()
    return statistics.median(times), times[int(0.9 * (len(times) - 1))]


def fold(prompt_len: int, repeats: int = 5) -> float:
    """Median seconds of the guess that folds the dict into the arrays of one sequence."""
    rng, times = random.Random(1), []
    for _ in range(repeats):
        seq = [rng.randrange(VOCAB) for _ in range(prompt_len)]
        idx = NgramIndex()
        idx.guess(seq)
        seq += [rng.randrange(VOCAB) for _ in range(REBUILD_TOKENS)]
        idx.guess(seq)  # (the dict holds them all now)
        seq.append(rng.randrange(VOCAB))
        start = time.perf_counter()
        idx.guess(seq)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def tables(requests: int, prompt_len: int, steps: int, kept: bool) -> float:
    """Median seconds of one step's ``fill`` of ``requests`` block tables."""
    rng, blocks = random.Random(2), prompt_len // 16
    seqs = [types.SimpleNamespace(seq_id=i, block_table=[rng.randrange(1 << 20) for _ in
                                                         range(blocks - rng.randrange(16))])
            for i in range(requests)]
    rows = BlockTableRows(requests)
    out = np.zeros((requests, blocks + steps // 16 + 16), dtype=np.int32)
    written = [(None, 0)] * requests if kept else None
    times = []
    for step in range(steps):
        for seq in seqs[step % 16::16]:
            seq.block_table.append(rng.randrange(1 << 20))
        start = time.perf_counter()
        rows.fill(seqs, out, written)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=32768)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--copied", type=float, nargs="+", default=[0.0, 0.5])
    args = ap.parse_args()
    rows = []
    for copied in args.copied:
        med, p90 = steady(args.requests, args.prompt_len, args.steps, copied)
        rows.append({"copied": copied, "step_ms": med * 1e3, "step_p90_ms": p90 * 1e3,
                     "us_per_guess": med / args.requests * 1e6})
    fold_ms = fold(args.prompt_len) * 1e3
    fill_ms = {name: tables(args.requests, args.prompt_len, args.steps, kept) * 1e3
               for name, kept in (("every_row", False), ("kept_mirror", True))}
    print(f"{args.requests} sequences x {args.prompt_len} tokens, {args.steps} steps")
    print("| copied | ms per step (median) | p90 | us per guess |")
    print("|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['copied']} | {r['step_ms']:.3f} | {r['step_p90_ms']:.3f} | "
              f"{r['us_per_guess']:.2f} |")
    print(f"fold of {REBUILD_TOKENS} tokens into a {args.prompt_len}-token index: {fold_ms:.2f} ms "
          f"({fold_ms * 1e3 / REBUILD_TOKENS:.2f} us per token)")
    print(f"block tables, ms per step (median): every row {fill_ms['every_row']:.3f}, "
          f"kept mirror {fill_ms['kept_mirror']:.3f}")
    print(json.dumps({"requests": args.requests, "prompt_len": args.prompt_len, "rows": rows,
                      "fold_ms": fold_ms, "fill_ms": fill_ms}))


if __name__ == "__main__":
    main()
