"""One decoder-only transformer for Llama, Qwen2, Qwen3 and Qwen3-MoE checkpoints, selected by
switches.

Switches (from ``ModelConfig``): ``qk_norm`` (Qwen3: RMSNorm per head on q and k before RoPE),
``qkv_bias`` (Qwen2), Llama-3 rope scaling (in ``RotaryEmbedding``), tied embeddings, ``moe``
(the layers it names get ``SparseMoE`` instead of the dense ``MLP``).
Q/K/V and gate/up projections are fused into one matrix each, experts into 3-D tensors;
``load_weights`` maps HF names onto the fused slices. The model works on flattened tokens ``[T]``
of a whole batch; attention finds its per-step metadata in the forward context, never in these
signatures.
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from oasiskv.config import ModelConfig
from oasiskv.layers import ops
from oasiskv.layers.attention import Attention
from oasiskv.layers.moe import MLP, SparseMoE
from oasiskv.layers.parallel import (RowLinear, VocabEmbedding, column_linear, current,
                                     gather_logits, shard_for_rank)
from oasiskv.layers.rotary import RotaryEmbedding


class RMSNorm(nn.Module):
    """``forward(x)`` -> norm(x); ``forward(x, residual)`` -> (norm(x + residual), x + residual)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return ops.rms_norm(x, self.weight, self.eps, residual)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, idx: int):
        super().__init__()
        self.cfg = cfg
        hq, hk, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = hq * d, hk * d
        self.qkv_proj = column_linear(cfg.hidden_size, self.q_size + 2 * self.kv_size,
                                      bias=cfg.qkv_bias)
        self.o_proj = RowLinear(self.q_size, cfg.hidden_size)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.attn = Attention(idx, hq, hk, d)
        self.mlp = (SparseMoE(cfg.hidden_size, cfg.moe)
                    if cfg.moe is not None and idx in cfg.moe.sparse_layers
                    else MLP(cfg.hidden_size, cfg.intermediate_size))
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                rotary: RotaryEmbedding) -> tuple[torch.Tensor, torch.Tensor]:
        """Pre-norm block with the residual add fused into the norms: returns (block output,
        residual); the hidden state after the block is their sum."""
        cfg, t = self.cfg, x.shape[0]
        h, residual = ((self.input_layernorm(x), x) if residual is None
                       else self.input_layernorm(x, residual))
        q, k, v = self.qkv_proj(h).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, cfg.num_heads, cfg.head_dim)
        k = k.view(t, cfg.num_kv_heads, cfg.head_dim)
        v = v.view(t, cfg.num_kv_heads, cfg.head_dim)
        norms = ((self.q_norm.weight, self.k_norm.weight) if self.q_norm is not None
                 else (None, None))
        ops.qk_norm_rope(q, k, positions, rotary.cos_sin, *norms, cfg.rms_norm_eps)
        h, residual = self.post_attention_layernorm(
            self.o_proj(self.attn(q, k, v).reshape(t, self.q_size)), residual)
        return self.mlp(h), residual


class CausalLM(nn.Module):
    """The shared decoder. ``forward(input_ids [T], positions [T]) -> hidden [T, hidden]``;
    ``compute_logits(hidden [N, hidden]) -> [N, vocab]`` in float32. Under tensor parallelism
    (``layers/parallel.py``, built inside ``building``) it is this rank's part: ``cfg`` is
    ``ModelConfig.shard`` of the checkpoint's config (its heads and MLP widths), what the attention
    backends size storage from."""

    def __init__(self, cfg: ModelConfig, max_positions: int):
        super().__init__()
        self.tp = current()
        cfg = self.cfg = cfg.shard(self.tp.size)
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope)
        self.lm_head = (None if cfg.tie_word_embeddings
                        else column_linear(cfg.hidden_size, self.embed_tokens.shard))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Final hidden states. Each layer returns (block output, residual): the residual stream
        after layer i is their sum (what forward hooks on ``layers[i]`` can read)."""
        x, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            x, residual = layer(x, residual, positions, self.rotary)
        return self.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return gather_logits(hidden, weight, self.tp)

    # ---- weights -------------------------------------------------------------------------------
    #: HF projection -> (our fused parameter, its index among the fused parts)
    _FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
              "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into the model. Raises ValueError on unknown names, wrong shapes,
        or parameters the checkpoint did not fill."""
        params = dict(self.named_parameters())
        filled = dict.fromkeys(params, 0)
        for hf_name, tensor in weights:
            name, expert, rows = self._map_name(hf_name)
            if name is None:
                continue
            if name not in params:
                raise ValueError(f"checkpoint tensor {hf_name!r} has no place in "
                                 f"{self.cfg.architecture}")
            # this rank's slice
            tensor = shard_for_rank(tensor, params[name], self.tp, expert is None and rows is None)
            target = params[name].data
            if expert is not None:
                target = target[expert]
            if rows is not None:
                target = target.narrow(0, *rows)
            if tuple(target.shape) != tuple(tensor.shape):
                raise ValueError(f"checkpoint tensor {hf_name!r} has shape {tuple(tensor.shape)}, "
                                 f"expected {tuple(target.shape)}: config.json does not match "
                                 f"the weights")
            target.copy_(tensor)
            filled[name] += target.numel()
        missing = sorted(name for name, p in params.items() if filled[name] < p.numel())
        if missing:
            raise ValueError(f"checkpoint is missing tensors for {len(missing)} parameters, e.g. "
                             f"{missing[:3]}")

    def _map_name(self, hf_name: str) -> tuple[str | None, int | None, tuple[int, int] | None]:
        """HF tensor name -> (our parameter name, the expert it is one of (per-expert checkpoint
        layout) or None, (row offset, rows) of a fused slice or None); name None: not ours."""
        if "rotary_emb" in hf_name:
            return None, None, None
        name = hf_name.removeprefix("model.").replace("self_attn.", "")
        if name == "lm_head.weight" and self.lm_head is None:
            return None, None, None
        parts = name.split(".")
        expert, at = None, -2  # at: the projection's part of the name (before ".weight")
        if len(parts) == 7 and parts[3] == "experts" and parts[4].isdigit():  # per-expert layout
            expert, at = int(parts.pop(4)), -1
            parts.pop()  # layers.i.mlp.experts.{e}.gate_proj.weight -> ...experts.gate_proj
        if len(parts) >= 3 and parts[at] in self._FUSED:
            fused, shard = self._FUSED[parts[at]]
            sizes = self._fused_sizes(int(parts[1]), fused)
            parts[at] = fused
            return ".".join(parts), expert, (sum(sizes[:shard]), sizes[shard])
        return ".".join(parts), expert, None

    def _fused_sizes(self, layer: int, fused: str) -> list[int]:
        """Rows of each part of a fused projection of ``layers[layer]`` (this rank's)."""
        block = self.layers[layer]
        if fused == "qkv_proj":
            return [block.q_size, block.kv_size, block.kv_size]
        return [block.mlp.intermediate] * 2

    def init_random(self, std: float = 0.02, seed: int = 0) -> None:
        """Random weights (benchmarks with real shapes): normal(0, std) matrices, unit norms."""
        gen = torch.Generator(device=self.embed_tokens.weight.device).manual_seed(seed)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.data.fill_(1.0)
            else:
                p.data.normal_(0.0, std, generator=gen)

