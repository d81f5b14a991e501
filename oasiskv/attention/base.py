"""AttentionBackend: the interface between the engine and a KV storage with its attention.

A backend owns the KV storage of every layer and computes attention for one layer from the step's
``ForwardBatch``. Its lifecycle has three parts, each called by the model runner in this order:

Storage. ``forward`` must work before storage exists for a prefill without prefix (the runner's
warm-up, storing nothing); then ``allocate`` with the HBM budget the runner measured (None on CPU),
then ``make_allocator`` once for the ``KVAllocator`` the scheduler consults. ``max_tokens_per_seq``
bounds the context; ``rows_per_seq`` is how many rows a decode step runs per sequence (1, or more
when the backend adds rows of its own after the sequences' tokens).

One step. ``prepare(batch)`` before the forward: returns a ``StepPlan`` (the backend's per-step
metadata, which reaches ``forward`` as ``ForwardBatch.meta``, and the extra rows it wants computed);
``forward`` per layer; ``finish(batch)`` after the step's tokens were appended to its sequences (a
step that raised is not finished): runs what the backend deferred past the step and returns the
step's ``StepStats``. ``finish`` is where a backend may block on the device (its counters). A
``handoff`` step (prompts another engine prefilled, ``engine/handoff.py``) calls ``admit(batch)``
in place of ``prepare`` and the forward, then ``finish``; a prefill step whose sequences have
``hand_off`` set answers ``handoff_queries`` after its forward.

CUDA graphs (decode only; a backend whose ``forward`` reads only the batch's tensors and device
state and never syncs the host). ``init_graphs(buckets)`` returns the static ``meta`` of each
bucket's captured step; per bucket the runner warms up, calls ``begin_capture``, captures (padding
rows: slot -1, context length 0), and calls ``end_capture(bucket)`` after the capture. Before each
replay ``prepare_replay(meta, num_seqs, bucket)`` copies the step's ``meta`` into that bucket's
static one and may decline (False: the step runs eagerly). A captured step must leave no work on
side streams; work it defers runs in ``finish``.

Tensor parallelism (``engine/tensor_parallel.py``). Rank 0's scheduler and allocator decide for
every rank; a worker rank's backend runs the same steps over sequences mirrored from rank 0. What
it needs beyond the sequence itself, rank 0's ``sequence_state(seq)``, reaches it through
``adopt_sequence(seq, state)``; ``drop_sequence(seq)`` when rank 0 finished or aborted ``seq``.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import torch

from oasiskv.engine.forward_batch import ForwardBatch
from oasiskv.engine.kv_allocator import KVAllocator
from oasiskv.engine.scheduler import ScheduledBatch
from oasiskv.engine.sequence import Sequence


@dataclass
class StepPlan:
    """What ``prepare`` returns: ``meta`` for ``ForwardBatch.meta``, and extra rows (token ids and
    positions, host lists) computed after the sequences' tokens, never stored or sampled. A decode
    step under CUDA graphs must have ``rows_per_seq - 1`` extra rows per sequence, in groups of one
    row per sequence in batch order (else it runs eagerly)."""
    meta: Any = None
    extra_ids: list[int] = field(default_factory=list)
    extra_positions: list[int] = field(default_factory=list)


@dataclass
class StepStats:
    """What ``finish`` reports of a step: ``counters`` (the engine sums them over steps),
    ``gauges`` (values as of this step), ``per_layer`` counts of this step and ``samples``
    (observations of this step for histograms, e.g. its stall seconds), by name; ``failed``: the
    step's sequences (by id) whose KV can no longer be trusted, with the reason (the engine ends
    them with an error, the others go on)."""
    counters: dict[str, float] = field(default_factory=dict)
    gauges: dict[str, float] = field(default_factory=dict)
    per_layer: dict[str, list[float]] = field(default_factory=dict)
    samples: dict[str, list[float]] = field(default_factory=dict)
    failed: dict[int, str] = field(default_factory=dict)


class AttentionBackend(ABC):
    supports_cuda_graphs: bool = True
    takes_handoffs: bool = False  #: implements ``admit`` and ``handoff_queries``
    rows_per_seq: int = 1  #: decode rows per sequence in a captured step (its token + extra rows)
    #: a decode step may be launched before the previous step's tokens reach the host and its
    #: ``finish`` runs (the engine's async scheduling): ``prepare`` and ``forward`` read neither,
    #: and ``finish`` takes a batch some of whose sequences ended after it was launched
    steps_ahead: bool = False

    # ---- storage ---------------------------------------------------------------------------------
    @abstractmethod
    def allocate(self, budget_bytes: int | None) -> None:
        """Create the KV storage within ``budget_bytes`` of device memory (None: the backend's CPU
        default or its explicit settings). Raises RuntimeError when not even one sequence fits."""

    @abstractmethod
    def make_allocator(self) -> KVAllocator:
        """The allocator that hands out this backend's storage (called once, after ``allocate``)."""

    @property
    @abstractmethod
    def max_tokens_per_seq(self) -> int:
        """The most tokens one sequence can hold once storage exists."""

    # ---- one step --------------------------------------------------------------------------------
    def prepare(self, batch: ScheduledBatch) -> StepPlan:
        """Per-step metadata and extra rows for ``batch`` (default: none)."""
        return StepPlan()

    @abstractmethod
    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                batch: ForwardBatch, scale: float) -> torch.Tensor:
        """Store this step's k/v ``[T, Hk, D]`` and return attention of q ``[T, Hq, D]`` ->
        ``[T, Hq, D]``."""

    def during_step(self) -> None:
        """The step's forward and sampling are launched on the device and the host is about to
        wait for the sampled tokens: host work that overlaps the device's (default: none)."""

    def finish(self, batch: ScheduledBatch) -> StepStats:
        """The step ran and its sampled tokens are appended: run deferred work; the step's stats."""
        return StepStats()

    def admit(self, batch: ScheduledBatch) -> torch.Tensor:
        """A ``handoff`` step in place of ``prepare`` and the forward: set up the KV state of each
        sequence from its ``Handoff`` (``engine/handoff.py``; its blocks are in its table); returns
        their final hidden states ``[n, hidden]``. Default: no handoffs."""
        raise NotImplementedError(f"{type(self).__name__} takes no handed-off prompts "
                                  "(--kv-mode oasis does)")

    def handoff_queries(self, index: int) -> torch.Tensor:
        """After a prefill step's forward: row ``index``'s last prompt token's query at every layer,
        ``[num_layers, Hq, D]`` float32 on the CPU (its sequence has ``hand_off`` set)."""
        raise NotImplementedError(f"{type(self).__name__} hands off no prompts "
                                  "(--kv-mode oasis does)")

    def idle(self) -> bool:
        """The engine has no request to run: settle background work that outlived its requests
        (reads still landing); True while some still runs, and the engine calls again shortly.
        Default: none."""
        return False

    def held_back(self) -> tuple[set[int], dict[int, str]]:
        """Before a step is scheduled: the running sequences (ids) that sit out the next step (their
        KV is not ready), and those that end now with why (it never will be). Default: none."""
        return set(), {}

    # ---- tensor parallelism ----------------------------------------------------------------------
    def sequence_state(self, seq: Sequence) -> Any:
        """Rank 0: what another rank's backend needs to run ``seq`` as this one does, beyond the
        sequence itself (default: nothing)."""
        return None

    def adopt_sequence(self, seq: Sequence, state: Any) -> None:
        """A worker rank, before a step that runs ``seq``: rank 0's ``sequence_state(seq)``."""

    def drop_sequence(self, seq: Sequence) -> None:
        """A worker rank: rank 0 finished or aborted ``seq``; drop what is kept for it."""

    # ---- CUDA graphs -----------------------------------------------------------------------------
    def init_graphs(self, buckets: list[int]) -> dict[int, Any]:
        """Static ``meta`` of each bucket's captured step (default: None)."""
        return dict.fromkeys(buckets)

    def begin_capture(self) -> None:
        """Before a capture: settle work the warm-up left pending."""

    def end_capture(self, bucket: int) -> None:
        """After the capture of ``bucket``: keep what that step defers past its replays."""

    def prepare_replay(self, meta: Any, num_seqs: int, bucket: int) -> bool:
        """Fill ``bucket``'s static meta from the step's ``meta`` (``num_seqs`` real rows, the rest
        padding) before its replay; False declines the replay (the step runs eagerly)."""
        return True


class SlotBackend(AttentionBackend):
    """A backend whose allocator (``BlockManager``, ``allocator``) gives running sequences slots
    (``slot_of``) that its storage is indexed by: under tensor parallelism rank 0's slot of a
    sequence is its state, and a worker rank's allocator keeps it until rank 0 drops the
    sequence. (Without slots ``slot_of`` stays empty: there is no state.)"""
    allocator: Any = None

    def sequence_state(self, seq: Sequence) -> int | None:
        return self.allocator.slot_of.get(seq.seq_id)

    def adopt_sequence(self, seq: Sequence, slot: int | None) -> None:
        if slot is not None:
            self.allocator.slot_of[seq.seq_id] = slot

    def drop_sequence(self, seq: Sequence) -> None:
        self.allocator.slot_of.pop(seq.seq_id, None)
