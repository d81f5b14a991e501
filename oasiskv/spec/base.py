"""Drafter: proposes, for every sequence that just sampled a token, a guess of the token after it.

The lookahead step (``kv/lookahead.py``) pushes that guess through the model next to the real token
so each layer's query for step t+1 exists one step early. Contract, per engine step: ``observe``
sees the step's batch and, for drafters with ``aux_layers``, the target's features of the rows of
the batch's sequences (the residual stream after those layers, concatenated in ``aux_layers``
order, rows in batch order); then, for each sequence that just sampled x_{t+1}, ``propose``
returns the guess of x_{t+2} (or None). ``release`` forgets a sequence that gave its KV back.
Memory: before the first step, ``reserve(num_seqs, max_len)`` takes the per-sequence device memory
for up to ``num_seqs`` sequences of ``max_len`` tokens, ``bytes_per_seq(max_len)`` of it each;
``fixed_bytes()`` is device memory the drafter takes in ``reserve`` besides that (weights built
then). The tier counts both inside the HBM budget it admits against. ``make_drafter`` parses
``--draft`` values that name a drafter.
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
        ``[sum(batch.num_tokens), len(aux_layers) * hidden]`` or None when ``aux_layers`` is
        empty."""

    @abstractmethod
    def propose(self, seqs: list[Sequence]) -> list[int | None]:
        """Guesses of the next input token, one per sequence (each ``seq`` already holds its newest
        sampled token)."""

    def release(self, seq: Sequence) -> None:
        """Drop any state kept for ``seq``."""

    def bytes_per_seq(self, max_len: int) -> int:
        """Device bytes ``reserve`` takes per sequence of up to ``max_len`` tokens."""
        return 0

    def fixed_bytes(self) -> int:
        """Device bytes ``reserve`` takes besides the per-sequence ones."""
        return 0

    def reserve(self, num_seqs: int, max_len: int) -> None:
        """Take the device memory for up to ``num_seqs`` sequences of ``max_len`` tokens."""


def make_drafter(spec: str, device: torch.device | None = None, target_model=None) -> Drafter:
    """``ngram`` | ``model:PATH`` | ``eagle3:PATH`` (needs the target model: its embeddings and
    features). Raises ValueError on anything else."""
    kind, _, path = spec.partition(":")
    if kind == "ngram" and not path:
        from oasiskv.spec.ngram import NgramDrafter
        return NgramDrafter()
    if kind == "model" and path:
        from oasiskv.spec.draft_model import ModelDrafter
        return ModelDrafter(path, device)
    if kind == "eagle3" and path:
        from oasiskv.spec.eagle3 import Eagle3Drafter
        return Eagle3Drafter(path, target_model, device)
    raise ValueError(f"unknown drafter {spec!r}: use ngram, model:PATH or eagle3:PATH")
