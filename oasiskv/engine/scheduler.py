"""Scheduler: continuous batching over waiting and running sequences.

Each step is either a prefill step (prompt chunks, up to ``max_num_batched_tokens`` tokens; a prompt
longer than what is left is cut into chunks across steps) or a decode step (one token for every
running sequence). Prefill goes first when anything is waiting and fits. When the KV allocator runs
out during decode, the most recently admitted sequence is preempted: its blocks are freed and it
goes back to the front of the waiting queue to be recomputed later. Running sequences in ``held``
(ids; the KV backend's ``held_back``) sit out decode steps until they leave it.

A waiting sequence whose prompt another engine prefilled (a ``Handoff`` in ``handoffs``,
``engine/handoff.py``) is admitted in a step of its own, before any prefill: it adopts the
handoff's blocks, its prompt counts as computed but for the last token, and the step (``handoff``)
runs no forward: the backend seeds its KV state from the handoff and the first token is sampled
from the handoff's hidden state.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from oasiskv.engine.handoff import HandoffTable
from oasiskv.engine.kv_allocator import KVAllocator
from oasiskv.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    """What one step computes: ``num_tokens[i]`` new tokens of ``seqs[i]``.

    Fixed when the batch is made (before the step changes its sequences): ``samples[i]``, whether
    the step computes every token of ``seqs[i]`` and so samples its next one; ``ends_prefill[i]``,
    whether it ends the sequence's prefill: all its tokens, or, for a sequence recomputed after
    preemption (it has outputs), all but the newest, which decode computes. ``handoff``: every
    sequence is admitted from its ``Handoff`` (a prefill step without a forward)."""
    seqs: list[Sequence]
    num_tokens: list[int]
    is_prefill: bool
    handoff: bool = False
    samples: list[bool] = field(init=False)
    ends_prefill: list[bool] = field(init=False)

    def __post_init__(self):
        done = [s.num_computed_tokens + n for s, n in zip(self.seqs, self.num_tokens)]
        self.samples = [d == len(s) for s, d in zip(self.seqs, done)]
        self.ends_prefill = [d == len(s) or (bool(s.output_token_ids) and d == len(s) - 1)
                             for s, d in zip(self.seqs, done)]

    def __len__(self) -> int:
        return len(self.seqs)


class Scheduler:
    def __init__(self, allocator: KVAllocator, max_num_seqs: int, max_num_batched_tokens: int):
        self.allocator = allocator
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.held: set[int] = set()
        self.num_preemptions = 0
        self.handoffs = HandoffTable(lambda blocks: self.allocator.release(blocks))

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, seq: Sequence) -> None:
        """Remove ``seq`` wherever it is and free its blocks (safe between steps)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
            key = tuple(seq.prompt_token_ids)
            if (self.handoffs and self._handoff_of(seq) is not None
                    and not any(tuple(s.prompt_token_ids) == key for s in self.waiting)):
                self.handoffs.drop(key)  # (its handoff: no other request will take it)
        self.allocator.free(seq)

    def schedule(self) -> ScheduledBatch | None:
        """The next step's work; None only when nothing is waiting or running, or every running
        sequence is held."""
        while True:
            batch = (self._schedule_handoffs() or self._schedule_prefill()
                     or self._schedule_decode())
            runnable = [s for s in self.running if s.seq_id not in self.held]
            if batch is not None or not runnable:
                return batch
            # Only half-prefilled sequences remain and the pool cannot take their next chunk.
            self._preempt(runnable[-1])

    def _handoff_of(self, seq: Sequence):
        """The handoff a fresh waiting ``seq`` would be admitted from, if any."""
        if (not self.handoffs or seq.block_table or seq.output_token_ids
                or seq.params.prompt_logprobs is not None):
            return None
        return self.handoffs.peek(tuple(seq.prompt_token_ids))

    def _schedule_handoffs(self) -> ScheduledBatch | None:
        seqs = []
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if self._handoff_of(seq) is None or not self.allocator.can_adopt():
                break
            seq.handoff = self.handoffs.take(tuple(seq.prompt_token_ids))
            self.allocator.adopt(seq, seq.handoff.blocks)
            seq.num_computed_tokens = len(seq) - 1
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            seqs.append(seq)
        return ScheduledBatch(seqs, [1] * len(seqs), True, handoff=True) if seqs else None

    def _schedule_prefill(self) -> ScheduledBatch | None:
        budget, seqs, counts = self.max_num_batched_tokens, [], []
        for seq in self.running:  # finish chunked prefills first: they already hold blocks
            if seq.in_prefill and budget > 0:
                n = min(seq.num_uncomputed_tokens, budget)
                if not self.allocator.can_allocate(seq, n):
                    break
                self.allocator.allocate(seq, n)
                seqs.append(seq), counts.append(n)
                budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if self._handoff_of(seq) is not None:  # (admitted by a handoff step, in order)
                break
            if not seq.block_table:
                self.allocator.reuse_prefix(seq)
            n = min(seq.num_uncomputed_tokens, budget)
            if not self.allocator.can_allocate(seq, n):
                self.allocator.free(seq)  # undo prefix reuse: a waiting sequence holds no blocks
                seq.num_computed_tokens = 0
                break
            self.allocator.allocate(seq, n)
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            seqs.append(seq), counts.append(n)
            budget -= n
        return ScheduledBatch(seqs, counts, is_prefill=True) if seqs else None

    def _schedule_decode(self) -> ScheduledBatch | None:
        scheduled: list[Sequence] = []
        queue = deque(s for s in self.running if not s.in_prefill and s.seq_id not in self.held)
        while queue:
            seq = queue.popleft()
            while not self.allocator.can_allocate(seq, 1):
                victim = queue.pop() if queue else seq
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                self.allocator.allocate(seq, 1)
                scheduled.append(seq)
        return (ScheduledBatch(scheduled, [1] * len(scheduled), is_prefill=False)
                if scheduled else None)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.allocator.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def admits_waiting(self) -> bool:
        """Whether ``schedule`` would admit a waiting sequence now (a handoff or prefill step):
        the check ``_schedule_prefill`` makes of the queue's head, undone (references and counts
        as before; the head's cached prefix blocks move to the free list's tail, as that check
        moves them)."""
        if not self.waiting or len(self.running) >= self.max_num_seqs:
            return False
        seq = self.waiting[0]
        if self._handoff_of(seq) is not None:
            return self.allocator.can_adopt()
        self.allocator.reuse_prefix(seq)
        fits = self.allocator.can_allocate(seq, min(seq.num_uncomputed_tokens,
                                                    self.max_num_batched_tokens))
        self.allocator.free(seq)  # (a waiting sequence holds no blocks)
        seq.num_computed_tokens = 0
        return fits

    def schedule_next(self, seqs: list[Sequence]) -> ScheduledBatch | None:
        """A decode step of ``seqs`` (running, their newest tokens not computed), scheduled while
        the step before it still runs: one slot more each, no preemption. None when a sequence
        cannot have its slot (the slots taken stay with their sequences: a later step needs
        them)."""
        for seq in seqs:
            if not self.allocator.can_allocate(seq, 1):
                return None
            self.allocator.allocate(seq, 1)
        return ScheduledBatch(list(seqs), [1] * len(seqs), is_prefill=False)

    def postprocess(self, batch: ScheduledBatch, live: list[bool] | None = None) -> None:
        """Record the computed tokens (of the sequences ``live`` marks, default all: one that
        ended after its step was launched has nothing to record)."""
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_tokens)):
            if live is None or live[i]:
                seq.num_computed_tokens += n
                seq.handoff = None
                self.allocator.on_computed(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.running.remove(seq)
        self.allocator.free(seq)
