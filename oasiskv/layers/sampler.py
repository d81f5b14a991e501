"""Sampler: logits -> next tokens (+ logprobs), batched, with per-row settings and no host sync.

Rows with temperature 0 take the argmax. Other rows are scaled by 1/temperature, filtered by top-k,
top-p and min-p, and sampled by the exponential race (argmax of p / E with E ~ Exp(1)), which equals
sampling from p. A row with its own seed draws E from its own generator, so its tokens do not depend
on which other requests share the batch. Logprobs are of the model's raw distribution (before
temperature and filters), as OpenAI and vLLM report them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SamplingTensors:
    """Per-row settings on the logits' device. ``generators[i]`` is None for unseeded rows. When
    ``all_greedy`` the tensors may be None (nothing but the argmax is needed)."""
    temperature: torch.Tensor | None  # [N] float32, 0 = greedy
    top_k: torch.Tensor | None        # [N] int64, <= 0 = off
    top_p: torch.Tensor | None        # [N] float32
    min_p: torch.Tensor | None        # [N] float32
    generators: list[torch.Generator | None]
    all_greedy: bool
    needs_filter: bool
    max_logprobs: int          # largest top-N asked by any row, -1 = none


@dataclass
class SamplerOutput:
    """``tokens`` [N] int64; when logprobs were asked: ``token_logprobs`` [N],
    ``top_ids``/``top_logprobs`` [N, max_logprobs] (all still on the device)."""
    tokens: torch.Tensor
    token_logprobs: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None


def sample(logits: torch.Tensor, st: SamplingTensors,
           generator: torch.Generator | None = None) -> SamplerOutput:
    """logits ``[N, V]`` float32 -> tokens; ``generator`` feeds unseeded rows."""
    greedy = logits.argmax(dim=-1)
    if st.all_greedy:
        tokens = greedy
    else:
        temp = torch.where(st.temperature > 0, st.temperature, torch.ones_like(st.temperature))
        probs = torch.softmax(logits / temp[:, None], dim=-1)
        if st.needs_filter:
            probs = _filter(probs, st)
        noise = torch.empty_like(probs).exponential_(generator=generator)
        for i, gen in enumerate(st.generators):
            if gen is not None:
                noise[i].exponential_(generator=gen)
        sampled = (probs / noise).argmax(dim=-1)
        tokens = torch.where(st.temperature > 0, sampled, greedy)
    out = SamplerOutput(tokens)
    if st.max_logprobs >= 0:
        out.token_logprobs, out.top_ids, out.top_logprobs = token_logprobs(
            logits, tokens, st.max_logprobs)
    return out


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, top_n: int):
    """Log-softmax of ``logits`` [N, V]: the logprob of ``tokens`` [N] and the top-``top_n`` per
    row."""
    logp = torch.log_softmax(logits, dim=-1)
    chosen = logp.gather(-1, tokens[:, None]).squeeze(-1)
    top_lp, top_ids = (logp.topk(top_n, dim=-1) if top_n > 0
                       else (logp[:, :0], tokens[:, None][:, :0]))
    return chosen, top_ids, top_lp


def _filter(probs: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """Zero the probabilities that top-k, top-p or min-p exclude (the top token always survives)."""
    sorted_p, order = probs.sort(dim=-1, descending=True)
    rank = torch.arange(probs.shape[-1], device=probs.device)[None, :]
    k = torch.where(st.top_k > 0, st.top_k, torch.full_like(st.top_k, probs.shape[-1]))
    drop = rank >= k[:, None]
    drop |= (sorted_p.cumsum(-1) - sorted_p) > st.top_p[:, None]
    drop |= sorted_p < (st.min_p * sorted_p[:, 0])[:, None]
    drop[:, 0] = False
    sorted_p = sorted_p.masked_fill(drop, 0.0)
    return torch.zeros_like(probs).scatter_(-1, order, sorted_p)
