"""``oasiskv eval``: how much tiered (sparse) decode changes the model's predictions.

On held-out text cut into windows, each window's first ``window - last`` tokens are prefilled and the
last ``last`` positions are decoded one at a time, teacher-forced (the true next token is fed back, not
the sampled one), once densely and once per oasis setting (K x fetch cap). Reported per setting:
next-token loss on the true tokens (nats), its difference to dense, and greedy top-1 agreement with
dense at the same positions. A table, then one JSON line.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from oasiskv.config import EngineConfig
from oasiskv.engine.llm_engine import LLMEngine
from oasiskv.sampling_params import SamplingParams


@dataclass
class Run:
    setting: str
    loss: float
    top1: list[list[int]]


def add_eval_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="checkpoint folder (e.g. the pycode-19m fixture's target/)")
    parser.add_argument("--text", required=True, help='JSON file {"docs": [...]} of held-out text')
    parser.add_argument("--windows", type=int, default=4, help="number of windows")
    parser.add_argument("--window-len", type=int, default=4096, help="tokens per window")
    parser.add_argument("--last", type=int, default=256, help="decoded (scored) positions at each window's end")
    parser.add_argument("--topk-blocks", default="16,32,64", help="K values to evaluate")
    parser.add_argument("--fetch-ratio", type=float, default=0.05, help="f_HBM of the capped runs")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="float32")


def windows(engine: LLMEngine, text_file: str, count: int, length: int) -> list[list[int]]:
    docs = json.loads(Path(text_file).read_text())["docs"]
    ids = engine.encode("\n".join(docs))
    if len(ids) < count * length:
        raise ValueError(f"{text_file} has {len(ids)} tokens, fewer than {count} windows of {length}")
    stride = len(ids) // count
    return [ids[i * stride:i * stride + length] for i in range(count)]


def teacher_forced(engine: LLMEngine, wins: list[list[int]], last: int) -> tuple[float, list[list[int]]]:
    """Mean NLL of the true tokens at each window's last ``last`` positions, and the greedy tokens."""
    forced = {}
    for w in wins:
        rid = engine.add_request(w[:-last], SamplingParams(max_tokens=last, temperature=0, ignore_eos=True))
        forced[rid] = w[-last:]
    nll, greedy = {rid: [] for rid in forced}, {rid: [] for rid in forced}
    sched, runner = engine.scheduler, engine.runner
    while sched.has_unfinished():
        batch = sched.schedule()
        seqs, logits = runner.next_token_logits(batch, runner.forward(batch))
        sched.postprocess(batch)
        logp = torch.log_softmax(logits.float(), dim=-1)
        for row, seq in enumerate(seqs):
            step = len(seq.output_token_ids)
            true = forced[seq.request_id][step]
            nll[seq.request_id].append(-logp[row, true].item())
            greedy[seq.request_id].append(int(logp[row].argmax()))
            seq.append_token(true)
            if step + 1 == last:
                sched.finish(seq, "length")
                engine.requests.pop(seq.request_id)
    losses = [x for rid in forced for x in nll[rid]]
    return sum(losses) / len(losses), [greedy[rid] for rid in forced]


def evaluate(args: argparse.Namespace) -> list[Run]:
    base = dict(model=args.model, device=args.device, dtype=args.dtype, max_model_len=args.window_len + 1,
                max_num_batched_tokens=args.window_len)
    dense = LLMEngine(EngineConfig(**base))
    wins = windows(dense, args.text, args.windows, args.window_len)
    runs = [Run("dense", *teacher_forced(dense, wins, args.last))]
    del dense
    host_gib = 2 * args.windows * args.window_len * _kv_bytes_per_token(args) / 2**30 + 0.01
    for k in (int(x) for x in args.topk_blocks.split(",")):
        for ratio in (1.0, args.fetch_ratio):
            engine = LLMEngine(EngineConfig(**base, kv_mode="oasis", topk_blocks=k, fetch_ratio=ratio,
                                            host_kv_gib=host_gib))
            label = f"oasis K={k} " + ("no cap" if ratio == 1.0 else f"cap f={ratio}")
            runs.append(Run(label, *teacher_forced(engine, wins, args.last)))
    return runs


def _kv_bytes_per_token(args) -> int:
    from oasiskv.config import ModelConfig, parse_dtype
    cfg = ModelConfig.from_file(Path(args.model) / "config.json")
    return cfg.kv_bytes_per_token(parse_dtype(args.dtype) or cfg.dtype)


def run_from_args(args: argparse.Namespace) -> int:
    runs = evaluate(args)
    dense = runs[0]
    rows = []
    print(f"\n{args.windows} windows x {args.window_len} tokens, last {args.last} positions teacher-forced, "
          f"block 16, model {args.model}")
    print(f"{'setting':28} {'loss':>7} {'vs dense':>9} {'top-1 = dense':>14}")
    for run in runs:
        same = sum(a == b for g, d in zip(run.top1, dense.top1) for a, b in zip(g, d))
        total = sum(len(g) for g in run.top1)
        rows.append({"setting": run.setting, "loss": run.loss, "delta": run.loss - dense.loss,
                     "top1_agreement": same / total})
        print(f"{run.setting:28} {run.loss:7.4f} {run.loss - dense.loss:+9.4f} {same / total:14.3f}")
    print(json.dumps({"windows": args.windows, "window_len": args.window_len, "last": args.last, "runs": rows}))
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    add_eval_flags(parser)
    sys.exit(run_from_args(parser.parse_args()))
