"""How a decode-host cache (``--f-host``) behaves on a trained model, on any device, in one process.

``python -m oasiskv.bench.host_cache MODEL --text HELD_OUT.json [--requests 4] [--prompt-len 4096]
[--max-tokens 64] [--f-host 0.2,0.5] [--transfer full,partial] [--topk-blocks 32] [--fetch-ratio
0.05] [--draft ngram]``

One engine prefills each prompt (windows of held-out text) and holds its blocks, as a prefill
worker does; a decode engine imports them as a full transfer, locates them on the first engine's
store (``StoreTier``: the remote tier is that store, read with a copy, in this process: no NIXL)
and decodes every prompt at once, greedy, once with every block kept (f_host 1) and once per
``--f-host`` value and ``--transfer`` (``partial``: the prompts are handed off, ``hand_off``, and
only their last blocks and summaries move at admission). Reported per run: the bytes moved at
admission per request, decode steps, the blocks read again per request per step
(misses), as GB, evictions, the hit rate of prompt blocks the steps read, the host rows in use
per request (the most, at admission, and the mean from the first LRU pass on), and whether the
tokens equal f_host 1's. Random weights make every head admit its full cap every step (the worst
case for the cache); a trained model says how often a selection leaves the cache. A table, then
one JSON line.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass, replace

import torch

from oasiskv import LLM, SamplingParams
from oasiskv.attention.sparse import LRU_PERIOD
from oasiskv.bench.fidelity import windows
from oasiskv.kv.exchange import KVExchange
from oasiskv.kv.host_cache import HostCache
from oasiskv.kv.host_store import HostStore


class StoreTier:
    """A remote tier that is another host store of this process (``kv.host_cache.RemoteTier``):
    whole blocks or layers of them, K, V and 8-bit scales, copied. Reads from a source in ``down``
    fail; a read from a source in ``slow`` (-> seconds) completes that long after it starts, and
    copies only then, or fails past ``deadline_s``."""

    def __init__(self, src: HostStore, dst: HostStore):
        self.src, self.dst = src, dst
        self.units = self.layer_units = 0  # units read, and of those one layer of a block
        self.down: set[str] = set()
        self.slow: dict[str, float] = {}
        self.deadline_s = 2.0

    def start(self, source: str, remote_blocks: list[int], rows: list[int],
              layers: list[int]) -> "_Copy":
        if source in self.down:
            raise ConnectionError(f"{source} is gone")
        copy = _Copy(self, self.src.rows_of(remote_blocks), rows, layers,
                     time.monotonic() + self.slow.get(source, 0.0))
        copy.done()
        return copy


class _Copy:
    """One ``StoreTier`` read (``kv.host_cache.PendingRead``)."""

    def __init__(self, tier: StoreTier, src_rows: list[int], rows: list[int], layers: list[int],
                 due: float):
        self.tier, self.src_rows, self.rows, self.layers = tier, src_rows, rows, layers
        self.due, self.deadline = due, time.monotonic() + tier.deadline_s
        self.copied = False

    def done(self) -> bool:
        if self.copied:
            return True
        now = time.monotonic()
        if now < self.due:
            if now > self.deadline:
                raise TimeoutError("a read from a slow source did not complete in time")
            return False
        for x, y in zip(self.tier.src.tensors(), self.tier.dst.tensors()):
            for src, row, layer in zip(self.src_rows, self.rows, self.layers):
                if layer < 0:
                    y[row] = x[src]
                else:
                    y[row, layer] = x[src, layer]
        self.tier.units += len(self.rows)
        self.tier.layer_units += sum(layer >= 0 for layer in self.layers)
        self.copied = True
        return True


def copy_blocks(src: KVExchange, dst: KVExchange, src_blocks: list[int],
                dst_blocks: list[int]) -> None:
    """What a NIXL read does: whole host blocks (K, V, FP8 scales) from one store into another."""
    a, b = src.kv.host, dst.kv.host
    rows = torch.tensor(b.rows_of(dst_blocks), dtype=torch.long)
    for x, y in zip(a.tensors(), b.tensors()):
        y[rows] = x[torch.tensor(a.rows_of(src_blocks), dtype=torch.long)]


def hand_off(prefill: LLM, decode: LLM, ids: list[int]) -> tuple[list[int], list[int], int]:
    """Partial admission of one prompt (``engine/handoff.py``), as a prefill and a decode worker
    do it: ``prefill`` runs the whole prompt and holds its blocks; ``decode`` holds blocks for it,
    copies the last token's block, writes the summaries of the complete blocks it did not have
    and takes the handoff. Returns (the blocks held on ``decode``, their ids on ``prefill``, the
    bytes moved: that block and the summaries)."""
    rid = f"handoff-{len(prefill.engine.handed_off)}-{id(ids)}"
    prefill.engine.add_request(ids, SamplingParams(max_tokens=1, temperature=0), rid,
                               hand_off=True)
    while prefill.engine.has_unfinished():
        prefill.engine.step()
    handoff = prefill.engine.take_handoff(rid)
    src, dst = KVExchange(prefill.engine.runner.backend), KVExchange(decode.engine.runner.backend)
    hashes = dst.prompt_hashes(ids)
    first = len(hashes) - dst.uncached(hashes)
    imp = dst.begin_handoff(hashes)
    copy_blocks(src, dst, handoff.blocks[-1:], imp.blocks[-1:])
    summaries = src.kv.summaries.read(handoff.blocks[first:len(ids) // src.kv.layout.block_size])
    blocks = dst.finish_handoff(imp, len(ids), first, summaries)
    decode.engine.add_handoff(ids, replace(handoff, blocks=blocks))
    moved = dst.block_bytes + sum(t.numel() * t.element_size() for t in summaries)
    return blocks, handoff.blocks, moved


def prefill_and_export(prefill: LLM, ids: list[int]) -> list[int]:
    """What a prefill worker does with a prompt: prefill it (a one-token greedy request), then hold
    its complete prefix blocks (``KVExchange.export``); returns them."""
    prefill.generate([ids], SamplingParams(max_tokens=1, temperature=0))
    return KVExchange(prefill.engine.runner.backend).export(ids)


@dataclass
class Imported:
    """A decode engine after ``decode_imported``: its outputs, its host store and the leases it let
    go, and what it did per step (``rows``: host rows in use after each; ``progress``: the requests
    it gave an output)."""
    outputs: list
    host: HostStore
    idle: list
    steps: int
    rows: list[int]
    progress: list[set[str]]
    admission_bytes: int = 0
    held: int = 0  # blocks the decode engine still held for exchanges at the end


def decode_imported(model: str, prompts: list[list[int]], params: SamplingParams, f_host: float,
                    down: tuple[str, ...] = (), slow: dict[str, float] | None = None,
                    partial: bool = False, **engine) -> Imported:
    """Prefill ``prompts`` on one engine, import every prompt's blocks into a decode engine (with
    ``f_host < 1`` located on the first one's store, as source ``prompt-i`` under lease ``i``;
    reads from sources in ``down`` fail, from sources in ``slow`` take that many seconds), then
    decode them all at once there. ``partial``: hand each prompt off instead (``hand_off``: only
    its last block and summaries move at admission; needs ``f_host < 1``). ``engine``: the
    engines' settings (tiered KV, a lookahead draft)."""
    prefill = LLM(model, **engine)
    decode = LLM(model, f_host=f_host, **engine)
    src, dst = KVExchange(prefill.engine.runner.backend), KVExchange(decode.engine.runner.backend)
    host, idle = dst.kv.host, []
    if isinstance(host, HostCache):
        host.reader = StoreTier(src.kv.host, host)
        host.reader.down.update(down)
        host.reader.slow.update(slow or {})
        host.on_lease_idle = idle.append
    moved = 0
    for lease, ids in enumerate(prompts):
        if partial:
            blocks, offered, nbytes = hand_off(prefill, decode, ids)
            host.locate(blocks[:-1], offered[:-1], f"prompt-{lease}", lease)
            moved += nbytes
            continue
        offered = prefill_and_export(prefill, ids)
        if len(offered) < len(src.prompt_hashes(ids)):
            raise RuntimeError("the prefill engine could not hold a prompt's blocks")
        imp = dst.begin_import(dst.prompt_hashes(ids)[:len(offered)])
        copy_blocks(src, dst, [offered[i] for i in imp.missing],
                    [imp.blocks[i] for i in imp.missing])
        dst.finish_import(imp)
        moved += len(imp.missing) * dst.block_bytes
        if isinstance(host, HostCache):
            host.locate(imp.blocks, offered, f"prompt-{lease}", lease)
    eng, finals, rows = decode.engine, {}, []
    for i, ids in enumerate(prompts):
        eng.add_request(ids, params, request_id=str(i))
    steps, progress = 0, []
    while eng.has_unfinished():
        outs = eng.step()
        for out in outs:
            if out.finished:
                finals[out.request_id] = out
        steps += 1
        rows.append(host.rows_in_use if isinstance(host, HostCache) else 0)
        progress.append({out.request_id for out in outs})
    eng.allocator.check_invariants([])
    return Imported([finals[str(i)] for i in range(len(prompts))], host, idle, steps, rows,
                    progress, moved, sum(eng.allocator.held.values()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--text", required=True, help='JSON file {"docs": [...]} of held-out text')
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=4096)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--f-host", default="0.2,0.5")
    parser.add_argument("--transfer", default="full",
                        help="full, partial or both (comma-separated)")
    parser.add_argument("--topk-blocks", type=int, default=32)
    parser.add_argument("--fetch-ratio", type=float, default=0.05)
    parser.add_argument("--draft", default="ngram")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args(argv)
    engine = dict(kv_mode="oasis", topk_blocks=args.topk_blocks, fetch_ratio=args.fetch_ratio,
                  draft=args.draft, device=args.device, dtype=args.dtype,
                  max_model_len=args.prompt_len + args.max_tokens + 16,
                  host_kv_gib=0.0)
    probe = LLM(args.model, **engine)
    prompts = windows(probe.engine, args.text, args.requests, args.prompt_len)
    lay = probe.engine.runner.backend.kv.layout
    del probe
    # the host store holds every prompt twice over: held blocks may fill at most half of it
    # (``kv.exchange.MAX_HELD_SHARE``), and the decode engine's rows with f_host < 1
    engine["host_kv_gib"] = 3 * args.requests * (args.prompt_len + args.max_tokens) * (
        lay.host_block_bytes / lay.block_size) / 2**30
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    full = decode_imported(args.model, prompts, params, 1.0, **engine)
    want = [o.token_ids for o in full.outputs]
    points = []
    runs = [(float(f), t) for f in args.f_host.split(",") for t in args.transfer.split(",")]
    for f_host, transfer in runs:
        run = decode_imported(args.model, prompts, params, f_host,
                              partial=transfer == "partial", **engine)
        s, n = run.host.stats, args.requests
        same = sum(o.token_ids == w for o, w in zip(run.outputs, want))
        points.append({"f_host": f_host, "transfer": transfer, "steps": run.steps, **asdict(s),
                       "admission_mb_per_request": run.admission_bytes / n / 1e6,
                       "misses_per_request_step": s.misses / n / max(1, run.steps),
                       "read_gb": s.bytes / 1e9,
                       "hit_rate": s.hits / max(1, s.hits + s.misses),
                       "rows_peak_per_request": max(run.rows) / n,
                       # after the first LRU pass, until the first request ends
                       "rows_mean_per_request": sum(run.rows[LRU_PERIOD:-1]) / max(
                           1, len(run.rows[LRU_PERIOD:-1])) / n,
                       "prompt_blocks_per_request": (args.prompt_len - 1) // lay.block_size,
                       "tokens_equal": f"{same}/{n}"})
    print(f"{'f_host':>6} {'transfer':>8} {'admit MB/req':>12} {'steps':>6} "
          f"{'misses/req/step':>16} {'read GB':>8} "
          f"{'evictions':>10} {'hit rate':>9} {'rows peak/req':>14} {'rows mean/req':>14} "
          f"{'prompt blocks/req':>18} {'tokens = f_host 1':>18}")
    for p in points:
        print(f"{p['f_host']:6.2f} {p['transfer']:>8} {p['admission_mb_per_request']:12.2f} "
              f"{p['steps']:6d} {p['misses_per_request_step']:16.2f} "
              f"{p['read_gb']:8.3f} {p['evictions']:10d} {p['hit_rate']:9.3f} "
              f"{p['rows_peak_per_request']:14.1f} {p['rows_mean_per_request']:14.1f} "
              f"{p['prompt_blocks_per_request']:18d} {p['tokens_equal']:>18}")
    print(json.dumps({"model": args.model, "requests": args.requests,
                      "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
                      "topk_blocks": args.topk_blocks, "fetch_ratio": args.fetch_ratio,
                      "draft": args.draft, "points": points}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
