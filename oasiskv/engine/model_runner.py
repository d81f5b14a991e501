"""ModelRunner: turns a ScheduledBatch into one forward pass and sampled tokens.

Owns the model, the attention backend (and so the KV storage), CUDA graphs and the sampler inputs.
Builds the step's ``ForwardBatch`` on the host (pinned memory, non-blocking copies on CUDA) with the
backend's ``prepare`` (its per-step meta, extra rows), runs the model inside ``forward_context`` or
replays a graph, computes logits only for the sequences' rows that need them, samples, and moves the
results to the host once per step; ``finish`` hands the step back to the backend. Knows nothing
about scheduling policy, text, or what a backend does with its lifecycle.

A step is ``launch`` (forward and sampling queued on the device, the results' copies to the host
started) then ``collect`` (wait for them, per-sequence results); ``run`` does both. Between the two
the engine may launch the next decode step (``launch(..., after=step)``), whose inputs are the
first step's sampled tokens still on the device, so that its host work overlaps the device's
(``LLMEngine``, async scheduling).
"""
from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from oasiskv.attention import BackendFactory, make_backend
from oasiskv.attention.base import StepStats
from oasiskv.config import EngineConfig, ModelConfig, parse_dtype
from oasiskv.engine.block_tables import BlockTableRows
from oasiskv.engine.cuda_graph import CudaGraphRunner
from oasiskv.engine.forward_batch import (ForwardBatch, StepRows, forward_context, to_device,
                                          to_device_many)
from oasiskv.engine.handoff import Handoff
from oasiskv.engine.scheduler import ScheduledBatch
from oasiskv.engine.sequence import Sequence, TokenLogprobs
from oasiskv.layers.parallel import TensorParallel, building
from oasiskv.layers.sampler import SamplingTensors, sample, token_logprobs
from oasiskv.models.loader import load_model

logger = logging.getLogger(__name__)

PROMPT_LOGITS_CHUNK = 1024


@dataclass
class StepResult:
    """Per scheduled sequence: the sampled token (None when a prefill chunk did not finish the
    prompt), its logprobs when asked, prompt logprobs computed in this step, and the ``Handoff``
    of a sequence with ``hand_off`` whose prefill this step ended (its ``blocks`` still empty)."""
    tokens: list[int | None]
    logprobs: list[TokenLogprobs | None]
    prompt_logprobs: list[list[TokenLogprobs]] = field(default_factory=list)
    handoffs: dict[int, Handoff] = field(default_factory=dict)


@dataclass
class LaunchedStep:
    """A step whose forward and sampling are queued on the device and whose results are on their
    way to the host (``ModelRunner.launch``; ``collect`` reads them). ``sampled``: the sequences
    that get a next token, in ``tokens``'s order; ``tokens``: those tokens ``[n]`` int64 on the
    device (None when none samples), what a next decode step can take as its inputs; ``host``:
    their host copies, then the logprob tensors' when asked; ``copied``: recorded after those
    copies on CUDA (None on a CPU, whose copies are done)."""
    batch: ScheduledBatch
    result: StepResult
    sampled: list[Sequence]
    tokens: torch.Tensor | None = None
    host: list[torch.Tensor] = field(default_factory=list)
    copied: torch.cuda.Event | None = None
    #: the random generators its sampling drew from, each with its state before (``drop``)
    rng: list[tuple[torch.Generator, torch.Tensor]] = field(default_factory=list)


def resolve_device(name: str) -> torch.device:
    """``auto`` | ``cpu`` | ``cuda`` | ``cuda:N`` -> a device; CUDA devices always carry an
    index."""
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if name == "auto"
                          else name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but no CUDA GPU is available; "
                         f"use --device cpu")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


#: CPU steps with fewer tokens run on one intra-op thread. Measured on a 2-core machine, demo model,
#: greedy decode, one and two threads alternating in one process (medians of 6): batch 1, 335 and
#: 329 tok/s, but 149 and 59 while another process keeps one core busy; batch 16, 2,247 and 2,604,
#: but 1,970 and 762 with the busy core. A second thread pays only on an idle core.
SMALL_STEP_TOKENS = 16


def cpu_threads(requested: int, step_tokens: int) -> int:
    """Intra-op threads for a CPU step of ``step_tokens`` tokens: ``requested`` when > 0; else one
    below ``SMALL_STEP_TOKENS`` tokens and every core this process may run on above."""
    if requested > 0:
        return requested
    if step_tokens < SMALL_STEP_TOKENS:
        return 1
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def resolve_dtype(name: str, model_config: ModelConfig, device: torch.device) -> torch.dtype:
    """``auto`` -> the checkpoint's dtype on CUDA, float32 elsewhere (CPUs are slow at 16-bit
    math)."""
    return parse_dtype(name) or (model_config.dtype if device.type == "cuda" else torch.float32)


class ModelRunner:
    """``tp``: this runner's rank of a tensor-parallel engine (``engine/tensor_parallel.py``; one
    rank when None); ``driver``: rank 0's, which sends each step to the other ranks before it runs
    here (and gives ``tp``)."""

    def __init__(self, config: EngineConfig, model_path: Path, model_config: ModelConfig,
                 backend_factory: BackendFactory = make_backend, driver=None,
                 tp: TensorParallel | None = None):
        self.config, self.model_config, self.driver = config, model_config, driver
        self.tp = driver.tp if driver is not None else tp or TensorParallel()
        self.device = resolve_device(config.device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # weights, pools and graphs live on it
        self.dtype = resolve_dtype(config.dtype, model_config, self.device)
        max_len = config.max_model_len or model_config.max_position_embeddings
        with building(self.tp):
            self.model = load_model(model_path, model_config, self.dtype, self.device,
                                    max(max_len, model_config.max_position_embeddings),
                                    config.load_format)
        self.backend = backend_factory(config, self.model, self.dtype, self.device)
        self.backend.allocate(self._shared_budget() if self.device.type == "cuda" else None)
        self.max_model_len = min(max_len, self.backend.max_tokens_per_seq)
        if self.max_model_len < max_len:
            logger.warning("max_model_len lowered from %d to %d: the KV storage holds only %d "
                           "tokens per sequence", max_len, self.max_model_len,
                           self.backend.max_tokens_per_seq)
        self.max_blocks_per_seq = -(-self.max_model_len // config.block_size)
        self.generator = torch.Generator(self.device).manual_seed(config.seed)
        #: host work that can wait for the device (the engine's release of ended requests): called
        #: once a step's kernels are launched, before its tokens are read, with ``_running``, which
        #: it calls for a probe when it has work: true while the device still runs them (always on
        #: a CPU, whose kernels ran already)
        self.while_busy: Callable[[Callable[[], Callable[[], bool]]], None] = lambda running: None
        self.block_tables = BlockTableRows(config.max_num_seqs)
        self.graphs: CudaGraphRunner | None = None
        if (self.device.type == "cuda" and not config.enforce_eager
                and self.backend.supports_cuda_graphs):
            self.graphs = CudaGraphRunner(self.model, self.backend,
                                          min(config.max_graph_batch, config.max_num_seqs),
                                          self.max_blocks_per_seq, self.device)

    def _shared_budget(self) -> int:
        """``_measure_budget``, the smallest over the tensor-parallel ranks (their KV pools must
        have the same blocks: rank 0 allocates for all)."""
        budget = self._measure_budget()
        if self.tp.size > 1:
            shared = torch.tensor([budget], device=self.device)
            torch.distributed.all_reduce(shared, op=torch.distributed.ReduceOp.MIN,
                                         group=self.tp.group)
            budget = int(shared.item())
        return budget

    def _measure_budget(self) -> int:
        """Warm up with the largest prefill, then return the device bytes
        ``gpu_memory_utilization`` leaves for KV storage."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        n = min(self.config.max_num_batched_tokens, self.model_config.max_position_embeddings)
        warm = ForwardBatch(True, torch.zeros(n, dtype=torch.long, device=self.device),
                            torch.arange(n, device=self.device),
                            torch.full((n,), -1, device=self.device),
                            torch.zeros((1, 1), dtype=torch.int32, device=self.device),
                            torch.tensor([n], dtype=torch.int32, device=self.device), [n], [0])
        with torch.inference_mode(), forward_context(warm, self.backend):
            hidden = self.model(warm.input_ids, warm.positions)
            self.model.compute_logits(hidden[: self.config.max_num_seqs])
        torch.cuda.synchronize(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        used_by_others = total - free - torch.cuda.memory_reserved(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        return max(0, int(total * self.config.gpu_memory_utilization - used_by_others - peak))

    # ---- one step --------------------------------------------------------------------------------
    def run(self, batch: ScheduledBatch, forced: list[int | None] | None = None) -> StepResult:
        """One step: ``launch`` then ``collect``."""
        return self.collect(self.launch(batch, forced))

    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch, forced: list[int | None] | None = None,
               after: LaunchedStep | None = None, rows: list[int] | None = None) -> LaunchedStep:
        """Queue one step on the device: forward, then the next token of every sequence whose
        tokens are all computed: sampled, or ``forced[i]`` where that is not None (teacher
        forcing; its logprobs score it). A ``handoff`` batch runs no forward: the backend's
        ``admit``. ``after``: a decode step's token ids are ``after.tokens[rows]`` on the device,
        not the sequences' newest tokens (which the host does not know yet)."""
        if self.driver is not None:
            if batch.handoff or any(s.hand_off for s in batch.seqs):
                raise ValueError("a tensor-parallel engine neither takes nor hands off prompts")
            self.driver.step(batch, forced, self.backend.sequence_state)
        # (the device current: the step's events and copies go on its stream, whichever thread
        # drives the engine)
        with self._ranks_in_step(), self._device_scope():
            inputs = None
            if after is not None:
                inputs = (after.tokens if rows == list(range(len(after.sampled))) else
                          after.tokens[self._to_device(rows, torch.long)])
            if batch.handoff:
                hidden = self.backend.admit(batch)
            else:
                hidden = self.forward(batch, inputs)
            step = self._launch_sample(batch, hidden, forced)
            if batch.is_prefill and not batch.handoff:
                self._hand_off(batch, hidden, step.result)
            return step

    def drop(self, step: LaunchedStep) -> None:
        """A launched step whose results no one takes: wait for it and put the generators it drew
        from back as they were, as if it never ran (a later step draws the same numbers)."""
        self.collect(step)
        for generator, state in step.rng:
            generator.set_state(state)

    @property
    def steps_ahead(self) -> bool:
        """Whether a decode step may be launched before the previous one is collected (one rank,
        and a backend that allows it: ``AttentionBackend.steps_ahead``)."""
        return self.driver is None and self.backend.steps_ahead

    def _hand_off(self, batch: ScheduledBatch, hidden: torch.Tensor, result: StepResult) -> None:
        """The ``Handoff`` of each sequence with ``hand_off`` whose prefill this step ended."""
        end = 0
        for i, (seq, n, ends) in enumerate(zip(batch.seqs, batch.num_tokens,
                                               batch.ends_prefill)):
            end += n
            if seq.hand_off and ends and not seq.output_token_ids:
                result.handoffs[i] = Handoff(hidden[end - 1].float().cpu(),
                                             self.backend.handoff_queries(i))

    @torch.inference_mode()
    def idle(self) -> bool:
        """The backend's ``idle``, when the engine has no request to run (rank 0)."""
        with self._device_scope():
            return self.backend.idle()

    @torch.inference_mode()
    def held_back(self) -> tuple[set[int], dict[int, str]]:
        """The backend's ``held_back``, between steps (rank 0; tensor-parallel engines wait for
        their reads instead, so that every rank runs the same batch)."""
        with self._device_scope():
            return self.backend.held_back()

    @torch.inference_mode()
    def finish(self, batch: ScheduledBatch) -> StepStats:
        """After ``run`` and once its tokens are appended: the backend's end of the step (its
        deferred work, its counters)."""
        if self.driver is not None:
            self.driver.finish(batch)
        with self._ranks_in_step(), self._device_scope():
            return self.backend.finish(batch)

    @contextlib.contextmanager
    def _ranks_in_step(self):
        """Rank 0 of a tensor-parallel engine, in a step the other ranks run too: a failure here
        leaves them waiting in its collectives for good, so the driver stops them."""
        try:
            yield
        except Exception as exc:
            if self.driver is not None:
                self.driver.abort(f"rank 0's step failed ({type(exc).__name__}: {exc})")
            raise

    @torch.inference_mode()
    def forward(self, batch: ScheduledBatch, inputs: torch.Tensor | None = None) -> torch.Tensor:
        """Run the model over the batch's new tokens -> final hidden states ``[T, hidden]`` (the
        sequences' tokens, then the backend's extra rows; ``inputs``: see ``launch``). Runs with
        the engine's GPU current (Triton launches on the current device; callers may be other
        threads)."""
        with self._device_scope():
            rows = self._rows(batch)
            if not batch.is_prefill and self.graphs is not None:
                hidden = self.graphs.run(rows, batch.seqs, self.block_tables, inputs)
                if hidden is not None:
                    return hidden
            fb = self._upload(batch, rows)
            if inputs is not None:
                fb.input_ids[:len(inputs)].copy_(inputs)
            if self.device.type == "cpu":
                threads = cpu_threads(self.config.cpu_threads, fb.input_ids.shape[0])
                if threads != torch.get_num_threads():
                    torch.set_num_threads(threads)
            with forward_context(fb, self.backend):
                return self.model(fb.input_ids, fb.positions)

    def _running(self) -> Callable[[], bool]:
        """Whether the work launched so far on the current stream is still running (a CPU's:
        always true, see ``while_busy``)."""
        if self.device.type != "cuda":
            return lambda: True
        done = torch.cuda.Event()
        done.record()
        return lambda: not done.query()

    def _device_scope(self):
        return (torch.cuda.device(self.device) if self.device.type == "cuda"
                else contextlib.nullcontext())

    @torch.inference_mode()
    def next_token_logits(self, batch: ScheduledBatch,
                          hidden: torch.Tensor) -> tuple[list[Sequence], torch.Tensor]:
        """The sequences that get a next token this step and their logits ``[n, vocab]``
        (float32)."""
        rows, seqs, end = [], [], 0
        for seq, n, samples in zip(batch.seqs, batch.num_tokens, batch.samples):
            end += n
            if samples:
                rows.append(end - 1)
                seqs.append(seq)
        if rows == list(range(len(rows))):  # decode: the first rows (extra rows follow them)
            hidden = hidden[:len(rows)]
        elif len(rows) < hidden.shape[0]:  # prefill chunks: only sequences' last rows
            hidden = hidden[self._to_device(rows, torch.long)]
        return seqs, self.model.compute_logits(hidden)

    def _to_device(self, data, dtype) -> torch.Tensor:
        return to_device(data, dtype, self.device)

    def _rows(self, batch: ScheduledBatch) -> StepRows:
        """The step's rows on the host, the backend's extra rows after the sequences' (its
        ``prepare`` runs here), and the backend's meta."""
        bs, seqs = self.config.block_size, batch.seqs
        if batch.is_prefill:
            ids, pos, slots = [], [], []
            for seq, n in zip(seqs, batch.num_tokens):
                start, table = seq.num_computed_tokens, seq.block_table
                ids += seq.token_ids[start:start + n]
                pos += range(start, start + n)
                slots += [table[p // bs] * bs + p % bs for p in range(start, start + n)]
        else:  # a decode step computes one token of each sequence: the first not computed
            pos = [s.num_computed_tokens for s in seqs]
            ids = [s.token_ids[p] for s, p in zip(seqs, pos)]
            slots = [s.block_table[p // bs] * bs + p % bs for s, p in zip(seqs, pos)]
        ctx = [s.num_computed_tokens + n for s, n in zip(seqs, batch.num_tokens)]
        plan = self.backend.prepare(batch)
        return StepRows(ids + plan.extra_ids, pos + plan.extra_positions,
                        slots + [-1] * len(plan.extra_ids), ctx, plan.meta)

    def _upload(self, batch: ScheduledBatch, rows: StepRows) -> ForwardBatch:
        """The eager step's ``ForwardBatch``: its rows and block tables in one host-to-device
        copy."""
        tables = self.block_tables.build(batch.seqs)
        return ForwardBatch(batch.is_prefill, *to_device_many(
            [(rows.ids, torch.long), (rows.positions, torch.long), (rows.slots, torch.long),
             (tables, torch.int32), (rows.context_lens, torch.int32)], self.device),
            list(batch.num_tokens), [s.num_computed_tokens for s in batch.seqs], rows.meta)

    def _launch_sample(self, batch: ScheduledBatch, hidden: torch.Tensor,
                       forced: list[int | None] | None = None) -> LaunchedStep:
        result = StepResult([None] * len(batch), [None] * len(batch), [[] for _ in batch.seqs])
        if batch.is_prefill:
            self._prompt_logprobs(batch, hidden, result)
        sampled_seqs, logits = self.next_token_logits(batch, hidden)
        step = LaunchedStep(batch, result, sampled_seqs)
        if not sampled_seqs:
            return step
        st = self._sampling_tensors(sampled_seqs)
        if not st.all_greedy:
            step.rng = [(g, g.get_state()) for g in
                        [self.generator] + [g for g in st.generators if g is not None]]
        out = sample(logits, st, self.generator)
        if forced is not None:  # teacher forcing: the forced tokens, scored in their place
            index = {id(s): i for i, s in enumerate(batch.seqs)}
            want = [forced[index[id(s)]] for s in sampled_seqs]
            if any(t is not None for t in want):
                given = self._to_device([-1 if t is None else t for t in want], torch.long)
                out.tokens = torch.where(given >= 0, given, out.tokens)
                if st.max_logprobs >= 0:
                    out.token_logprobs, out.top_ids, out.top_logprobs = token_logprobs(
                        logits, out.tokens, st.max_logprobs)
        step.tokens = out.tokens
        wanted = [out.tokens] + ([out.token_logprobs, out.top_ids, out.top_logprobs]
                                 if out.top_ids is not None else [])
        if self.device.type == "cuda":  # (copies queued now: a step launched next queues after)
            step.host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in wanted]
            for host, t in zip(step.host, wanted):
                host.copy_(t, non_blocking=True)
            step.copied = torch.cuda.Event()
            step.copied.record()
        else:
            step.host = wanted
        return step

    @torch.inference_mode()
    def collect(self, step: LaunchedStep) -> StepResult:
        """Wait for a launched step's results -> its ``StepResult``."""
        with self._ranks_in_step():
            with self._device_scope():  # (the step's work is launched, sampling included)
                self.backend.during_step()
                self.while_busy(self._running)
            result = step.result
            if not step.sampled:
                return result
            if step.copied is not None:
                step.copied.synchronize()
            tokens = step.host[0].tolist()
            lps = _logprob_lists(*step.host[1:]) if len(step.host) > 1 else None
            index = {id(s): i for i, s in enumerate(step.batch.seqs)}
            for j, seq in enumerate(step.sampled):
                i = index[id(seq)]
                result.tokens[i] = tokens[j]
                if lps is not None and seq.params.logprobs is not None:
                    lp, top_ids, top_lps = lps[j]
                    n = seq.params.logprobs
                    result.logprobs[i] = TokenLogprobs(tokens[j], lp,
                                                       list(zip(top_ids[:n], top_lps[:n])))
            return result

    def _prompt_logprobs(self, batch: ScheduledBatch, hidden: torch.Tensor, result: StepResult):
        """Logprobs of prompt tokens this chunk predicts: row p scores token p + 1."""
        ends = np.cumsum(batch.num_tokens).tolist()
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_tokens)):
            want = seq.params.prompt_logprobs
            start = seq.num_computed_tokens
            if want is None:
                continue
            first = max(start, len(seq.prompt_logprobs))  # tokens 1..len already scored (recompute)
            # positions first..last-1 score prompt tokens
            last = min(start + n, seq.num_prompt_tokens - 1)
            for a in range(first, last, PROMPT_LOGITS_CHUNK):
                b = min(a + PROMPT_LOGITS_CHUNK, last)
                rows = hidden[ends[i] - n + (a - start): ends[i] - n + (b - start)]
                targets = torch.tensor(seq.prompt_token_ids[a + 1:b + 1], device=hidden.device)
                lp, ids, lps = token_logprobs(self.model.compute_logits(rows), targets, want)
                for tok, (l, t, tl) in zip(targets.tolist(), _logprob_lists(lp, ids, lps)):
                    result.prompt_logprobs[i].append(TokenLogprobs(tok, l, list(zip(t, tl))))

    def _sampling_tensors(self, seqs: list[Sequence]) -> SamplingTensors:
        p = [s.params for s in seqs]
        max_logprobs = max((x.logprobs for x in p if x.logprobs is not None), default=-1)
        if all(x.greedy for x in p):  # the common case copies nothing to the device
            return SamplingTensors(None, None, None, None, [], True, False, max_logprobs)
        temperature, top_k, top_p, min_p = to_device_many(
            [([0.0 if x.greedy else x.temperature for x in p], torch.float32),
             ([x.top_k for x in p], torch.long), ([x.top_p for x in p], torch.float32),
             ([x.min_p for x in p], torch.float32)], self.device)
        return SamplingTensors(
            temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
            generators=[self._seq_generator(s) for s in seqs],
            all_greedy=False,
            needs_filter=any(x.top_k > 0 or x.top_p < 1.0 or x.min_p > 0
                             for x in p if not x.greedy),
            max_logprobs=max_logprobs,
        )

    def _seq_generator(self, seq: Sequence) -> torch.Generator | None:
        if seq.params.seed is None or seq.params.greedy:
            return None
        if seq.sampler_generator is None:
            seq.sampler_generator = torch.Generator(self.device).manual_seed(seq.params.seed)
        return seq.sampler_generator


def _logprob_lists(chosen, top_ids, top_lps) -> list[tuple[float, list[int], list[float]]]:
    """Host logprob tensors -> per-row tuples."""
    return list(zip(chosen.tolist(), top_ids.tolist(), top_lps.tolist()))
