"""Drafter: proposes, for every running sequence, a guess of the token after the one just sampled.

The lookahead step pushes that guess through the model next to the real token so each layer's
query for step t+1 exists one step early. Contract: after a step samples x_{t+1} for a sequence,
``propose`` returns the drafter's guess of x_{t+2} (or None when it has none, e.g. ``none``); target
features (the residual stream after ``aux_layers``) of the step's rows are passed for drafters that
read them. ``release`` forgets a finished or aborted sequence. ``make_drafter`` parses ``--draft``.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from oasiskv.engine.sequence import Sequence


class Drafter(ABC):
    #: target decoder layers whose output residual stream this drafter reads (empty: none)
    aux_layers: tuple[int, ...] = ()

    @abstractmethod
    def propose(self, seqs: list[Sequence], features: torch.Tensor | None = None) -> list[int | None]:
        """Guesses of the next input token, one per sequence (each ``seq`` already holds its newest
        sampled token). ``features``: ``[len(seqs), len(aux_layers) * hidden]`` target features at each
        sequence's newest computed position (None when ``aux_layers`` is empty)."""

    def release(self, seq: Sequence) -> None:
        """Drop any state kept for ``seq``."""


class NoDrafter(Drafter):
    """``none``: no guess; the lookahead falls back to the real token's own query (previous-query baseline)."""

    def propose(self, seqs, features=None):
        return [None] * len(seqs)


def make_drafter(spec: str, device: torch.device | None = None) -> Drafter:
    """``none`` | ``ngram`` | ``model:PATH``. Raises ValueError on anything else. (The EAGLE-3 head in
    ``spec/eagle3.py`` runs whole sequences so far; its per-step drafter comes with the lookahead step.)"""
    kind, _, path = spec.partition(":")
    if kind == "none" and not path:
        return NoDrafter()
    if kind == "ngram" and not path:
        from oasiskv.spec.ngram import NgramDrafter
        return NgramDrafter()
    if kind == "model" and path:
        from oasiskv.spec.draft_model import ModelDrafter
        return ModelDrafter(path, device)
    raise ValueError(f"unknown drafter {spec!r}: use none, ngram or model:PATH")
