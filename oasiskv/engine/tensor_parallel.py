"""Tensor-parallel execution: the engine's process is rank 0 and drives ranks 1..n-1, one worker
process each, in lockstep (nano-vllm's shape).

Every rank holds its part of the model (``layers/parallel.py``) and its own KV storage for its kv
heads (dense pool, or tiered: host store, working sets, summaries and mapping tables of its heads),
and runs the same ``ModelRunner.run`` / ``finish`` on the same batch in the same order, so their
collectives (row-parallel sums, the embedding's sum, the logits' gather, an EAGLE-3 drafter's
embedding lookups in ``finish``) pair up; the workers' sampled tokens are discarded. Rank 0 sends
every worker two messages per step over a pipe: before it runs a step, for each of the step's
sequences the tokens the worker has not seen, its computed-token count, the new part of its block
table (the whole table when the list was replaced), its backend's state (``AttentionBackend.
sequence_state``: the tiered backend's working-set slot) and, the first
time, its sampling parameters, plus the sequences that have finished; and before it finishes the
step, the tokens the step sampled (the tiered backend's drafter observes them in ``finish``); a
token replaced after that (``LLMEngine.replace_last_token``) comes with the next step. Scheduling
and allocation stay on rank 0 (a worker's backend adopts the state rank 0's gives). Collectives
run on gloo (CPU) or NCCL (CUDA) with a timeout; a worker that has exited makes the next step
raise ``RuntimeError`` naming its rank (and every step after it), never a hang.
"""
from __future__ import annotations

import datetime
import os
import pickle
import socket
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from oasiskv.attention import BackendFactory, make_backend
from oasiskv.config import EngineConfig
from oasiskv.engine.scheduler import ScheduledBatch
from oasiskv.engine.sequence import Sequence
from oasiskv.layers.parallel import TensorParallel
from oasiskv.sampling_params import SamplingParams

COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=300)
POLL_SECONDS = 1.0  # a worker checks this often whether rank 0 is still there


@dataclass
class SeqUpdate:
    """What a worker learns of one sequence before a step."""
    seq_id: int
    tokens: list[int]  # token ids after the ones it has
    num_computed_tokens: int
    table: list[int]  # block table entries from ``table_from`` on
    table_from: int
    num_prompt_logprobs: int
    state: Any  # its attention backend's (``AttentionBackend.sequence_state``)
    last_token: int  # its newest token (which rank 0 may have replaced since it was sent)
    prompt_len: int = 0  # the first update of a sequence: its prompt length and parameters
    params: SamplingParams | None = None


@dataclass
class StepMessage:
    updates: list[SeqUpdate]  # this step's sequences, in batch order
    num_tokens: list[int]
    is_prefill: bool
    forced: list[int | None] | None
    finished: list[int] = field(default_factory=list)


@dataclass
class FinishMessage:
    tokens: dict[int, list[int]]  # seq id -> the tokens the step appended
    num_computed_tokens: dict[int, int]  # after the step
    num_prompt_logprobs: dict[int, int]


@dataclass
class _Sent:
    seq: Sequence
    tokens: int
    table: list[int]
    table_len: int


def _join(rank: int, size: int, port: int, device: torch.device) -> TensorParallel:
    """Join the process group; returns this rank's place in it."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=size, timeout=COLLECTIVE_TIMEOUT)
    return TensorParallel(rank, size, dist.group.WORLD)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_device(config: EngineConfig, rank: int) -> torch.device:
    """Rank r runs on GPU r (with ``device`` auto or cuda), else on the CPU."""
    if config.device == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", rank)


class TensorParallelDriver:
    """Rank 0's side: starts the ``tensor_parallel_size - 1`` workers for ``model_path`` and joins
    the process group with them (so the model rank 0 builds next is its part); ``step`` sends a
    step to the workers, ``close`` stops them."""

    def __init__(self, config: EngineConfig, model_path: Path,
                 backend_factory: BackendFactory = make_backend):
        """``backend_factory`` builds every rank's attention backend: it goes to the workers
        pickled (``ValueError`` when it cannot)."""
        try:
            pickle.dumps(backend_factory)
        except Exception as exc:  # noqa: BLE001 (whatever pickling raises)
            raise ValueError("tensor_parallel_size > 1 builds the attention backend on every "
                             "rank: a custom backend_factory must be picklable "
                             f"({type(exc).__name__}: {exc})") from None
        size = config.tensor_parallel_size
        port = _free_port()
        ctx = mp.get_context("spawn")
        self.pipes, self.procs = [], []
        for rank in range(1, size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker_main, args=(config, model_path, backend_factory,
                                                          rank, size, port, child, os.getpid()),
                               daemon=True, name=f"oasiskv-tp{rank}")
            proc.start()
            self.pipes.append(parent)
            self.procs.append(proc)
        self.device = _rank_device(config, 0)
        self._sent: dict[int, _Sent] = {}
        self._aborted: list[int] = []
        self._broken: str | None = None
        try:
            self.tp = _join(0, size, port, self.device)
        except Exception:
            self.close()
            raise

    def abort(self, reason: str) -> None:
        """Rank 0 could not finish a step the workers started: the ranks are out of step for
        good. Stop the workers; every later step raises RuntimeError with ``reason``."""
        if self._broken is None:
            self._broken = f"tensor-parallel engine stopped: {reason}"
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()

    def check(self) -> None:
        """Raise RuntimeError when a worker has exited (then on every later call)."""
        if self._broken is None:
            for rank, proc in enumerate(self.procs, 1):
                if not proc.is_alive():
                    self._broken = (f"tensor-parallel rank {rank} exited (code {proc.exitcode}); "
                                    f"the engine cannot run steps any more")
        if self._broken is not None:
            raise RuntimeError(self._broken)

    def step(self, batch: ScheduledBatch, forced: list[int | None] | None,
             sequence_state: Callable[[Sequence], Any]) -> None:
        """Send the workers ``batch`` (with the teacher-forced tokens, and each sequence's
        ``sequence_state``: rank 0's backend's) before rank 0 runs it."""
        self._send("step", StepMessage([self._update(s, sequence_state) for s in batch.seqs],
                                       list(batch.num_tokens), batch.is_prefill, forced,
                                       self._finished()))

    def finish(self, batch: ScheduledBatch) -> None:
        """Send the workers the tokens ``batch`` appended, before rank 0 finishes it."""
        tokens, computed, logprobs = {}, {}, {}
        for seq in batch.seqs:
            sent = self._sent[seq.seq_id]
            tokens[seq.seq_id] = seq.token_ids[sent.tokens:]
            computed[seq.seq_id] = seq.num_computed_tokens
            logprobs[seq.seq_id] = len(seq.prompt_logprobs)
            sent.tokens = len(seq.token_ids)
        self._send("finish", FinishMessage(tokens, computed, logprobs))

    def _send(self, kind: str, message) -> None:
        self.check()
        try:
            for pipe in self.pipes:
                pipe.send((kind, message))
        except (BrokenPipeError, EOFError, OSError):
            self.check()
            raise

    def _update(self, seq: Sequence, sequence_state: Callable[[Sequence], Any]) -> SeqUpdate:
        sent = self._sent.get(seq.seq_id)
        first = sent is None
        if first:
            sent = self._sent[seq.seq_id] = _Sent(seq, 0, seq.block_table, 0)
        table_from = sent.table_len
        if seq.block_table is not sent.table or len(seq.block_table) < sent.table_len:
            table_from = 0  # a new list (preemption, prefix reuse): send it whole
        update = SeqUpdate(seq.seq_id, seq.token_ids[sent.tokens:], seq.num_computed_tokens,
                           seq.block_table[table_from:], table_from, len(seq.prompt_logprobs),
                           sequence_state(seq),
                           seq.token_ids[-1], seq.num_prompt_tokens if first else 0,
                           seq.params if first else None)
        sent.tokens, sent.table, sent.table_len = (len(seq.token_ids), seq.block_table,
                                                   len(seq.block_table))
        return update

    def forget(self, seq: Sequence) -> None:
        """``seq`` was aborted (it never finishes): the workers drop it with the next step."""
        self._aborted.append(seq.seq_id)

    def _finished(self) -> list[int]:
        """Sequences that finished or were aborted since the last step."""
        done = [sid for sid, sent in self._sent.items() if sent.seq.is_finished]
        done += [sid for sid in self._aborted if sid in self._sent and sid not in done]
        self._aborted = []
        for sid in done:
            del self._sent[sid]
        return done

    def close(self) -> None:
        for pipe in self.pipes:
            try:
                pipe.send(("exit", None))
            except (BrokenPipeError, EOFError, OSError):
                pass
        for proc in self.procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
        if dist.is_initialized():
            dist.destroy_process_group()


class _Mirror:
    """A worker's copies of the sequences rank 0 schedules, and its ``backend`` told of them
    (``adopt_sequence`` / ``drop_sequence``)."""

    def __init__(self, backend):
        self.seqs: dict[int, Sequence] = {}
        self.backend = backend

    def update(self, message: StepMessage) -> None:
        """Bring the step's sequences up to rank 0's state."""
        for u in message.updates:
            seq = self.seqs.get(u.seq_id)
            tokens = u.tokens
            if seq is None:
                seq = self.seqs[u.seq_id] = Sequence(tokens[:u.prompt_len], u.params,
                                                     seq_id=u.seq_id)
                tokens = tokens[u.prompt_len:]
            for token in tokens:
                seq.append_token(token)
            if seq.token_ids[-1] != u.last_token:  # replaced on rank 0
                seq.token_ids[-1] = u.last_token
                if seq.output_token_ids:
                    seq.output_token_ids[-1] = u.last_token
            seq.num_computed_tokens = u.num_computed_tokens
            if u.table_from and u.table_from == len(seq.block_table):
                seq.block_table.extend(u.table)  # in place: the runner's rows stay valid
            else:
                seq.block_table = seq.block_table[:u.table_from] + u.table
            seq.prompt_logprobs = [None] * u.num_prompt_logprobs
            self.backend.adopt_sequence(seq, u.state)

    def release(self, message: StepMessage) -> None:
        """Forget the sequences that have finished or were aborted."""
        for sid in message.finished:
            seq = self.seqs.pop(sid, None)
            if seq is not None:
                self.backend.drop_sequence(seq)

    def sampled(self, message: FinishMessage) -> None:
        """The step's sequences as rank 0 finishes it: computed, with what it sampled."""
        for sid, tokens in message.tokens.items():
            seq = self.seqs[sid]
            for token in tokens:
                seq.append_token(token)
            seq.num_computed_tokens = message.num_computed_tokens[sid]
            seq.prompt_logprobs = [None] * message.num_prompt_logprobs[sid]

    def batch(self, message: StepMessage) -> ScheduledBatch:
        return ScheduledBatch([self.seqs[u.seq_id] for u in message.updates], message.num_tokens,
                              message.is_prefill)


def _worker_main(config: EngineConfig, model_path: Path, backend_factory: BackendFactory,
                 rank: int, size: int, port: int, pipe, parent_pid: int) -> None:
    """Rank ``rank``: build its part of the model and run every step rank 0 sends, until told to
    exit or rank 0 is gone."""
    from oasiskv.config import ModelConfig
    from oasiskv.engine.model_runner import ModelRunner
    device = _rank_device(config, rank)
    if device.type == "cuda":
        config = replace(config, device=str(device))
    tp = _join(rank, size, port, device)
    runner = ModelRunner(config, model_path, ModelConfig.from_file(model_path / "config.json"),
                         backend_factory, tp=tp)
    runner.backend.make_allocator()  # its lifecycle; the scheduling allocator is rank 0's
    mirror = _Mirror(runner.backend)
    last: ScheduledBatch | None = None  # the step run last
    while True:
        if not pipe.poll(POLL_SECONDS):
            if os.getppid() != parent_pid:
                break  # rank 0 is gone
            continue
        try:
            kind, message = pipe.recv()
        except EOFError:
            break
        if kind == "exit":
            break
        if kind == "finish":  # with its sampled tokens, as rank 0 finishes it
            mirror.sampled(message)
            runner.finish(last)
            continue
        mirror.release(message)
        mirror.update(message)
        last = mirror.batch(message)
        runner.run(last, message.forced)
    dist.destroy_process_group()
