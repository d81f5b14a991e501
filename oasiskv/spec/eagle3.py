"""EAGLE-3 draft head in its published HF layout (``LlamaForCausalLMEagle3``).

Weights: ``fc.weight`` [H, 3H] fuses the target's residual stream after three decoder layers
(``eagle_config.eagle_aux_hidden_state_layer_ids``); one decoder layer ``midlayer.*`` whose q/k/v
projections read ``concat(input_layernorm(embed(token)), hidden_norm(fc(features)))`` (embedding
first), Llama attention with RoPE, SwiGLU MLP; ``norm``; ``lm_head`` over a reduced draft vocabulary;
``d2t`` maps draft id -> target id (target = draft + d2t[draft]). Token embeddings are the target's.
Alignment: position i combines the target's features at i with the embedding of token i+1 and
predicts token i+2. Feature layer ids are read as "the residual stream after decoder layer i" (the
fixture head's convention; some serving stacks take the stream *before* layer i instead).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from oasiskv.config import RopeConfig
from oasiskv.kernels.reference import qk_norm_rope_ref, rms_norm_ref
from oasiskv.engine.sequence import Sequence
from oasiskv.layers.rotary import RotaryEmbedding
from oasiskv.spec.base import Drafter


class Eagle3Head(nn.Module):
    def __init__(self, cfg: dict, dtype: torch.dtype = torch.float32, max_positions: int = 0):
        super().__init__()
        h, heads, kv_heads = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
        d = cfg.get("head_dim") or h // heads
        self.heads, self.kv_heads, self.head_dim, self.eps = heads, kv_heads, d, cfg.get("rms_norm_eps", 1e-6)
        self.aux_layers = tuple(cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
        lin = lambda i, o: nn.Linear(i, o, bias=False, dtype=dtype)  # noqa: E731
        self.fc = lin(3 * h, h)
        self.q_proj, self.k_proj, self.v_proj = lin(2 * h, heads * d), lin(2 * h, kv_heads * d), lin(2 * h, kv_heads * d)
        self.o_proj = lin(heads * d, h)
        self.gate_proj, self.up_proj = lin(h, cfg["intermediate_size"]), lin(h, cfg["intermediate_size"])
        self.down_proj = lin(cfg["intermediate_size"], h)
        self.norms = nn.ParameterDict({n: nn.Parameter(torch.ones(h, dtype=dtype)) for n in
                                       ("hidden_norm", "input_layernorm", "post_attention_layernorm", "norm")})
        self.lm_head = lin(h, cfg["draft_vocab_size"])
        self.register_buffer("d2t", torch.zeros(cfg["draft_vocab_size"], dtype=torch.long))
        theta = cfg.get("rope_theta") or cfg.get("rope_parameters", {}).get("rope_theta", 10000.0)
        scaling = cfg.get("rope_scaling") or {}
        scaling = scaling if scaling.get("rope_type", scaling.get("type")) == "llama3" else None
        positions = max(cfg.get("max_position_embeddings", 4096), max_positions)
        self.rotary = RotaryEmbedding(d, positions, RopeConfig(float(theta), scaling))

    def _norm(self, name: str, x: torch.Tensor) -> torch.Tensor:
        return rms_norm_ref(x, self.norms[name], self.eps)

    def forward(self, features: torch.Tensor, next_embeds: torch.Tensor, positions: torch.Tensor,
                cache: dict | None = None) -> torch.Tensor:
        """Causal pass over consecutive positions: features ``[T, 3H]`` (target residual streams at
        positions i, concatenated in ``aux_layers`` order), next_embeds ``[T, H]`` (embedding of token
        i+1) -> target-vocabulary ids ``[T]`` of the guessed token i+2. With ``cache`` (a dict, empty at
        first) the positions continue the ones already cached there, whose K/V the pass attends to and
        extends."""
        t = features.shape[0]
        fused = self.fc(features)
        x = torch.cat([self._norm("input_layernorm", next_embeds), self._norm("hidden_norm", fused)], dim=-1)
        q = self.q_proj(x).view(t, self.heads, self.head_dim)
        k = self.k_proj(x).view(t, self.kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.kv_heads, self.head_dim)
        qk_norm_rope_ref(q, k, positions, self.rotary.cos_sin, None, None, self.eps)  # RoPE in place
        k, v = k.transpose(0, 1), v.transpose(0, 1)                       # [Hk, T, D]
        mask = None
        if cache is not None:
            if "k" in cache:
                k, v = torch.cat([cache["k"], k], dim=1), torch.cat([cache["v"], v], dim=1)
                past = k.shape[1] - t
                mask = torch.arange(k.shape[1], device=k.device)[None, :] <= past + torch.arange(t, device=k.device)[:, None]
            cache["k"], cache["v"] = k, v
        group = self.heads // self.kv_heads
        attn = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.repeat_interleave(group, 0)[None],
                                              v.repeat_interleave(group, 0)[None], attn_mask=mask,
                                              is_causal=mask is None)
        h = fused + self.o_proj(attn[0].transpose(0, 1).reshape(t, -1))
        m = self._norm("post_attention_layernorm", h)
        h = h + self.down_proj(F.silu(self.gate_proj(m)) * self.up_proj(m))
        draft = self.lm_head(self._norm("norm", h)).argmax(-1)
        return draft + self.d2t[draft]


def load_eagle3(path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                max_positions: int = 0) -> Eagle3Head:
    """Load an EAGLE-3 head folder (``config.json`` + ``model.safetensors``). Raises ValueError when a
    tensor is missing or has the wrong shape."""
    from safetensors.torch import load_file
    path = Path(path)
    cfg = json.loads((path / "config.json").read_text())
    if "eagle_config" not in cfg or "draft_vocab_size" not in cfg:
        raise ValueError(f"{path} is not an EAGLE-3 head (config.json lacks eagle_config / draft_vocab_size)")
    head = Eagle3Head(cfg, dtype, max_positions)
    names = {"fc.weight": "fc.weight", "lm_head.weight": "lm_head.weight", "d2t": "d2t", "norm.weight": "norms.norm"}
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
        names[f"midlayer.self_attn.{proj}.weight"] = f"{proj}.weight"
    for proj in ("gate_proj", "up_proj", "down_proj"):
        names[f"midlayer.mlp.{proj}.weight"] = f"{proj}.weight"
    for norm in ("hidden_norm", "input_layernorm", "post_attention_layernorm"):
        names[f"midlayer.{norm}.weight"] = f"norms.{norm}"
    tensors = load_file(str(path / "model.safetensors"))
    state = head.state_dict()
    for src, dst in names.items():
        if src not in tensors:
            raise ValueError(f"EAGLE-3 checkpoint {path} lacks {src!r}")
        if tuple(tensors[src].shape) != tuple(state[dst].shape):
            raise ValueError(f"EAGLE-3 tensor {src!r} has shape {tuple(tensors[src].shape)}, expected "
                             f"{tuple(state[dst].shape)}")
        state[dst] = tensors[src].to(state[dst].dtype)
    head.load_state_dict(state)
    return head.to(device).eval()


class Eagle3Drafter(Drafter):
    """``eagle3:PATH``: the head as an online drafter. Every step it runs the positions the target just
    computed (prefill chunks and decode rows alike) against its own per-sequence K/V cache; the last
    position's output is the sequence's next guess."""

    def __init__(self, path: str, target_model, device: torch.device | None = None):
        if target_model is None:
            raise ValueError("the eagle3 drafter needs the target model (its embeddings and features)")
        dtype = target_model.embed_tokens.weight.dtype
        self.head = load_eagle3(path, dtype=dtype, device=device or target_model.embed_tokens.weight.device,
                                max_positions=target_model.rotary.cos_sin.shape[0])
        cfg, hidden = target_model.cfg, self.head.fc.weight.shape[0]
        if hidden != cfg.hidden_size or max(self.head.aux_layers) >= cfg.num_layers:
            raise ValueError(f"EAGLE-3 head {path} does not fit this model: hidden {hidden} vs {cfg.hidden_size}, "
                             f"feature layers {self.head.aux_layers} of {cfg.num_layers}")
        if int((torch.arange(len(self.head.d2t), device=self.head.d2t.device) + self.head.d2t).max()) >= cfg.vocab_size:
            raise ValueError(f"EAGLE-3 head {path} maps draft ids past this model's vocabulary ({cfg.vocab_size})")
        self.aux_layers = self.head.aux_layers
        self.embed = target_model.embed_tokens
        self.caches: dict[int, dict] = {}
        self.guesses: dict[int, int] = {}

    @torch.inference_mode()
    def observe(self, batch, features):
        start = 0
        for seq, n in zip(batch.seqs, batch.num_tokens):
            rows, start = features[start:start + n], start + n
            if seq.is_finished:
                continue
            first = seq.num_computed_tokens - n
            if first == 0:  # a new sequence, or one recomputed after preemption
                self.caches[seq.seq_id] = {}
            device = rows.device
            nxt = torch.tensor(seq.token_ids[first + 1:first + n + 1], device=device)
            pos = torch.arange(first, first + n, device=device)
            guess = self.head(rows.to(self.head.fc.weight.dtype), self.embed(nxt), pos, self.caches[seq.seq_id])
            self.guesses[seq.seq_id] = int(guess[-1])

    def propose(self, seqs):
        return [self.guesses.get(s.seq_id) for s in seqs]

    def release(self, seq: Sequence) -> None:
        self.caches.pop(seq.seq_id, None)
        self.guesses.pop(seq.seq_id, None)
