"""``oasiskv eval``: how much tiered (sparse) decode changes the model's predictions.

On held-out text cut into windows, each window's first ``window - last`` tokens are prefilled and
the last ``last`` positions are decoded one at a time, teacher-forced (the true next token is fed
back, not the sampled one), once densely and once per oasis setting (K x fetch cap). Reported per
setting: next-token loss on the true tokens (nats), its difference to dense, and greedy top-1
agreement with dense at the same positions; for tiered runs, how full the fetch cap ran
(admitted blocks per head per step over the cap: mean, p10/p50/p90 over decode steps, and per
layer in the JSON). A table, then one JSON line.

With ``--drafts`` it also runs the lookahead step (K = ``--draft-k``, the fetch cap on) once per
drafter and reports, besides loss and top-1, the drafter's hit rate (its guess == the true next
token) and per layer the agreement of the predicted top-K set with the set the true next query
then picks from the same summaries (mean over heads of |predicted & true| / |true|). Drafters:
``previous`` (the current query predicts the next), ``ngram``, ``model:PATH``, ``eagle3:PATH``
and ``oracle`` (the true next token: the upper bound).

With ``--guardrail`` the capped and lookahead runs carry the online guardrail at rate 1 (every
decoded position measured at every layer: the share of exact attention mass the working set held,
``kv/guardrail.py``, and the attention output's relative error), and a second table says how top-1
agreement with dense goes with that recall (a position's mean over layers, and its lowest layer),
by recall bucket. Whether the online measures predict disagreement: for recall (mean, min over
layers) and output error (mean, max), the AUC of "worse measure, top-1 differs" and top-1 agreement
by quartile. (Served, the guardrail measures one random layer per sampled row.)

Every run goes through ``LLMEngine.step(forced=...)``, the engine's teacher-forcing step; the
set-agreement observer and the oracle drafter are attached through the backend factory.
"""
from __future__ import annotations

import argparse
import bisect
import gc
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from oasiskv.bench.harness import oasis_backend
from oasiskv.config import EngineConfig, ModelConfig, parse_dtype
from oasiskv.engine.llm_engine import LLMEngine
from oasiskv.kernels.fp8 import storage_dtype
from oasiskv.kv.probes import TierProbes
from oasiskv.sampling_params import SamplingParams
from oasiskv.spec.base import Drafter


@dataclass
class Run:
    setting: str
    loss: float
    top1: list[list[int]]
    draft_hit_rate: float | None = None
    set_agreement: list[float] | None = None
    cap_fill: dict | None = None  # tiered runs: admitted blocks / what the fetch cap allows
    recall: list[list[list[float]]] | None = None  # guardrail: per window, position, layer
    error: list[list[list[float]]] | None = None  # ... the attention output's relative error


class CapFill:
    """How full the fetch cap runs: per decode step, admitted blocks over the cap's allowance
    (cap x kv heads x layers x rows), and per layer over the whole run."""

    def __init__(self):
        self.steps: list[float] = []
        self.admitted: list[float] = []
        self.allowed = 0.0

    def add(self, stats) -> None:
        allowed = stats.kv.get("cap_slots", 0)
        if not allowed:
            return
        per_layer = stats.kv_per_layer["fetched_blocks"]
        self.steps.append(stats.kv["fetched_blocks"] / allowed)
        self.admitted = [a + b for a, b in zip(self.admitted, per_layer)] or list(per_layer)
        self.allowed += allowed / len(per_layer)

    def summary(self) -> dict | None:
        if not self.steps:
            return None
        steps = sorted(self.steps)
        at = lambda p: steps[min(len(steps) - 1, int(p * len(steps)))]  # noqa: E731
        return {"mean": sum(self.admitted) / (self.allowed * len(self.admitted)),
                "p10": at(0.1), "p50": at(0.5), "p90": at(0.9),
                "per_layer": [a / self.allowed for a in self.admitted]}


def add_eval_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="checkpoint folder (e.g. the pycode-19m fixture's target/)")
    parser.add_argument("--text", required=True, help='JSON file {"docs": [...]} of held-out text')
    parser.add_argument("--windows", type=int, default=4, help="number of windows")
    parser.add_argument("--window-len", type=int, default=4096, help="tokens per window")
    parser.add_argument("--last", type=int, default=256,
                        help="decoded (scored) positions at each window's end")
    parser.add_argument("--topk-blocks", default="16,32,64",
                        help="K values to evaluate (empty: dense runs only)")
    parser.add_argument("--fetch-ratio", type=float, default=0.05, help="f_HBM of the capped runs")
    parser.add_argument("--drafts", default="",
                        help="lookahead drafters to compare, e.g. previous,ngram,oracle,"
                        "model:PATH,eagle3:PATH (empty: skip)")
    parser.add_argument("--draft-k", type=int, default=32, help="K of the lookahead runs")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="ranks the model is split over (not with the oracle drafter)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--guardrail", action="store_true",
                        help="measure attention recall online (guardrail rate 1) in the capped "
                             "and lookahead runs, and tabulate top-1 agreement by recall")
    parser.add_argument("--kv-cache-dtype", default="auto",
                        help="K/V storage of every run but the reference dense one: auto, fp8 or "
                             "int8 (then a 'dense fp8' or 'dense int8' run is added)")
    parser.add_argument("--kv-open-block", default="model",
                        help="with 8-bit KV (dense and tiered runs): model (each sequence's open "
                             "block also in the model's dtype) or kv (8-bit as every other block)")
    parser.add_argument("--summary-dtype", default="auto",
                        help="block summaries of the tiered runs: auto (as the KV cache), fp8 "
                             "or model (the model's dtype)")
    parser.add_argument("--block-size", type=int, default=0,
                        help="tokens per KV block of every run but the reference dense one; 0 = "
                             "the engine's auto (32 for a dense 8-bit pool, else 16)")


def windows(engine: LLMEngine, text_file: str, count: int, length: int) -> list[list[int]]:
    docs = json.loads(Path(text_file).read_text())["docs"]
    ids = engine.encode("\n".join(docs))
    if len(ids) < count * length:
        raise ValueError(f"{text_file} has {len(ids)} tokens, fewer than {count} windows of "
                         f"{length}")
    stride = len(ids) // count
    return [ids[i * stride:i * stride + length] for i in range(count)]


class SetAgreement:
    """Observer of the sparse backend: pairs each layer's predicted top-K (made at step t) with the
    top-K the real query picks at step t+1, per sequence slot; accumulates the mean overlap per
    layer."""

    def __init__(self, num_layers: int):
        self.pending: dict[tuple[int, int], torch.Tensor] = {}
        self.total, self.count = [0.0] * num_layers, [0] * num_layers

    def __call__(self, kind: str, layer: int, slots: torch.Tensor, blocks: torch.Tensor) -> None:
        blocks = blocks.cpu()
        for i, slot in enumerate(slots.tolist()):
            if kind == "predicted":
                self.pending[(slot, layer)] = blocks[i]
                continue
            predicted = self.pending.pop((slot, layer), None)
            if predicted is None:
                continue
            for true_row, pred_row in zip(blocks[i].tolist(), predicted.tolist()):
                true = {b for b in true_row if b >= 0}
                if true:
                    self.total[layer] += len(true & {b for b in pred_row if b >= 0}) / len(true)
                    self.count[layer] += 1

    def per_layer(self) -> list[float]:
        return [t / max(1, c) for t, c in zip(self.total, self.count)]


class OracleDrafter(Drafter):
    """``oracle``: guesses the true next token of each window (the upper bound of any drafter)."""

    def __init__(self):
        self.forced: dict[str, list[int]] = {}  # request id -> its forced tokens

    def propose(self, seqs):
        guesses = []
        for seq in seqs:
            tokens, done = self.forced.get(seq.request_id, []), len(seq.output_token_ids)
            guesses.append(tokens[done] if done < len(tokens) else None)
        return guesses


def teacher_forced(engine: LLMEngine, wins: list[list[int]], last: int, setting: str,
                   oracle: OracleDrafter | None = None) -> Run:
    """Mean NLL of the true tokens at each window's last ``last`` positions, the greedy tokens, the
    drafter's hit rate (None without guesses) and how full the fetch cap ran (tiered runs)."""
    params = SamplingParams(max_tokens=last, temperature=0, ignore_eos=True, logprobs=1)
    forced = {engine.add_request(w[:-last], params): w[-last:] for w in wins}
    if oracle is not None:
        oracle.forced = forced
    nll, greedy = {rid: [] for rid in forced}, {rid: [] for rid in forced}
    guardrail = getattr(engine.runner.backend, "guardrail", None)
    measured = guardrail is not None and guardrail.active
    if measured:
        guardrail.every_layer = True
    recall = {rid: [[] for _ in range(last)] for rid in forced}  # per position: every layer's
    error = {rid: [[] for _ in range(last)] for rid in forced}
    first = {rid: len(w) - last for rid, w in zip(forced, wins)}  # the first scored position
    hits = tries = 0
    fill = CapFill()

    def record(samples: dict) -> None:
        if samples.get("guardrail_recall"):
            for rid, pos, _, share, err in guardrail.last:  # the position predicts token pos + 1
                recall[rid][pos + 1 - first[rid]].append(share)
                error[rid][pos + 1 - first[rid]].append(err)

    progress = tqdm(total=last * len(wins), desc=setting[:40], unit="tok", file=sys.stderr,
                    mininterval=2.0)
    while engine.has_unfinished():
        outs = engine.step({rid: tokens[len(nll[rid])] for rid, tokens in forced.items()
                            if len(nll[rid]) < last})
        for out in outs:
            progress.update(len(out.new_logprobs))
            for lp in out.new_logprobs:
                nll[out.request_id].append(-lp.logprob)
                greedy[out.request_id].append(lp.top[0][0])
        hits += engine.stats.kv.get("draft_hits", 0)
        tries += engine.stats.kv.get("draft_guesses", 0)
        fill.add(engine.stats)
        if measured:
            record(engine.stats.kv_samples)
    if measured:  # on CUDA the last steps' measurements may still run on the side stream
        record(guardrail.drain())
    progress.close()
    losses = [x for rid in forced for x in nll[rid]]
    return Run(setting, sum(losses) / len(losses), [greedy[rid] for rid in forced],
               hits / tries if tries else None, cap_fill=fill.summary(),
               recall=[recall[rid] for rid in forced] if measured else None,
               error=[error[rid] for rid in forced] if measured else None)


def evaluate(args: argparse.Namespace) -> list[Run]:
    base = dict(model=args.model, device=args.device, dtype=args.dtype,
                tensor_parallel_size=args.tensor_parallel_size,
                max_model_len=args.window_len + 1, max_num_batched_tokens=args.window_len)
    dense = LLMEngine(**base)
    wins = windows(dense, args.text, args.windows, args.window_len)
    runs = [teacher_forced(dense, wins, args.last, "dense")]
    _free(dense)
    base |= dict(kv_cache_dtype=args.kv_cache_dtype, kv_open_block=args.kv_open_block,
                 block_size=args.block_size)
    suffix = "" if args.kv_cache_dtype == "auto" else " " + args.kv_cache_dtype
    if suffix:
        engine = LLMEngine(**base)
        opened = args.kv_open_block == "model"
        runs.append(teacher_forced(engine, wins, args.last,
                                   f"dense{suffix} b{engine.config.block_size}"
                                   + (" (open block exact)" if opened else "")))
        _free(engine)
        suffix += " open" if opened else ""
    host_gib = 2 * args.windows * args.window_len * _kv_bytes_per_token(args) / 2**30 + 0.01
    base["summary_dtype"] = args.summary_dtype
    if EngineConfig.from_flat(kv_cache_dtype=args.kv_cache_dtype,
                              summary_dtype=args.summary_dtype).fp8_summaries:
        suffix += " fp8-summaries"
    for k in (int(x) for x in filter(None, args.topk_blocks.split(","))):
        for ratio in (1.0, args.fetch_ratio):
            engine = LLMEngine(**base, kv_mode="oasis", topk_blocks=k, fetch_ratio=ratio,
                               host_kv_gib=host_gib,
                               guardrail_rate=1.0 if args.guardrail and ratio < 1.0 else 0.0)
            label = f"oasis{suffix} K={k} " + ("no cap" if ratio == 1.0 else f"cap f={ratio}")
            runs.append(teacher_forced(engine, wins, args.last, label))
            _free(engine)
    for spec in filter(None, args.drafts.split(",")):
        runs.append(lookahead_run(args, base, host_gib, wins, spec, suffix))
    return runs


def lookahead_run(args, base: dict, host_gib: float, wins: list[list[int]], spec: str,
                  suffix: str) -> Run:
    """Teacher-forced lookahead (K = draft_k, cap on) with one drafter, observed for set
    agreement."""
    oracle = OracleDrafter() if spec == "oracle" else None
    config = EngineConfig.from_flat(**base, kv_mode="oasis", topk_blocks=args.draft_k,
                                    fetch_ratio=args.fetch_ratio, host_kv_gib=host_gib,
                                    draft="previous" if oracle else spec,
                                    guardrail_rate=1.0 if args.guardrail else 0.0)
    agreement = SetAgreement(ModelConfig.from_file(Path(args.model) / "config.json").num_layers)
    engine = LLMEngine(config,
                       backend_factory=oasis_backend(TierProbes(observers=[agreement]), oracle))
    setting = f"lookahead{suffix} K={args.draft_k} f={args.fetch_ratio} {spec}"
    run = teacher_forced(engine, wins, args.last, setting, oracle)
    _free(engine)
    run.set_agreement = agreement.per_layer()
    return run


def _free(engine: LLMEngine) -> None:
    """Give an engine's device memory back before the next one sizes its storage from what is
    free."""
    engine.close()
    del engine.runner
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _kv_bytes_per_token(args) -> int:
    cfg = ModelConfig.from_file(Path(args.model) / "config.json")
    dtype = parse_dtype(args.dtype) or cfg.dtype
    return cfg.kv_bytes_per_token(storage_dtype(args.kv_cache_dtype, dtype))


def run_from_args(args: argparse.Namespace) -> int:
    runs = evaluate(args)
    dense = runs[0]
    rows = []
    tiered_block = EngineConfig.from_flat(kv_mode="oasis", block_size=args.block_size).block_size
    print(f"\n{args.windows} windows x {args.window_len} tokens, last {args.last} positions "
          f"teacher-forced, tiered runs in {tiered_block}-token blocks, model {args.model}")
    print(f"{'setting':34} {'loss':>7} {'vs dense':>9} {'top-1 = dense':>14} "
          f"{'cap fill mean/p10/p50/p90':>26}")
    for run in runs:
        same = sum(a == b for g, d in zip(run.top1, dense.top1) for a, b in zip(g, d))
        total = sum(len(g) for g in run.top1)
        rows.append({"setting": run.setting, "loss": run.loss, "delta": run.loss - dense.loss,
                     "top1_agreement": same / total, "draft_hit_rate": run.draft_hit_rate,
                     "set_agreement_per_layer": run.set_agreement, "cap_fill": run.cap_fill})
        extra = "" if run.set_agreement is None else (
            f"  draft hit {'-' if run.draft_hit_rate is None else f'{run.draft_hit_rate:.3f}'}, "
            f"set agreement per layer "
            + " ".join(f"{a:.2f}" for a in run.set_agreement)
            + f" (mean {sum(run.set_agreement) / len(run.set_agreement):.3f})")
        fill = run.cap_fill
        fills = "-" if fill is None else "/".join(f"{fill[k]:.2f}" for k in ("mean", "p10", "p50",
                                                                              "p90"))
        print(f"{run.setting:34} {run.loss:7.4f} {run.loss - dense.loss:+9.4f} "
              f"{same / total:14.3f} {fills:>26}{extra}")
    by_recall = {how: recall_table(runs, dense, how) for how in ("mean", "min")}
    if by_recall["mean"]:
        print("\ntop-1 = dense by guardrail recall (a position's attention mass inside the working "
              "set, over layers; the runs with --guardrail pooled)")
        print(f"{'recall':>12} {'mean: positions':>16} {'top-1 = dense':>14} "
              f"{'lowest layer: positions':>24} {'top-1 = dense':>14}")
        tables = {how: {row["recall"]: row for row in rows} for how, rows in by_recall.items()}
        buckets = sorted(set(tables["mean"]) | set(tables["min"]))
        for bucket in buckets:
            cells = [f"{row['positions']:>{w}} {row['top1_agreement']:14.3f}" if row else
                     f"{'-':>{w}} {'-':>14}"
                     for row, w in ((tables["mean"].get(bucket), 16),
                                    (tables["min"].get(bucket), 24))]
            print(f"{bucket:>12} {cells[0]} {cells[1]}")
    signal = {f"{field} {how}": predictor_signal(measured_positions(runs, dense, how, field),
                                                 worse_when_higher=field == "error")
              for field, how in (("recall", "mean"), ("recall", "min"), ("error", "mean"),
                                 ("error", "max"))}
    for name, s in signal.items():
        if s is None:
            continue
        field, how = name.split()
        print(f"\n{field} ({how} over layers) as a predictor of top-1 disagreement: AUC "
              f"{s['auc']:.3f} (0.5 = none); mean {s['mean_agree']:.3f} where top-1 = dense, "
              f"{s['mean_disagree']:.3f} where not; by quartile:")
        for q in s["quartiles"]:
            print(f"{q['range']:>18} {q['positions']:>8} positions, top-1 = dense "
                  f"{q['top1_agreement']:.3f}")
    print(json.dumps({"windows": args.windows, "window_len": args.window_len, "last": args.last,
                      "runs": rows, "top1_by_recall": by_recall, "guardrail_signal": signal}))
    return 0


RECALL_BUCKETS = (0.0, 0.5, 0.8, 0.9, 0.95, 0.99, 1.0001)


def measured_positions(runs: list[Run], dense: Run, how: str,
                       field: str = "recall") -> list[tuple[float, bool]]:
    """(a guardrail measure over layers, top-1 = dense) of every measured position of the runs
    with one; ``field``: recall or error; ``how``: the mean, min or max over the position's
    layers."""
    reduce = {"mean": lambda xs: sum(xs) / len(xs), "min": min, "max": max}[how]
    return [(reduce(values), a == b)
            for run in runs
            for per_pos, got, want in zip(getattr(run, field) or (), run.top1, dense.top1)
            for values, a, b in zip(per_pos, got, want) if values]


def recall_table(runs: list[Run], dense: Run, how: str) -> list[dict]:
    """Top-1 agreement with dense of every measured position, pooled over the runs with recall,
    by bucket of the position's recall over layers (``how``: mean or min; empty buckets left
    out)."""
    counts = [[0, 0] for _ in RECALL_BUCKETS[:-1]]
    for share, same in measured_positions(runs, dense, how):
        i = next(j for j in range(len(counts)) if share < RECALL_BUCKETS[j + 1])
        counts[i][0] += 1
        counts[i][1] += same
    return [{"recall": f"[{lo:.2f}, {min(hi, 1.0):.2f}{']' if hi > 1 else ')'}",
             "positions": n, "top1_agreement": same / n}
            for (lo, hi), (n, same) in zip(zip(RECALL_BUCKETS, RECALL_BUCKETS[1:]), counts) if n]


def predictor_signal(positions: list[tuple[float, bool]],
                     worse_when_higher: bool = False) -> dict | None:
    """How well a position's measure (e.g. recall; an error when ``worse_when_higher``) separates
    top-1 disagreement from agreement: top-1 agreement by quartile of the measure (over these
    positions), its mean in each group, and the AUC of "worse measure, disagrees" (the chance
    that a disagreeing position's measure is worse than an agreeing one's, ties half; 0.5 = no
    signal, 1 = a perfect separation). None without both groups."""
    sign = -1.0 if worse_when_higher else 1.0
    agree = sorted(sign * v for v, same in positions if same)
    disagree = [sign * v for v, same in positions if not same]
    if not agree or not disagree:
        return None
    below = sum(bisect.bisect_right(agree, v) for v in disagree)
    ties = sum(bisect.bisect_right(agree, v) - bisect.bisect_left(agree, v) for v in disagree)
    auc = (len(agree) * len(disagree) - below + ties / 2) / (len(agree) * len(disagree))
    ranked = sorted(positions)
    quarters = [ranked[len(ranked) * i // 4: len(ranked) * (i + 1) // 4] for i in range(4)]
    return {"auc": auc, "mean_agree": sign * sum(agree) / len(agree),
            "mean_disagree": sign * sum(disagree) / len(disagree),
            "quartiles": [{"range": f"[{q[0][0]:.3f}, {q[-1][0]:.3f}]", "positions": len(q),
                           "top1_agreement": sum(s for _, s in q) / len(q)}
                          for q in quarters if q]}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    add_eval_flags(parser)
    sys.exit(run_from_args(parser.parse_args()))
