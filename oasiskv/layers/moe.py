"""The decoder's MLPs: ``MLP`` (dense, gate and up fused) and ``SparseMoE`` (Qwen3-MoE: a router
and ``num_experts`` experts with their weights fused in memory as 3-D tensors).

Parameter names follow the transformers-5 checkpoint layout under ``mlp.``: ``gate_up_proj`` /
``down_proj`` (dense), ``gate.weight`` ``[E, H]``, ``experts.gate_up_proj`` ``[E, 2I, H]`` and
``experts.down_proj`` ``[E, H, I]`` (MoE); ``CausalLM.load_weights`` also maps the per-expert
layout (``experts.{e}.gate_proj.weight`` ...) onto them.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from oasiskv.config import MoeConfig
from oasiskv.layers import ops
from oasiskv.layers.parallel import RowLinear, all_reduce, column_linear, current, split_param


class MLP(nn.Module):
    """``[T, H] -> [T, H]``: ``down(silu(gate(x)) * up(x))``; ``intermediate``: this rank's width
    (tensor parallelism splits it)."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.intermediate = intermediate
        self.gate_up_proj = column_linear(hidden, 2 * self.intermediate, parts=2)
        self.down_proj = RowLinear(self.intermediate, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(ops.silu_mul(self.gate_up_proj(x)))


def route(logits: torch.Tensor, top_k: int,
          renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits ``[T, E]`` -> (float32 weights ``[T, k]``, expert ids ``[T, k]``): softmax in
    float32, the k largest, renormalised to sum 1 when ``renormalize`` (Qwen3-MoE's
    ``norm_topk_prob``), then rounded to the logits' dtype as transformers does."""
    weights, ids = torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float32), top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype).float(), ids


class Experts(nn.Module):
    """Every expert's weights, this rank's share of each expert's width (column / row split as the
    dense MLP's)."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int):
        super().__init__()
        self.gate_up_proj = split_param(
            nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden)), "column", parts=2)
        self.down_proj = split_param(
            nn.Parameter(torch.empty(num_experts, hidden, intermediate)), "row")


class SparseMoE(nn.Module):
    """``[T, H] -> [T, H]``: each token through its ``top_k`` experts (``route``), their outputs
    summed with the routing weights (``ops.fused_moe``); under tensor parallelism every rank runs
    every expert on its share of the width and the ranks' outputs are summed."""

    def __init__(self, hidden: int, moe: MoeConfig):
        super().__init__()
        self.moe = moe
        self.intermediate, self.tp = moe.intermediate_size, current()
        self.gate = nn.Linear(hidden, moe.num_experts, bias=False)
        self.experts = Experts(moe.num_experts, hidden, self.intermediate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(F.linear(x, self.gate.weight), self.moe.top_k,
                             self.moe.norm_topk_prob)
        return all_reduce(ops.fused_moe(x, self.experts.gate_up_proj, self.experts.down_proj,
                                        weights, ids), self.tp)
