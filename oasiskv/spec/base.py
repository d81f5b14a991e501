"""Drafter: proposes, for every running sequence, a guess of the token after the one just sampled.

The lookahead step pushes that guess through the model next to the real token so each layer's
query for step t+1 exists one step early. Contract, per engine step: ``observe`` sees the step's
batch and, for drafters with ``aux_layers``, the target's features of every real row (the residual
stream after those layers, rows in batch order); then, for each sequence that just sampled x_{t+1},
``propose`` returns the guess of x_{t+2} (or None, e.g. ``none``). ``release`` forgets a finished or
aborted sequence. ``make_drafter`` parses ``--draft``.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from oasiskv.engine.sequence import Sequence


class Drafter(ABC):
    #: target decoder layers whose output residual stream this drafter reads (empty: none)
    aux_layers: tuple[int, ...] = ()

    def observe(self, batch, features: torch.Tensor | None) -> None:
        """A step ran ``batch`` (a ScheduledBatch, tokens already appended); ``features``
        ``[sum(batch.num_tokens), len(aux_layers) * hidden]`` or None when ``aux_layers`` is empty."""

    @abstractmethod
    def propose(self, seqs: list[Sequence]) -> list[int | None]:
        """Guesses of the next input token, one per sequence (each ``seq`` already holds its newest
        sampled token)."""

    def release(self, seq: Sequence) -> None:
        """Drop any state kept for ``seq``."""


class NoDrafter(Drafter):
    """``none``: no guess; the lookahead falls back to the real token's own query (previous-query baseline)."""

    def propose(self, seqs):
        return [None] * len(seqs)


def make_drafter(spec: str, device: torch.device | None = None, target_model=None) -> Drafter:
    """``none`` | ``ngram`` | ``model:PATH`` | ``eagle3:PATH`` (needs the target model: its embeddings
    and features). Raises ValueError on anything else."""
    kind, _, path = spec.partition(":")
    if kind == "none" and not path:
        return NoDrafter()
    if kind == "ngram" and not path:
        from oasiskv.spec.ngram import NgramDrafter
        return NgramDrafter()
    if kind == "model" and path:
        from oasiskv.spec.draft_model import ModelDrafter
        return ModelDrafter(path, device)
    if kind == "eagle3" and path:
        from oasiskv.spec.eagle3 import Eagle3Drafter
        return Eagle3Drafter(path, target_model, device)
    raise ValueError(f"unknown drafter {spec!r}: use none, ngram, model:PATH or eagle3:PATH")
