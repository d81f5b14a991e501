"""Guardrail: online fidelity of tiered decode (``--guardrail-rate R``; off at 0).

Each decode step, every sequence row is sampled with probability R (host RNG, at ``prepare``); a
sampled row is measured at one layer drawn uniformly, so a fraction R / num_layers of the (request,
layer, step) triples is measured (``every_layer``, for harnesses such as the eval: at every
layer). Every decode step writes taps (inside captured graphs too): per layer, the rows' queries
and the block slots each kv head attended (``tap``, after attention and before the lookahead
selection rewrites them). After the step (``measure``) each sampled row's
query is compared with exact attention over the row's whole context at that layer, read from the
host store:

- attention recall: the share of the exact attention mass (mean over the query heads) that falls on
  tokens the row attended (its kv head's resident blocks plus its local block);
- output relative error: ``|o_ws - o| / |o|`` over the row's heads, o the exact attention output and
  o_ws the attention renormalised over the attended tokens (what sparse decode computed);
- top-K agreement: the share of the blocks this query would select itself (its top-K complete blocks
  by summary score, per kv head) that the working set held: how well the set chosen for it (one
  step ahead, by a predicted query, under the fetch cap) matches the set the real query picks.

On CUDA the measurement runs on a side stream and never blocks the host: its indices go up in one
non-blocking copy, and a later step's ``measure`` reads the measurements that have finished by
then (so a sample whose request ends, and whose host blocks a new prompt overwrites meanwhile, may
read the new contents; rare, and it only touches the measurement). At most ``MAX_PENDING``
measurements are in flight: a step's samples beyond that are dropped and counted
(``take_dropped``), which bounds the side stream's share of the GPU and of PCIe (``every_layer``
harnesses drop nothing). Cost: with R > 0, two small copies per layer per step (the taps); per
sampled row, one layer's K and V of its context over PCIe (32K tokens, 8 kv heads, bf16: 134 MB)
and a dense attention of one query.
Results: ``StepStats.samples`` ``guardrail_recall``, ``guardrail_rel_error`` and
``guardrail_topk_agreement`` (histograms on /metrics), and ``last``: (request id, position, layer,
recall, relative error) per sample of the measurements read last, for harnesses.
"""
from __future__ import annotations

import logging
import random
from collections import deque

import torch

from oasiskv.engine.forward_batch import to_device_many
from oasiskv.kv.tiered import DecodeRows, TieredKV

logger = logging.getLogger(__name__)


#: bytes of float32 K the exact attention of one sample holds at a time (as many of V, and the
#: gathered copies): 16K tokens of an 8-kv-head, 128-dim model. Fewer, larger chunks mean fewer
#: launches on the host, which is the measurement's price on the step (about 1 ms per chunk).
CHUNK_BYTES = 1 << 26
#: measurements in flight on the side stream at most (CUDA); more samples are dropped
MAX_PENDING = 4


class Guardrail:
    """For ``kv``'s model (``num_q_heads`` query heads), sampling at ``rate``."""

    def __init__(self, kv: TieredKV, rate: float, num_q_heads: int, seed: int = 0):
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"guardrail rate must be in [0, 1], got {rate}")
        self.kv, self.rate, self.num_q_heads = kv, rate, num_q_heads
        self.every_layer = False
        self._rng = random.Random(seed)
        self._q: torch.Tensor | None = None  # [L, rows, Hq, D]
        self._maps: torch.Tensor | None = None  # [L, rows, Hk, K]
        self._scale = 1.0
        self._picked: list[tuple] = []  # (row, layer, request id, position, host blocks)
        self._pending: deque[tuple] = deque()  # (event, host results [n, 3], picked), oldest first
        self._dropped = 0
        self._stream = (torch.cuda.Stream(kv.device) if kv.device.type == "cuda" and rate > 0
                        else None)
        self.last: list[tuple[str, int, int, float, float]] = []

    @property
    def active(self) -> bool:
        return self.rate > 0

    def allocate(self, max_rows: int) -> int:
        """The tap buffers for up to ``max_rows`` decode rows; returns their bytes (0 when off)."""
        if not self.active:
            return 0
        lay = self.kv.layout
        self._q = torch.zeros((lay.num_layers, max_rows, self.num_q_heads, lay.head_dim),
                              dtype=lay.dtype, device=self.kv.device)
        self._maps = torch.full((lay.num_layers, max_rows, lay.num_kv_heads, lay.topk_blocks), -1,
                                dtype=torch.int32, device=self.kv.device)
        return self._q.numel() * self._q.element_size() + self._maps.numel() * 4

    def warm_up(self) -> None:
        """One measurement of a made-up sample (row 0 at layer 0, three blocks of the host store:
        contents whatever they are), waited for: the kernels it launches compile and load now,
        not in a served step (once, about a second on CUDA). Call after the storage exists."""
        if not self.active or self.kv.host.num_blocks < 3:
            return
        pos = 3 * self.kv.layout.block_size - 2  # two complete blocks and a partial one
        self._launch([(0, 0, None, pos, [0, 1, 2])])
        self._collect(wait=True)

    def pick(self, seqs: list, positions: list[int]) -> None:
        """Sample this step's decode rows (``seqs`` with the positions they compute; none for a
        prefill step)."""
        self._picked = []
        if not self.active:
            return
        B, layers = self.kv.layout.block_size, self.kv.layout.num_layers
        for row, (seq, pos) in enumerate(zip(seqs, positions)):
            if self._rng.random() < self.rate:
                table = list(seq.block_table[: pos // B + 1])
                for layer in range(layers) if self.every_layer else [self._rng.randrange(layers)]:
                    self._picked.append((row, layer, seq.request_id, pos, table))

    def tap(self, layer: int, q: torch.Tensor, rows: DecodeRows, scale: float) -> None:
        """Keep ``layer``'s queries ``[N, Hq, D]`` and the blocks each row's heads attended."""
        if not self.active:
            return
        n, K = q.shape[0], self.kv.layout.topk_blocks
        self._scale = scale
        self._q[layer, :n].copy_(q)
        self._maps[layer, :n].copy_(self.kv.ws.map[layer][rows.slots, :, :K])

    def measure(self) -> dict[str, list[float]]:
        """Measure this step's sampled rows (on the side stream on CUDA, without waiting for it);
        returns the samples of the measurements finished by now (on CPU, this one)."""
        picked, self._picked = self._picked, []
        done = self._collect(wait=False)  # (finished ones leave room first)
        if picked and not self.every_layer and len(self._pending) >= MAX_PENDING:
            self._dropped += len(picked)
        elif picked:
            try:  # an observation: its failure (e.g. out of memory) must not fail the step
                self._launch(picked)
            except Exception:  # noqa: BLE001
                logger.exception("the guardrail's measurement failed; its samples are dropped")
                self._dropped += len(picked)
        return self._report(done + self._collect(wait=False))  # (on CPU: this one too)

    def drain(self) -> dict[str, list[float]]:
        """The samples of the measurements still running, waiting for them; {} when none.
        ``last`` then names their positions."""
        return self._report(self._collect(wait=True))

    def take_dropped(self) -> int:
        """Samples dropped since the last call (``MAX_PENDING`` measurements in flight, or a
        measurement that failed)."""
        dropped, self._dropped = self._dropped, 0
        return dropped

    def _launch(self, picked: list) -> None:
        # every index in one non-blocking upload, ordered before the side stream's work
        sizes = [len(p[4]) for p in picked]
        flat = [block for p in picked for block in p[4]]
        rows, layers, tables = to_device_many(
            [([p[0] for p in picked], torch.long), ([p[1] for p in picked], torch.long),
             (flat, torch.int32)], self.kv.device)
        q, maps = self._q[layers, rows], self._maps[layers, rows]
        tables = tables.split(sizes)
        if self._stream is None:
            self._pending.append((None, self._exact(picked, q, maps, tables), picked))
            return
        self._stream.wait_stream(torch.cuda.current_stream())
        for t in (q, maps, *tables):
            t.record_stream(self._stream)
        with torch.cuda.stream(self._stream):
            results = self._exact(picked, q, maps, tables)
            # read back on the side stream: a copy on the step's stream would wait for its work
            host = torch.empty(results.shape, dtype=results.dtype, pin_memory=True)
            host.copy_(results, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        self._pending.append((event, host, picked))

    def _collect(self, wait: bool) -> list[tuple[tuple, list[float]]]:
        """(pick, [recall, error, agreement]) of the finished measurements, oldest first (all of
        them when ``wait``)."""
        done = []
        while self._pending and (wait or self._pending[0][0] is None
                                 or self._pending[0][0].query()):
            event, results, picked = self._pending.popleft()
            if event is not None:
                event.synchronize()
            done += zip(picked, results.tolist())
        return done

    def _report(self, done: list[tuple[tuple, list[float]]]) -> dict[str, list[float]]:
        """The samples of ``done`` by histogram; ``last`` names their positions."""
        if not done:
            return {}
        self.last = [(p[2], p[3], p[1], r, e) for p, (r, e, _) in done]
        return {"guardrail_recall": [r for _, (r, _, _) in done],
                "guardrail_rel_error": [e for _, (_, e, _) in done],
                "guardrail_topk_agreement": [a for _, (_, _, a) in done if a >= 0]}

    def _exact(self, picked: list, q: torch.Tensor, maps: torch.Tensor,
               tables: list[torch.Tensor]) -> torch.Tensor:
        """float32 ``[n, 3]``: (recall, relative error, top-K agreement; -1 without a complete
        block) of each picked row."""
        lay, B = self.kv.layout, self.kv.layout.block_size
        out = torch.empty((len(picked), 3), dtype=torch.float32, device=q.device)
        for i, ((_, layer, _, pos, _), blocks) in enumerate(zip(picked, tables)):
            nblocks = pos // B + 1
            ids = torch.arange(nblocks, device=q.device)
            held = (ids[None, :, None] == maps[i].long()[:, None, :]).any(-1)   # [Hk, blocks]
            held[:, -1] = True                                                  # the local block
            qh = q[i].float().view(lay.num_kv_heads, -1, lay.head_dim)         # [Hk, G, D]
            exact, sparse, mass = self._attend(layer, qh, blocks, pos + 1, held)
            out[i, 0] = mass.mean()
            out[i, 1] = (sparse - exact).norm() / exact.norm().clamp_min(1e-30)
            out[i, 2] = self._topk_agreement(layer, q[i], blocks, pos // B, maps[i])
        return out

    def _attend(self, layer: int, qh: torch.Tensor, blocks: torch.Tensor, length: int,
                held: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Exact attention of ``qh`` ``[Hk, G, D]`` over the first ``length`` tokens of host
        ``blocks``, and over the ``held`` ``[Hk, blocks]`` ones only -> (exact ``[Hk, G, D]``,
        held-only, the held share of the attention mass ``[Hk, G]``), float32, in chunks of
        ``CHUNK_BYTES`` with an online softmax: device memory stays bounded at any context."""
        lay = self.kv.layout
        B = lay.block_size
        chunk = max(B, CHUNK_BYTES // (4 * lay.num_kv_heads * lay.head_dim) // B * B)
        m = torch.full(qh.shape[:2], float("-inf"), device=qh.device)
        total, kept = torch.zeros_like(m), torch.zeros_like(m)
        exact, sparse = torch.zeros_like(qh), torch.zeros_like(qh)
        for start in range(0, length, chunk):
            end = min(start + chunk, length)
            k, v = (x.float() for x in self.kv.host_kv(layer, blocks[start // B:],
                                                       end - start))          # [Hk, c, D]
            s = qh @ k.transpose(1, 2) * self._scale                           # [Hk, G, c]
            m_new = torch.maximum(m, s.amax(-1))
            alpha = torch.exp(m - m_new)
            p = torch.exp(s - m_new[..., None])
            mine = held[:, start // B:].repeat_interleave(B, dim=1)[:, None, :end - start]
            total = total * alpha + p.sum(-1)
            kept = kept * alpha + (p * mine).sum(-1)
            exact = exact * alpha[..., None] + p @ v
            sparse = sparse * alpha[..., None] + (p * mine) @ v
            m = m_new
        return (exact / total[..., None], sparse / kept.clamp_min(1e-30)[..., None],
                kept / total)

    def _topk_agreement(self, layer: int, q: torch.Tensor, table: torch.Tensor, complete: int,
                        held: torch.Tensor) -> torch.Tensor | float:
        """Mean over kv heads of |top-K of q's own summary scores & held| / |top-K| (-1 when the
        row has no complete block); ``held`` ``[Hk, K]`` logical blocks, -1 empty."""
        if complete == 0:
            return -1.0
        scores = self.kv.summaries.scores(
            layer, q[None], table[None, :complete],
            torch.full((1,), complete, dtype=torch.int32, device=q.device))[0]   # [Hk, complete]
        top = scores.topk(min(self.kv.layout.topk_blocks, complete), dim=-1).indices
        return (top[:, :, None] == held.long()[:, None, :]).any(-1).float().mean()
