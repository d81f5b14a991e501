"""LLMEngine: requests in, incremental outputs out, one ``step()`` at a time.

``add_request`` validates everything about a request before it touches engine state (bad input
raises ValueError and changes nothing). ``step`` schedules, runs the model once, appends sampled
tokens, applies stopping rules and returns a ``RequestOutput`` for every request that advanced or
finished. A failure inside a step finishes that step's requests with ``finish_reason="error"`` and
leaves the others running. Not thread-safe: one thread drives an engine.

Async scheduling (``EngineConfig.async_scheduling``; dense KV on one rank): before a decode step's
tokens are read, the next decode step of the same requests is launched with those tokens as its
inputs on the device, and the next ``step`` call collects it; the host's work between steps
(stopping rules, text, outputs, the next launch) then overlaps the device's. Outputs are the same
as one step at a time: a request that a step's token ends by length sits out the next step, one
that ends otherwise (a stop token or string, an abort) has that step's row dropped.
"""
from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from oasiskv.attention import BackendFactory, make_backend
from oasiskv.attention.base import StepStats
from oasiskv.config import EngineConfig, ModelConfig
from oasiskv.engine.detokenizer import Detokenizer
from oasiskv.engine.handoff import Handoff, HandoffTable
from oasiskv.engine.model_runner import LaunchedStep, ModelRunner
from oasiskv.engine.scheduler import ScheduledBatch, Scheduler
from oasiskv.engine.sequence import Sequence, TokenLogprobs
from oasiskv.models.loader import resolve_model_path
from oasiskv.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

#: seconds a step with nothing to run waits when running requests are held (their KV is being read)
HELD_WAIT_S = 0.0005
#: a sequence's newest token while the step that samples it runs and the next one is launched
#: (async scheduling): never fed to the model, never seen outside a step
PLACEHOLDER_TOKEN = -1


@dataclass
class RequestOutput:
    """A request's state after a step. ``new_*`` fields hold what this step added (for streaming);
    ``text`` excludes stop strings and, while running, a held-back tail that may start one."""
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None
    logprobs: list[TokenLogprobs] | None = None
    new_logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs] | None = None
    error: str | None = None
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None



@dataclass
class EngineStats:
    """Counters and gauges a server exports; updated after every step."""
    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_total: int = 0
    kv_blocks_free: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    num_preemptions: int = 0
    num_steps: int = 0
    num_steps_ahead: int = 0  # decode steps launched before the previous step's tokens were read
    last_step_seconds: float = 0.0
    last_batch_size: int = 0
    last_step_prefill: bool = False
    # the backend's counters of the last step (tiered KV: fetches, ...)
    kv: dict = field(default_factory=dict)
    kv_totals: dict = field(default_factory=dict)  # its counters summed over all steps
    kv_per_layer: dict = field(default_factory=dict)  # the backend's per-layer counts, last step
    kv_per_layer_totals: dict = field(default_factory=dict)  # those summed over all steps
    kv_samples: dict = field(default_factory=dict)  # the backend's observations, last step


@dataclass
class _Request:
    seq: Sequence
    detok: Detokenizer
    emitted_tokens: int = 0
    emitted_text: int = 0
    emitted_logprobs: int = 0
    error: str | None = None


class LLMEngine:
    """``LLMEngine(config)`` or ``LLMEngine(**settings)`` (flat ``EngineConfig`` / ``TierConfig``
    fields). ``backend_factory`` builds the attention backend (default ``make_backend``: by
    ``kv_mode``); benchmarks and tests pass one that adds their probes."""

    def __init__(self, config: EngineConfig | None = None,
                 backend_factory: BackendFactory = make_backend, **settings):
        config = config or EngineConfig.from_flat(**settings)
        self.config = config
        self.model_path = resolve_model_path(config.model)
        self.model_config = ModelConfig.from_file(self.model_path / "config.json")
        self.tokenizer = _load_tokenizer(self.model_path)
        self.driver = None
        if config.tensor_parallel_size > 1:
            from oasiskv.engine.tensor_parallel import TensorParallelDriver
            self.driver = TensorParallelDriver(config, self.model_path, backend_factory)
        try:
            self.runner = ModelRunner(config, self.model_path, self.model_config, backend_factory,
                                      self.driver)
        except Exception:
            self.close()
            raise
        self.max_model_len = self.runner.max_model_len
        self.allocator = self.runner.backend.make_allocator()
        self.scheduler = Scheduler(self.allocator, config.max_num_seqs,
                                   config.max_num_batched_tokens)
        self.eos_token_ids = set(self.model_config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        self.requests: dict[str, _Request] = {}
        #: requests that ended, let go of while the device runs a later step (``_release_ended``)
        self._ended: list[Sequence] = []
        self.runner.while_busy = self._release_ended
        #: async scheduling in effect: decode steps launched before the previous step's tokens are
        #: read (``config.async_scheduling`` where the runner allows it; may be switched off
        #: between steps)
        self.steps_ahead = config.async_scheduling and self.runner.steps_ahead
        self._ahead: LaunchedStep | None = None  # the step launched ahead, not collected yet
        #: handoffs of prompts prefilled here for another engine, by request id (``take_handoff``)
        self.handed_off = HandoffTable(lambda blocks: self.allocator.release(blocks))
        self._ids = itertools.count()
        self.stats = EngineStats(kv_blocks_total=self.allocator.num_total_blocks,
                                 kv_blocks_free=self.allocator.num_free_blocks)

    # ---- requests --------------------------------------------------------------------------------
    def encode(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError(f"model {self.model_path} has no tokenizer: pass prompt token ids "
                             f"instead of text")
        # (no warning for text past the tokenizer's nominal length: the engine checks its own limit)
        return self.tokenizer.encode(prompt, add_special_tokens=True, verbose=False)

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None,
                    hand_off: bool = False) -> str:
        """Queue a request; returns its id. Raises ValueError (nothing queued) on bad input.
        ``arrival_time`` (``time.monotonic()`` seconds) is when a caller received it; default
        now. ``hand_off``: keep the ``Handoff`` of its prompt for another engine to decode it
        (``take_handoff``)."""
        params = (params or SamplingParams()).validate(self.model_config.vocab_size)
        ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self._check_prompt(ids)
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        seq = Sequence(ids, params, request_id=request_id, hand_off=hand_off)
        if arrival_time is not None:
            seq.arrival_time = arrival_time
        self.requests[request_id] = _Request(seq, Detokenizer(self.tokenizer, ids, params.stop))
        self.scheduler.add(seq)
        self._update_queue_stats()
        return request_id

    def add_handoff(self, prompt: list[int], handoff: Handoff) -> None:
        """The request added next with token ids ``prompt`` (and no prompt logprobs) is admitted
        from ``handoff`` (``engine/handoff.py``; its held blocks pass to the request; released
        if no request takes it within ``HandoffTable.grace_s``)."""
        if not self.runner.backend.takes_handoffs or self.driver is not None:
            raise ValueError("only a one-rank tiered engine (kv_mode oasis) takes handed-off "
                             "prompts")
        self.scheduler.handoffs.add(tuple(prompt), handoff)

    def expire_handoffs(self) -> int:
        """Let go of the handoffs nobody took within ``HandoffTable.grace_s``: made here and not
        taken by the caller, or given here with no request of their prompt waiting. Returns how
        many."""
        waiting = ({tuple(s.prompt_token_ids) for s in self.scheduler.waiting}
                   if self.scheduler.handoffs else set())
        return self.handed_off.expire() + self.scheduler.handoffs.expire(keep=waiting)

    def pending_handoff_blocks(self) -> int:
        """Host blocks the ``hand_off`` requests here will hold once their prefills end (a
        handoff holds every block of its prompt; from then on they are held, and not counted
        here)."""
        size = self.allocator.block_size
        return sum(-(-len(r.seq.prompt_token_ids) // size) for r in self.requests.values()
                   if r.seq.hand_off and not r.seq.output_token_ids)

    def take_handoff(self, request_id: str) -> Handoff | None:
        """The ``Handoff`` of a ``hand_off`` request whose prefill has ended (its blocks held: the
        caller releases them, ``allocator.release``), or None (not yet, or it failed)."""
        return self.handed_off.take(request_id)

    def _check_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise ValueError("the prompt is empty: give at least one token")
        vocab = self.model_config.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(ids)} tokens but this engine's context limit is "
                             f"{self.max_model_len} (prompt + output): shorten the prompt or "
                             f"raise max_model_len")

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its KV at once. Returns False when it is unknown or already
        done."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        self.scheduler.abort(req.seq)
        self._ended.append(req.seq)
        if self.driver is not None:
            self.driver.forget(req.seq)
        self._update_queue_stats()
        return True

    def close(self) -> None:
        """Stop the tensor-parallel worker processes (nothing to do with one rank). The engine runs
        no step after this."""
        if self.driver is not None:
            self.driver.close()
            self.driver = None

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def release_ended(self) -> None:
        """Let go of every ended request the engine still holds (when it has nothing to run)."""
        self._ended.clear()

    def idle(self) -> bool:
        """No request is unfinished: let go of the ended ones and settle the KV backend's
        background work that outlived them (``AttentionBackend.idle``: it settles now, not at the
        next request's first step). True while some still runs: call again shortly."""
        self.release_ended()
        self._drop_ahead()
        return self.runner.idle()

    def _release_ended(self, running: Callable[[], Callable[[], bool]]) -> None:
        """Let go of ended requests while the device still runs the step (the runner's
        ``while_busy``; ``running()`` starts the probe, asked only when a request ended). A
        request's token lists are freed one Python int at a time: ~0.5 ms for 32K tokens, 65 ms
        between two replays when a batch of 128 ended at once (docs/benchmarks.md section 24); the
        requests left wait for the next step."""
        if not self._ended:
            return
        has_time = running()
        while self._ended and has_time():
            self._ended.pop()

    # ---- the step --------------------------------------------------------------------------------
    def step(self, forced: Mapping[str, int] | None = None) -> list[RequestOutput]:
        """Schedule and run one step; outputs of every request that advanced or finished.

        Teacher forcing: a request listed in ``forced`` (request id -> token) that gets a token in
        this step gets that token instead of a sampled one; its logprobs (when asked) score it,
        with the model's top alternatives. The engine goes on from the forced token. Requests whose
        KV the backend says will never be ready end first, with the reason."""
        held, lost = self.runner.held_back()
        self.scheduler.held = held
        failed = [self._fail(seq, lost[seq.seq_id]) for seq in list(self.scheduler.running)
                  if seq.seq_id in lost]
        return failed + self._step(forced)

    def _step(self, forced: Mapping[str, int] | None) -> list[RequestOutput]:
        self.stats.kv_samples = {}  # (a failing step observes nothing)
        if self._ahead is not None:
            if forced is None and any(self._live(self._ahead.batch)):
                step, self._ahead = self._ahead, None
                return self._complete(step, None, time.perf_counter())
            self._drop_ahead()  # (its requests ended meanwhile, or teacher forcing asks for it)
        batch = self.scheduler.schedule()
        if batch is None:  # (nothing runnable now, e.g. every free block held)
            self.stats.last_batch_size = 0
            self.release_ended()
            if self.scheduler.held:  # (their KV is on its way: no busy loop meanwhile)
                time.sleep(HELD_WAIT_S)
            return []
        start = time.perf_counter()
        want = None if forced is None else [forced.get(s.request_id) for s in batch.seqs]
        try:
            step = self.runner.launch(batch, want)
        except Exception as exc:  # one bad step must not take the engine or other requests down
            return self._fail_step(batch.seqs, exc)
        return self._complete(step, forced, start)

    def _complete(self, step: LaunchedStep, forced: Mapping[str, int] | None,
                  start: float) -> list[RequestOutput]:
        """Collect a launched step and apply it: tokens, stopping rules, outputs. With async
        scheduling the next decode step is launched first (``_run_ahead``), so that this host
        work overlaps the device's."""
        batch = step.batch
        live = self._live(batch)
        ahead_failed: tuple[list[Sequence], Exception] | None = None
        ran_ahead = forced is None and self._may_run_ahead(batch, live)
        if ran_ahead:
            ahead_failed = self._run_ahead(step, live)
        live_seqs = [s for s, ok in zip(batch.seqs, live) if ok]
        try:
            result = self.runner.collect(step)
        except Exception as exc:
            if ran_ahead:  # (no token replaces their placeholders)
                for seq in live_seqs:
                    seq.token_ids.pop(), seq.output_token_ids.pop()
            return self._fail_step(live_seqs, exc)
        if not ran_ahead:
            self.scheduler.postprocess(batch, live)
        now = time.monotonic()
        for i, seq in enumerate(batch.seqs):
            if not live[i]:
                continue
            seq.prompt_logprobs += result.prompt_logprobs[i]
            if result.tokens[i] is None:
                continue
            if ran_ahead:  # (in place of the placeholder ``_run_ahead`` appended)
                seq.token_ids[-1] = seq.output_token_ids[-1] = result.tokens[i]
            else:
                seq.append_token(result.tokens[i])
            if result.logprobs[i] is not None:
                seq.output_logprobs.append(result.logprobs[i])
            if seq.first_token_time is None:
                seq.first_token_time = now
        try:
            kv = self.runner.finish(batch)
        except Exception as exc:  # the step's deferred work failed: its results cannot be trusted
            return self._fail_step(live_seqs, exc)
        for i, handoff in result.handoffs.items():  # (held before the request ends and frees them)
            seq = batch.seqs[i]
            if seq.seq_id not in kv.failed:  # (a prefill whose KV cannot be trusted: none)
                self.allocator.hold(seq.block_table)
                handoff.blocks = list(seq.block_table)
                self.handed_off.add(seq.request_id, handoff)
        outputs = []
        for seq, token, ok in zip(batch.seqs, result.tokens, live):
            if not ok:
                continue
            if seq.seq_id in kv.failed:
                outputs.append(self._fail(seq, kv.failed[seq.seq_id]))
                continue
            if token is None:
                continue
            reason = self._stop_reason(seq, token)
            if reason:
                self.scheduler.finish(seq, reason)
            outputs.append(self._output(seq))
        self._record_step(batch, len(live_seqs), len(outputs), time.perf_counter() - start, kv)
        if ahead_failed is not None:  # (those this step did not end)
            seqs, exc = ahead_failed
            running = set(self.scheduler.running)
            outputs += [self._fail(seq, f"{type(exc).__name__}: {exc}") for seq in seqs
                        if seq in running]
        return outputs

    # ---- async scheduling ------------------------------------------------------------------------
    def _live(self, batch: ScheduledBatch) -> list[bool]:
        """Per sequence of ``batch``: still running (one of a step launched ahead may have ended
        or been aborted since)."""
        running = set(self.scheduler.running)
        return [seq in running for seq in batch.seqs]

    def _may_run_ahead(self, batch: ScheduledBatch, live: list[bool]) -> bool:
        """Whether the step after ``batch`` can be launched before ``batch``'s tokens are read:
        async scheduling on, a decode step, and the schedule it would make is known: every
        running sequence is in ``batch``, and no waiting one could be admitted now nor once
        ``batch``'s tokens end some by length (the next step is then the decode of the same
        sequences). (A request that a stop token ends frees its KV after the next step is
        launched: one it lets in waits a step longer than one step at a time.)"""
        s = self.scheduler
        if not (self.steps_ahead and not batch.is_prefill and not s.held
                and sum(live) == len(s.running)):
            return False
        if s.waiting and any(ok and self._ends_by_length(seq, 1) for seq, ok in zip(batch.seqs,
                                                                                   live)):
            return False  # (what it frees may admit a waiting one)
        return not s.admits_waiting()

    def _run_ahead(self, step: LaunchedStep,
                   live: list[bool]) -> tuple[list[Sequence], Exception] | None:
        """Launch the decode step after ``step`` (kept in ``_ahead``) with ``step``'s sampled
        tokens as its inputs, on the device. ``step``'s sequences get a placeholder for the token
        it samples (``_complete`` writes the token over it) and their computed tokens recorded;
        those that this token ends by length sit the next step out. When that launch raises:
        its sequences and the error (``_complete`` fails them)."""
        batch = step.batch
        for seq, ok in zip(batch.seqs, live):
            if ok:
                seq.append_token(PLACEHOLDER_TOKEN)
        self.scheduler.postprocess(batch, live)
        rows = [j for j, (seq, ok) in enumerate(zip(batch.seqs, live))
                if ok and not self._ends_by_length(seq, 0)]
        nxt = self.scheduler.schedule_next([batch.seqs[j] for j in rows])
        if nxt is None or not nxt.seqs:
            return None
        try:
            self._ahead = self.runner.launch(nxt, after=step, rows=rows)
        except Exception as exc:
            logger.exception("launching a step ahead failed; finishing its %d requests with an "
                             "error", len(nxt))
            return nxt.seqs, exc
        self.stats.num_steps_ahead += 1
        return None

    def _ends_by_length(self, seq: Sequence, pending: int) -> bool:
        """Whether ``seq`` ends by length once ``pending`` more tokens are appended (one of
        ``_stop_reason``'s rules)."""
        return (len(seq.output_token_ids) + pending >= seq.params.max_tokens
                or len(seq) + pending >= self.max_model_len)

    def _drop_ahead(self) -> None:
        """Wait out the step launched ahead, if any, and drop its results: its sequences' state and
        the sampling generators are as if it never ran (a later step computes their newest tokens
        again, into the same slots)."""
        step, self._ahead = self._ahead, None
        if step is None:
            return
        try:
            self.runner.drop(step)
            self.runner.finish(step.batch)
        except Exception:
            logger.exception("a step launched ahead failed; its results were not needed")

    def _fail_step(self, seqs: list[Sequence], exc: Exception) -> list[RequestOutput]:
        """One bad step must not take the engine or other requests down: its requests end with
        the error."""
        logger.exception("step failed; finishing its %d requests with an error", len(seqs))
        return [self._fail(seq, f"{type(exc).__name__}: {exc}") for seq in seqs]

    def replace_last_token(self, request_id: str, token: int) -> RequestOutput | None:
        """Replace a running request's newest token, sampled by the last step and not yet computed,
        before the next step feeds it to the model (e.g. a speculative mirror told the true token).
        The stopping rules apply to the new token: returns the request's final output when it ends
        it, else None. Raises ValueError when the request has no such token or ``token`` is not in
        the vocabulary."""
        req = self.requests.get(request_id)
        seq = None if req is None else req.seq
        if seq is None or not seq.output_token_ids or seq.num_computed_tokens >= len(seq):
            raise ValueError(f"request {request_id!r} has no sampled token waiting to be computed")
        self._drop_ahead()  # (it computes the token replaced here)
        if not 0 <= token < self.model_config.vocab_size:
            raise ValueError(f"token {token} is outside the vocabulary "
                             f"[0, {self.model_config.vocab_size})")
        req.detok.undo_push()
        seq.token_ids[-1] = seq.output_token_ids[-1] = token
        reason = self._stop_reason(seq, token)
        if reason is None:
            return None
        self.scheduler.finish(seq, reason)
        return self._output(seq)

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        req = self.requests[seq.request_id]
        p = seq.params
        if req.detok.push(token) is not None:
            return "stop"
        if (token in self.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids:
            return "stop"
        if self._ends_by_length(seq, 0):
            return "length"
        return None

    def _fail(self, seq: Sequence, message: str) -> RequestOutput:
        self.requests[seq.request_id].error = message
        self.scheduler.finish(seq, "error")
        return self._output(seq)

    def _output(self, seq: Sequence) -> RequestOutput:
        req = self.requests[seq.request_id]
        finished = seq.is_finished
        text = req.detok.visible_text(finished)
        want_lp = seq.params.logprobs is not None
        out = RequestOutput(
            request_id=seq.request_id, prompt_token_ids=seq.prompt_token_ids,
            token_ids=list(seq.output_token_ids), text=text,
            new_token_ids=seq.output_token_ids[req.emitted_tokens:],
            new_text=text[req.emitted_text:],
            finished=finished, finish_reason=seq.finish_reason,
            logprobs=list(seq.output_logprobs) if want_lp else None,
            new_logprobs=seq.output_logprobs[req.emitted_logprobs:] if want_lp else None,
            prompt_logprobs=list(seq.prompt_logprobs)
            if seq.params.prompt_logprobs is not None else None,
            error=req.error, arrival_time=seq.arrival_time, first_token_time=seq.first_token_time,
            finish_time=time.monotonic() if finished else None)
        req.emitted_tokens, req.emitted_text = len(seq.output_token_ids), len(text)
        req.emitted_logprobs = len(seq.output_logprobs)
        if finished:
            del self.requests[seq.request_id]
            self._ended.append(seq)
        return out

    def _record_step(self, batch, size: int, num_sampled: int, seconds: float,
                     kv: StepStats) -> None:
        s = self.stats
        s.num_steps += 1
        s.last_step_seconds, s.last_batch_size, s.last_step_prefill = (seconds, size,
                                                                       batch.is_prefill)
        if batch.is_prefill:
            s.prompt_tokens_total += sum(batch.num_tokens)
        s.generation_tokens_total += num_sampled
        s.kv, s.kv_per_layer, s.kv_samples = {**kv.counters, **kv.gauges}, kv.per_layer, kv.samples
        for key, values in kv.per_layer.items():
            totals = s.kv_per_layer_totals.setdefault(key, [0] * len(values))
            s.kv_per_layer_totals[key] = [a + b for a, b in zip(totals, values)]
        for key, value in kv.counters.items():
            s.kv_totals[key] = s.kv_totals.get(key, 0) + value
        self._update_queue_stats()

    def _update_queue_stats(self) -> None:
        s = self.stats
        s.num_running, s.num_waiting = len(self.scheduler.running), len(self.scheduler.waiting)
        s.kv_blocks_free = self.allocator.num_free_blocks
        s.num_preemptions = self.scheduler.num_preemptions


def _load_tokenizer(path: Path):
    if not (path / "tokenizer.json").exists() and not (path / "tokenizer_config.json").exists():
        logger.info("%s has no tokenizer: prompts must be token ids", path)
        return None
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(str(path))
    except Exception as exc:
        raise ValueError(f"cannot load the tokenizer in {path}: {exc}") from None
