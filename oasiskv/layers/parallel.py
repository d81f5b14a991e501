"""Tensor parallelism of the decoder's layers (Megatron's scheme, as nano-vllm and vLLM do it).

Each of ``size`` ranks holds a slice of every large matrix: column-parallel linears (``qkv_proj``,
``gate_up_proj``, the experts' ``gate_up_proj``) keep their share of the output features (their
query / kv heads, their share of the MLP width), row-parallel ones (``o_proj``, ``down_proj``, the
experts' ``down_proj``) the matching share of the input features and sum their partial outputs over
the ranks (``all_reduce``); the embedding and the LM head are split over the vocabulary (a rank
embeds only its own token ids, the logits of all ranks are gathered). Norms, q/k norms and MoE
routers are replicated. With ``size`` 1 nothing here communicates.

A model's layers take their rank's place (``TensorParallel``) when they are built: the runner builds
the model inside ``building(tp)``; outside it layers are built for one rank, so engines with and
without tensor parallelism can live in one process. ``shard_for_rank`` cuts a checkpoint tensor to
the rank's slice of the parameter it loads into (``param.tp_split``: "column", "row" or absent for
replicated).
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class TensorParallel:
    """One rank's place: ``rank`` of ``size``, and the process group collectives run on."""
    rank: int = 0
    size: int = 1
    group: object = None


_building = TensorParallel()


@contextmanager
def building(tp: TensorParallel):
    """Layers built inside take ``tp`` as their rank's place."""
    global _building
    previous, _building = _building, tp
    try:
        yield
    finally:
        _building = previous


def current() -> TensorParallel:
    """The place of the layers being built (one rank outside ``building``)."""
    return _building


def all_reduce(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """The sum of ``x`` over the ranks (in place), or ``x`` with one rank."""
    if tp.size > 1:
        dist.all_reduce(x, group=tp.group)
    return x


def split_param(param: nn.Parameter, split: str, parts: int = 1) -> nn.Parameter:
    """Mark ``param`` as holding this rank's "column" or "row" share (``shard_for_rank``);
    ``parts``: equal parts fused along its output features (gate and up), each split on its own."""
    param.tp_split, param.tp_parts = split, parts
    return param


def column_linear(in_features: int, out_features: int, bias: bool = False,
                  parts: int = 1) -> nn.Linear:
    """A linear keeping this rank's ``out_features`` (already divided) outputs (``parts`` equal
    fused parts: ``split_param``)."""
    layer = nn.Linear(in_features, out_features, bias=bias)
    split_param(layer.weight, "column", parts)
    if bias:
        split_param(layer.bias, "column", parts)
    return layer


class RowLinear(nn.Linear):
    """A linear over this rank's ``in_features`` (already divided) inputs; its outputs are summed
    over the ranks."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__(in_features, out_features, bias=False)
        split_param(self.weight, "row")
        self.tp = current()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return all_reduce(F.linear(x, self.weight), self.tp)


class VocabEmbedding(nn.Module):
    """Token embedding split over the vocabulary: rank r holds rows ``[r V/n, (r+1) V/n)``; other
    ids embed to zero here and the ranks' rows are summed. ``logits(hidden)`` (a tied head) is
    ``hidden @ W^T`` gathered over the ranks, float32 ``[N, V]``."""

    def __init__(self, vocab_size: int, hidden: int):
        super().__init__()
        self.vocab_size, self.tp = vocab_size, current()
        self.shard = vocab_size // self.tp.size  # ModelConfig.shard checked that it divides
        self.weight = split_param(nn.Parameter(torch.empty(self.shard, hidden)), "column")

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.tp.rank * self.shard
        mine = (local >= 0) & (local < self.shard)
        out = F.embedding(torch.where(mine, local, 0), self.weight) * mine[:, None]
        return all_reduce(out, self.tp)


def gather_logits(hidden: torch.Tensor, weight: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """``hidden [N, H] @ weight^T`` for a vocabulary-split ``weight`` ``[V/n, H]`` -> float32
    ``[N, V]`` (the ranks' shards side by side)."""
    logits = F.linear(hidden, weight).float()
    if tp.size == 1:
        return logits
    parts = [torch.empty_like(logits) for _ in range(tp.size)]
    dist.all_gather(parts, logits.contiguous(), group=tp.group)
    return torch.cat(parts, dim=-1)


def shard_for_rank(tensor: torch.Tensor, param: torch.Tensor, tp: TensorParallel,
                   whole: bool) -> torch.Tensor:
    """The slice of checkpoint ``tensor`` this rank loads into ``param`` (``whole``) or into an
    expert of it / a part of a fused parameter: column-split parameters keep their share of the
    output features (the first dimension of a 1-D or 2-D tensor, the second of a 3-D expert tensor),
    row-split ones of the last; a whole parameter of fused parts (``split_param``) is cut part by
    part."""
    split = getattr(param, "tp_split", None)
    if tp.size == 1 or split is None:
        return tensor
    dim = -1 if split == "row" else max(0, tensor.dim() - 2)
    pieces = tensor.chunk(param.tp_parts if whole else 1, dim=dim)
    return torch.cat([p.narrow(dim, tp.rank * p.shape[dim] // tp.size, p.shape[dim] // tp.size)
                      for p in pieces], dim=dim)
