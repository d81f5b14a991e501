"""Lookahead: the drafter's side of the lookahead step.

Owns the drafter, each sequence's guess of the token after its newest one, the draft rows that push
those guesses through the model (one per sequence with a guess, at the next position, after the
sequences' rows; never stored or sampled), the target features an EAGLE-3-style drafter reads
(forward hooks on the decoder layers it names write the residual stream after them into the
step's ``TierStep.aux``), and the draft hit count (a guess equal to the token the next step took).
Without a drafter (``draft=previous``) there are no guesses: the lookahead predicts step t+1's
query with step t's own.
"""
from __future__ import annotations

import logging

import torch

from oasiskv.engine.forward_batch import get_forward_context
from oasiskv.engine.scheduler import ScheduledBatch
from oasiskv.engine.sequence import Sequence
from oasiskv.spec.base import Drafter

logger = logging.getLogger(__name__)


class Lookahead:
    def __init__(self, drafter: Drafter | None, model: torch.nn.Module):
        self.drafter = drafter
        self.guesses: dict[int, int] = {}  #: seq id -> guess of the token after its newest
        self.hits = self.tries = 0  # since the last ``take_counts``
        for layer in drafter.aux_layers if drafter else ():
            model.layers[layer].register_forward_hook(self._keeper(layer))

    @property
    def rows_per_seq(self) -> int:
        """Rows a decode step runs per sequence: its token, plus a draft row when there is a
        drafter."""
        return 1 if self.drafter is None else 2

    @staticmethod
    def _keeper(layer: int):
        def keep(module, args, output) -> None:
            meta = get_forward_context().batch.meta
            if meta is not None:  # (a warm-up before storage exists has none)
                x, residual = output
                meta.aux[layer] = x + residual
        return keep

    def draft_rows(self, batch: ScheduledBatch) -> tuple[list[int], list[int], list[int]]:
        """A decode step's draft rows: (guessed token ids, their positions, the row of each)."""
        ids, positions, rows = [], [], []
        for i, seq in enumerate(batch.seqs):
            guess = self.guesses.get(seq.seq_id)
            if guess is not None:
                ids.append(guess)
                positions.append(len(seq))  # the row computes position len - 1; its guess the next
                rows.append(i)
        return ids, positions, rows

    def advance(self, batch: ScheduledBatch, aux: dict[int, torch.Tensor]) -> None:
        """After a step (its tokens appended): count hits, let the drafter observe the step, and
        take its guesses for every sequence that sampled. A failing drafter costs predictions (those
        sequences select with their own query next step), never requests."""
        sampled = [s for s, samples in zip(batch.seqs, batch.samples) if samples]
        for seq in sampled:
            guess = self.guesses.pop(seq.seq_id, None)
            if guess is not None:
                self.tries += 1
                self.hits += guess == seq.token_ids[-1]
        if self.drafter is None:
            return
        features = None
        if self.drafter.aux_layers:
            rows = sum(batch.num_tokens)  # the draft rows follow the sequences' rows
            features = torch.cat([aux[layer] for layer in self.drafter.aux_layers], dim=-1)[:rows]
        try:
            self.drafter.observe(batch, features)
            guesses = self.drafter.propose(sampled) if sampled else []
        except Exception:
            logger.exception("the drafter failed; these sequences predict with their own query")
            return
        for seq, guess in zip(sampled, guesses):
            if guess is not None:
                self.guesses[seq.seq_id] = guess

    def release(self, seq: Sequence) -> None:
        self.guesses.pop(seq.seq_id, None)
        if self.drafter is not None:
            self.drafter.release(seq)

    def take_counts(self) -> dict[str, int]:
        """Draft hits and guesses checked since the last call."""
        counts = {"draft_hits": self.hits, "draft_guesses": self.tries}
        self.hits = self.tries = 0
        return counts
