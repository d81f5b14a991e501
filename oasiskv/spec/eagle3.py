"""EAGLE-3 draft head in its published HF layout (``LlamaForCausalLMEagle3``).

Weights: ``fc.weight`` [H, 3H] fuses the target's residual stream after three decoder layers
(``eagle_config.eagle_aux_hidden_state_layer_ids``); one decoder layer ``midlayer.*`` whose q/k/v
projections read ``concat(input_layernorm(embed(token)), hidden_norm(fc(features)))`` (embedding
first), Llama attention with RoPE, SwiGLU MLP; ``norm``; ``lm_head`` over a reduced draft
vocabulary; ``d2t`` maps draft id -> target id (target = draft + d2t[draft]). Token embeddings are
the target's. Alignment: position i combines the target's features at i with the embedding of token
i+1 and predicts token i+2. Feature layer ids are read as "the residual stream after decoder layer
i" (the fixture head's convention; some serving stacks take the stream *before* layer i instead).
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
        h, heads, kv_heads = (cfg["hidden_size"], cfg["num_attention_heads"],
                              cfg["num_key_value_heads"])
        d = cfg.get("head_dim") or h // heads
        self.heads, self.kv_heads, self.head_dim, self.eps = (heads, kv_heads, d,
                                                              cfg.get("rms_norm_eps", 1e-6))
        self.aux_layers = tuple(cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
        lin = lambda i, o: nn.Linear(i, o, bias=False, dtype=dtype)  # noqa: E731
        self.fc = lin(3 * h, h)
        self.q_proj, self.k_proj, self.v_proj = (lin(2 * h, heads * d), lin(2 * h, kv_heads * d),
                                                 lin(2 * h, kv_heads * d))
        self.o_proj = lin(heads * d, h)
        self.gate_proj, self.up_proj = (lin(h, cfg["intermediate_size"]),
                                        lin(h, cfg["intermediate_size"]))
        self.down_proj = lin(cfg["intermediate_size"], h)
        self.norms = nn.ParameterDict({n: nn.Parameter(torch.ones(h, dtype=dtype)) for n in
                                       ("hidden_norm", "input_layernorm",
                                        "post_attention_layernorm", "norm")})
        self.lm_head = lin(h, cfg["draft_vocab_size"])
        self.register_buffer("d2t", torch.zeros(cfg["draft_vocab_size"], dtype=torch.long))
        theta = cfg.get("rope_theta") or cfg.get("rope_parameters", {}).get("rope_theta", 10000.0)
        scaling = cfg.get("rope_scaling") or {}
        scaling = scaling if scaling.get("rope_type", scaling.get("type")) == "llama3" else None
        positions = max(cfg.get("max_position_embeddings", 4096), max_positions)
        self.rotary = RotaryEmbedding(d, positions, RopeConfig(float(theta), scaling))

    def _norm(self, name: str, x: torch.Tensor) -> torch.Tensor:
        return rms_norm_ref(x, self.norms[name], self.eps)

    def forward(self, features: torch.Tensor, next_embeds: torch.Tensor,
                positions: torch.Tensor) -> torch.Tensor:
        """Causal pass over the positions of one sequence from its start: features ``[T, 3H]``
        (target residual streams at positions i, concatenated in ``aux_layers`` order), next_embeds
        ``[T, H]`` (embedding of token i+1) -> target-vocabulary ids ``[T]`` of the guessed token
        i+2."""
        fused, q, k, v = self.project(features, next_embeds, positions)
        return self.finish(fused, self.attend(q, k.transpose(0, 1), v.transpose(0, 1), 0))

    def project(self, features: torch.Tensor, next_embeds: torch.Tensor, positions: torch.Tensor):
        """Rows of any sequences -> ``fused [T, H]``, RoPE'd ``q [T, Hq, D]``,
        ``k``/``v [T, Hk, D]``."""
        t = features.shape[0]
        fused = self.fc(features)
        x = torch.cat([self._norm("input_layernorm", next_embeds),
                       self._norm("hidden_norm", fused)], dim=-1)
        q = self.q_proj(x).view(t, self.heads, self.head_dim)
        k = self.k_proj(x).view(t, self.kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.kv_heads, self.head_dim)
        # RoPE in place
        qk_norm_rope_ref(q, k, positions, self.rotary.cos_sin, None, None, self.eps)
        return fused, q, k, v

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: int) -> torch.Tensor:
        """One sequence: queries ``[n, Hq, D]`` at its positions ``past .. past+n-1`` over its keys
        and values ``[Hk, past+n, D]`` (causal) -> ``[n, Hq * D]``."""
        n, total = q.shape[0], k.shape[1]
        q4 = q.transpose(0, 1)[None]
        if n == 1:  # a decode row sees every key: no mask, grouped heads without copying the keys
            out = F.scaled_dot_product_attention(q4, k[None], v[None], enable_gqa=True)
        else:
            group = self.heads // self.kv_heads
            mask = None if past == 0 else (torch.arange(total, device=q.device)[None, :]
                                           <= past + torch.arange(n, device=q.device)[:, None])
            out = F.scaled_dot_product_attention(q4, k.repeat_interleave(group, 0)[None],
                                                 v.repeat_interleave(group, 0)[None],
                                                 attn_mask=mask, is_causal=mask is None)
        return out[0].transpose(0, 1).reshape(n, -1)

    def finish(self, fused: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Rows of any sequences: ``fused [T, H]`` and their attention ``[T, Hq * D]`` -> target
        ids ``[T]``."""
        h = fused + self.o_proj(attn)
        m = self._norm("post_attention_layernorm", h)
        h = h + self.down_proj(F.silu(self.gate_proj(m)) * self.up_proj(m))
        draft = self.lm_head(self._norm("norm", h)).argmax(-1)
        return draft + self.d2t[draft]


class HeadCache:
    """One sequence's K/V for the head, ``[Hk, capacity, D]`` each, of which the first ``length``
    positions are filled; capacity doubles when full (amortized O(1) per appended position), up to
    ``max_len`` positions when given (what the tier budgets per sequence)."""

    def __init__(self, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                 max_len: int | None = None):
        self.k = self.v = torch.empty(kv_heads, 0, head_dim, dtype=dtype, device=device)
        self.length, self.max_len = 0, max_len

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add ``k``/``v [n, Hk, D]`` -> views of every position so far, ``[Hk, length, D]``."""
        end = self.length + k.shape[0]
        if end > self.k.shape[1]:
            capacity = max(end, 2 * self.k.shape[1], 64)
            if self.max_len is not None:
                capacity = max(end, min(capacity, self.max_len))
            self.k, self.v = self._grown(self.k, capacity), self._grown(self.v, capacity)
        self.k[:, self.length:end] = k.transpose(0, 1)
        self.v[:, self.length:end] = v.transpose(0, 1)
        self.length = end
        return self.k[:, :end], self.v[:, :end]

    def _grown(self, x: torch.Tensor, capacity: int) -> torch.Tensor:
        grown = x.new_empty(x.shape[0], capacity, x.shape[2])
        grown[:, :self.length] = x[:, :self.length]
        return grown


def load_eagle3(path: str | Path, dtype: torch.dtype = torch.float32,
                device: str | torch.device = "cpu", max_positions: int = 0) -> Eagle3Head:
    """Load an EAGLE-3 head folder (``config.json`` + ``model.safetensors``). Raises ValueError when
    a tensor is missing or has the wrong shape."""
    from safetensors.torch import load_file
    path = Path(path)
    cfg = json.loads((path / "config.json").read_text())
    if "eagle_config" not in cfg or "draft_vocab_size" not in cfg:
        raise ValueError(f"{path} is not an EAGLE-3 head (config.json lacks eagle_config / "
                         f"draft_vocab_size)")
    head = Eagle3Head(cfg, dtype, max_positions)
    names = {"fc.weight": "fc.weight", "lm_head.weight": "lm_head.weight", "d2t": "d2t",
             "norm.weight": "norms.norm"}
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
            raise ValueError(f"EAGLE-3 tensor {src!r} has shape {tuple(tensors[src].shape)}, "
                             f"expected {tuple(state[dst].shape)}")
        state[dst] = tensors[src].to(state[dst].dtype)
    head.load_state_dict(state)
    return head.to(device).eval()


class Eagle3Drafter(Drafter):
    """``eagle3:PATH``: the head as an online drafter. Every step it runs the positions the target
    just computed (prefill chunks and decode rows alike) against its own per-sequence K/V cache; the
    last position's output is the sequence's next guess."""

    def __init__(self, path: str, target_model, device: torch.device | None = None):
        if target_model is None:
            raise ValueError("the eagle3 drafter needs the target model (its embeddings and "
                             "features)")
        dtype = target_model.embed_tokens.weight.dtype
        self.head = load_eagle3(path, dtype=dtype,
                                device=device or target_model.embed_tokens.weight.device,
                                max_positions=target_model.rotary.cos_sin.shape[0])
        cfg, hidden = target_model.cfg, self.head.fc.weight.shape[0]
        if hidden != cfg.hidden_size or max(self.head.aux_layers) >= cfg.num_layers:
            raise ValueError(f"EAGLE-3 head {path} does not fit this model: hidden {hidden} vs "
                             f"{cfg.hidden_size}, feature layers {self.head.aux_layers} of "
                             f"{cfg.num_layers}")
        if int((torch.arange(len(self.head.d2t), device=self.head.d2t.device)
                + self.head.d2t).max()) >= cfg.vocab_size:
            raise ValueError(f"EAGLE-3 head {path} maps draft ids past this model's vocabulary "
                             f"({cfg.vocab_size})")
        self.aux_layers = self.head.aux_layers
        self.embed = target_model.embed_tokens
        self.caches: dict[int, HeadCache] = {}
        self.max_len: int | None = None  # per-sequence cache bound, set by ``reserve``
        self.guesses: torch.Tensor | None = None  # the last step's, one per row, on the device
        self._guess_ids: dict[int, int] = {}  # seq id -> its row in ``guesses``

    def bytes_per_seq(self, max_len: int) -> int:
        """A sequence's head K/V cache at its largest (``max_len`` positions)."""
        head = self.head
        return 2 * head.kv_heads * head.head_dim * head.fc.weight.element_size() * max_len

    def reserve(self, num_seqs: int, max_len: int) -> None:
        self.max_len = max_len  # caches grow as sequences do, never past this

    @torch.inference_mode()
    def observe(self, batch, features):
        """One head pass over every row of the step: projections, MLP and head batched; attention
        per sequence over its cache. The guesses stay on the device until ``propose`` reads them
        (once)."""
        rows, tokens, positions, spans = [], [], [], []
        start, head, device = 0, self.head, features.device
        for seq, n in zip(batch.seqs, batch.num_tokens):
            first, start = seq.num_computed_tokens - n, start + n
            if first == 0:  # a new sequence, or one recomputed after preemption
                self.caches[seq.seq_id] = HeadCache(head.kv_heads, head.head_dim,
                                                    head.fc.weight.dtype, device, self.max_len)
            cache = self.caches.get(seq.seq_id)
            if seq.is_finished or cache is None or cache.length != first:  # (out of step: no guess)
                continue
            rows.append(torch.arange(start - n, start))
            tokens += seq.token_ids[first + 1:first + n + 1]
            positions.append(torch.arange(first, first + n))
            spans.append((seq.seq_id, first, n))
        self.guesses, self._guess_ids = None, {}
        if not spans:
            return
        index = torch.cat(rows).to(device)
        fused, q, k, v = head.project(features.index_select(0, index).to(head.fc.weight.dtype),
                                      self.embed(torch.tensor(tokens, device=device)),
                                      torch.cat(positions).to(device))
        attn, at = [], 0
        for seq_id, first, n in spans:
            keys, values = self.caches[seq_id].append(k[at:at + n], v[at:at + n])
            attn.append(head.attend(q[at:at + n], keys, values, first))
            at += n
            self._guess_ids[seq_id] = at - 1  # the last row's guess is the sequence's
        self.guesses = head.finish(fused, torch.cat(attn))

    def propose(self, seqs):
        # the step's one device read
        guesses = [] if self.guesses is None else self.guesses.tolist()
        return [guesses[self._guess_ids[s.seq_id]] if s.seq_id in self._guess_ids else None
                for s in seqs]

    def release(self, seq: Sequence) -> None:
        self.caches.pop(seq.seq_id, None)
