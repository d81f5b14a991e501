"""Configuration: frozen dataclasses for the model (read from an HF ``config.json``) and the engine.

``EngineConfig`` holds every user-facing engine setting; the CLI builds its flags from these fields
and their ``help`` metadata, so the two cannot drift. ``ModelConfig`` is derived from the checkpoint
and is never set by hand. Values spelled ``"auto"`` / ``0`` are resolved later by the engine
(``ModelRunner`` sizes the KV pool), which logs what they became.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

import torch

_DTYPES = {
    "auto": None, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
    "fp16": torch.float16, "half": torch.float16, "float32": torch.float32, "fp32": torch.float32,
    "float": torch.float32,
}

#: HF architecture name -> switches of the shared decoder.
ARCHITECTURES = {
    "Qwen3ForCausalLM": dict(qk_norm=True, qkv_bias=False),
    "Qwen2ForCausalLM": dict(qk_norm=False, qkv_bias=True),
    "LlamaForCausalLM": dict(qk_norm=False, qkv_bias=False),
    "Qwen3MoeForCausalLM": dict(qk_norm=True, qkv_bias=False),
}


def parse_dtype(name: str | torch.dtype | None) -> torch.dtype | None:
    """Map a dtype spelling to a torch dtype; ``"auto"``/None -> None. Raises ValueError on unknown
    names."""
    if name is None or isinstance(name, torch.dtype):
        return name
    key = str(name).lower().removeprefix("torch.")
    if key not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}; use one of bfloat16, float16, float32, auto")
    return _DTYPES[key]


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters; ``scaling`` is None or the HF llama3 scaling dict."""
    theta: float = 10000.0
    scaling: dict | None = None


@dataclass(frozen=True)
class MoeConfig:
    """Mixture-of-experts MLPs (Qwen3-MoE): ``num_experts`` experts of ``intermediate_size``, each
    token routed to ``top_k`` of them (softmax over the router logits, the top-k weights
    renormalised to sum 1 when ``norm_topk_prob``); ``sparse_layers`` are the layers with experts,
    the others keep the dense MLP."""
    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool
    sparse_layers: tuple[int, ...]

    @classmethod
    def from_hf_dict(cls, cfg: dict, num_layers: int) -> "MoeConfig":
        step = cfg.get("decoder_sparse_step", 1) or 1
        dense = set(cfg.get("mlp_only_layers") or [])
        experts = cfg.get("num_experts", cfg.get("num_local_experts"))  # hub / transformers-5
        if experts is None:
            raise KeyError("num_experts")
        top_k = cfg["num_experts_per_tok"]
        if not 0 < top_k <= experts:
            raise ValueError(f"num_experts_per_tok must be in [1, num_experts={experts}], "
                             f"got {top_k}")
        return cls(experts, top_k, cfg["moe_intermediate_size"],
                   bool(cfg.get("norm_topk_prob", False)),
                   tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0))


@dataclass(frozen=True)
class ModelConfig:
    """Architecture facts the decoder needs, read from an HF ``config.json`` (both rope
    spellings)."""
    architecture: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    qk_norm: bool
    qkv_bias: bool
    dtype: torch.dtype
    eos_token_ids: tuple[int, ...] = ()
    moe: MoeConfig | None = None

    @classmethod
    def from_hf_dict(cls, cfg: dict) -> "ModelConfig":
        arch = (cfg.get("architectures") or [None])[0]
        if arch not in ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {arch!r}; supported: {', '.join(ARCHITECTURES)}")
        try:
            num_heads = cfg["num_attention_heads"]
            hidden = cfg["hidden_size"]
            rope_params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
            theta = rope_params.pop("rope_theta", None) or cfg.get("rope_theta", 10000.0)
            rope_type = rope_params.get("rope_type", rope_params.get("type", "default"))
            if rope_type not in ("default", "llama3"):
                raise ValueError(f"unsupported rope_type {rope_type!r}; supported: default, llama3")
            eos = cfg.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
            if cfg.get("hidden_act", "silu") != "silu":
                raise ValueError(f"unsupported hidden_act {cfg['hidden_act']!r}; supported: silu")
            moe = (MoeConfig.from_hf_dict(cfg, cfg["num_hidden_layers"])
                   if arch == "Qwen3MoeForCausalLM" else None)
            return cls(
                architecture=arch,
                hidden_size=hidden,
                intermediate_size=cfg["intermediate_size"],
                num_layers=cfg["num_hidden_layers"],
                num_heads=num_heads,
                num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
                head_dim=cfg.get("head_dim") or hidden // num_heads,
                vocab_size=cfg["vocab_size"],
                rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
                rope=RopeConfig(float(theta), rope_params if rope_type == "llama3" else None),
                max_position_embeddings=cfg.get("max_position_embeddings", 4096),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                dtype=parse_dtype(cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16"),
                eos_token_ids=eos_ids,
                moe=moe,
                **ARCHITECTURES[arch],
            )
        except KeyError as exc:
            raise ValueError(f"config.json is missing required field {exc.args[0]!r}") from None

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        try:
            return cls.from_hf_dict(json.loads(path.read_text()))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} is not valid JSON: {exc}") from None

    def shard(self, size: int) -> "ModelConfig":
        """This config as one of ``size`` tensor-parallel ranks sees it: its query and kv heads,
        its share of the MLP and expert widths (the vocabulary stays whole: the embedding splits
        it). ValueError when something does not divide."""
        if size == 1:
            return self
        counts = {"num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
                  "intermediate_size": self.intermediate_size, "vocab_size": self.vocab_size}
        if self.moe is not None:
            counts["moe_intermediate_size"] = self.moe.intermediate_size
        for name, n in counts.items():
            if n % size:
                raise ValueError(f"{name} ({n}) does not divide by tensor_parallel_size {size}")
        moe = (None if self.moe is None
               else replace(self.moe, intermediate_size=self.moe.intermediate_size // size))
        return replace(self, num_heads=self.num_heads // size,
                       num_kv_heads=self.num_kv_heads // size,
                       intermediate_size=self.intermediate_size // size, moe=moe)

    def num_parameters(self) -> int:
        """Parameters of the model: embeddings, attention, dense MLPs, experts and routers (norms
        and biases left out)."""
        h, kv = self.hidden_size, self.num_kv_heads * self.head_dim
        attention = h * (self.num_heads * self.head_dim * 2 + 2 * kv)
        sparse = len(self.moe.sparse_layers) if self.moe else 0
        experts = self.moe.num_experts * (3 * h * self.moe.intermediate_size + h) if sparse else 0
        return (self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
                + self.num_layers * attention + sparse * experts
                + (self.num_layers - sparse) * 3 * h * self.intermediate_size)

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes of K and V of one token over all layers stored as ``dtype`` (FP8: with scales)."""
        from oasiskv.kernels.fp8 import row_bytes
        return 2 * self.num_layers * self.num_kv_heads * row_bytes(self.head_dim, dtype)


def _opt(default, help: str, **kw):
    return field(default=default, metadata={"help": help, **kw})


#: ``--draft`` spellings: ``none`` selects with the current token's own query (synchronous
#: retrieval); the others select one step ahead (lookahead) from a prediction of the next query
DRAFTS = "none, previous, ngram, model:PATH or eagle3:PATH"


@dataclass(frozen=True)
class TierConfig:
    """Tiered KV settings (``kv_mode=oasis``): working-set size, fetch cap, host store,
    lookahead."""
    topk_blocks: int = _opt(128, "oasis: K, resident blocks per (sequence, layer, kv-head) besides "
                            "the local block")
    fetch_ratio: float = _opt(0.05, "oasis: f_HBM, at most ceil(f*K) new blocks per head per layer "
                              "per step after seeding (1.0 = no cap)")
    host_kv_gib: float = _opt(0.0, "oasis: host store size in GiB (pinned on CUDA); 0 = 4 GiB, a "
                              "setting, never read from MemTotal")
    score_alpha: float = _opt(1.0, "oasis: alpha in score = q.c + alpha*|q|.r over block min/max "
                              "summaries")
    summary_dtype: str = _opt("auto", "oasis: block summaries in HBM: auto (as the KV cache: fp8 "
                              "with --kv-cache-dtype fp8 or int8, else the model's dtype), fp8 "
                              "(e4m3 rows with a scale each: half the HBM and half the bytes each "
                              "selection scans) or model (the model's dtype)")
    draft: str = _opt("none", "oasis: how the working set is chosen: none (select with the current "
                      "token's query before attention: synchronous retrieval) or lookahead, one "
                      "step ahead, from: previous (the current query predicts the next), ngram "
                      "(prompt lookup), model:PATH (a small LM with the same tokenizer), "
                      "eagle3:PATH (an EAGLE-3 head for this model)")
    prefetch: str = _opt("async", "oasis: where selection and fetch run: async (lookahead: side "
                         "CUDA streams, the foreground waits per layer on the device), inline (on "
                         "the foreground stream), off (never after seeding: the foreground's cost "
                         "alone, for measurements)")

    f_host: float = _opt(1.0, "oasis: decode-host cache: each running request keeps at most "
                         "f_host * P + F of its blocks in host memory (P prompt blocks, F "
                         "generated), the rest of its prompt read again from the remote tier when "
                         "selected; < 1 on a disaggregated decode worker only (--role decode), "
                         "with a lookahead --draft")
    remote_stall_ms: float = _opt(2.0, "oasis, decode-host cache: how long a step waits at most "
                                  "for blocks read again from the remote tier; the requests whose "
                                  "reads take longer sit out steps until their blocks land (the "
                                  "others go on), and end with an error if a read fails or passes "
                                  "--remote-timeout")

    guardrail_rate: float = _opt(0.0, "oasis: online fidelity guardrail: the share of decode rows "
                                 "per step measured (at one random layer) against exact attention "
                                 "over their whole context; 0 = off")
    measure_stall: bool = _opt(True, "oasis: time the foreground's waits for retrieval on the "
                               "device clock (two one-program kernels per layer) for the stall "
                               "metrics")

    def __post_init__(self):
        if not 0.0 <= self.guardrail_rate <= 1.0:
            raise ValueError(f"guardrail_rate must be in [0, 1], got {self.guardrail_rate}")
        if self.topk_blocks < 1 or not 0.0 < self.fetch_ratio <= 1.0 or self.host_kv_gib < 0:
            raise ValueError("topk_blocks must be >= 1, fetch_ratio in (0, 1], host_kv_gib >= 0")
        kind, _, path = self.draft.partition(":")
        if not ((kind in ("none", "previous", "ngram") and not path)
                or (kind in ("model", "eagle3") and path)):
            raise ValueError(f"unknown draft {self.draft!r}: use {DRAFTS}")
        if not 0.0 < self.f_host <= 1.0:
            raise ValueError(f"f_host must be in (0, 1], got {self.f_host}")
        if not self.remote_stall_ms >= 0.0:
            raise ValueError(f"remote_stall_ms must be >= 0, got {self.remote_stall_ms}")
        if self.f_host < 1.0 and not self.lookahead:
            raise ValueError("f_host < 1 needs a lookahead --draft: blocks read again from the "
                             "remote tier are read between steps, for the next step's selection")
        if self.summary_dtype not in ("auto", "fp8", "model"):
            raise ValueError(f"summary_dtype must be auto, fp8 or model, got "
                             f"{self.summary_dtype!r}")
        if self.prefetch not in ("async", "inline", "off"):
            raise ValueError(f"prefetch must be async, inline or off, got {self.prefetch!r}")

    @property
    def lookahead(self) -> bool:
        """Whether selection runs one step ahead (every ``draft`` but ``none``)."""
        return self.draft != "none"


@dataclass(frozen=True)
class EngineConfig:
    """Engine settings. The CLI exposes every field as ``--field-name`` (``tier``'s fields too)."""
    model: str = _opt("", "local HF model folder, hub id, or bench preset; empty = built-in demo "
                      "model", cli=False)
    dtype: str = _opt("auto", "weights/activations dtype: auto (checkpoint dtype on GPU, float32 "
                      "on CPU), bfloat16, float16, float32")
    device: str = _opt("auto", "auto, cuda, cuda:N or cpu")
    max_model_len: int = _opt(0, "longest prompt + output in tokens; 0 = the model's "
                              "max_position_embeddings")
    max_num_seqs: int = _opt(256, "most sequences in one decode batch")
    max_num_batched_tokens: int = _opt(8192, "most prompt tokens in one prefill step (longer "
                                       "prompts are prefilled in chunks)")
    block_size: int = _opt(0, "tokens per KV block; 0 = auto: 32 for a dense pool of 8-bit KV "
                           "(its paged decode reads 8-bit values fastest in blocks of 32 "
                           "tokens: docs/benchmarks.md section 30), else 16")
    gpu_memory_utilization: float = _opt(0.90, "fraction of GPU memory the engine may use "
                                         "(weights, activations and the KV pool sized from it "
                                         "after a warm-up)")
    num_kv_blocks: int = _opt(0, "KV pool size in blocks; 0 = size from memory (GPU) or 4 GiB "
                              "(CPU)")
    cpu_threads: int = _opt(0, "CPU only: intra-op threads per step; 0 = auto: one for decode "
                            "steps under 16 tokens (too small to split, and a second thread only "
                            "waits when another process holds a core), every usable core for "
                            "larger steps")
    enforce_eager: bool = _opt(False, "disable CUDA-graph capture of decode")
    async_scheduling: bool = _opt(True, "launch each decode step before the previous step's "
                                  "tokens reach the host (its inputs are those tokens on the "
                                  "device), so the host's work between steps overlaps the "
                                  "device's; dense KV on one rank (other setups run steps one at "
                                  "a time)")
    max_graph_batch: int = _opt(256, "largest decode batch captured in a CUDA graph")
    seed: int = _opt(0, "seed for random sampling of requests without their own seed")
    load_format: str = _opt("auto", "auto (safetensors) or dummy (random weights, for benchmarks)")
    tensor_parallel_size: int = _opt(1, "ranks the model is split over (one process and, with "
                                     "CUDA, one GPU each; rank r on cuda:r); the tiered KV "
                                     "host store (host_kv_gib) is split over them too")
    kv_mode: str = _opt("dense", "dense (paged KV in HBM) or oasis (full KV in host memory, "
                        "per-head working sets of topk_blocks blocks in HBM)")
    kv_cache_dtype: str = _opt("auto", "how K/V are stored (paged pool, host store, working sets): "
                               "auto (the model's dtype), fp8 (e4m3) or int8, with one float32 "
                               "scale per token and kv head (int8 keeps keys closer: "
                               "kernels/fp8.py)")
    kv_open_block: str = _opt("model", "with an 8-bit KV cache (dense pool or tiered working "
                              "sets), each running sequence's open block (the one its tokens are "
                              "written into) is also kept in the model's dtype and decode reads "
                              "it from there: model, or kv (read it from the 8-bit cache too; "
                              "kernels/fp8.py)")
    tier: TierConfig = _opt(TierConfig(), "tiered KV settings (kv_mode=oasis)", cli=False)

    def __post_init__(self):
        if self.block_size == 0:  # (frozen: the resolved size is set once, here)
            object.__setattr__(self, "block_size", 32 if self.kv_mode == "dense"
                               and self.kv_cache_dtype != "auto" else 16)
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "max_graph_batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got "
                             f"{self.gpu_memory_utilization}")
        if self.max_model_len < 0 or self.num_kv_blocks < 0:
            raise ValueError("max_model_len and num_kv_blocks must be >= 0")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be auto or dummy, got {self.load_format!r}")
        if self.kv_mode not in ("dense", "oasis"):
            raise ValueError(f"kv_mode must be dense or oasis, got {self.kv_mode!r}")
        if self.kv_cache_dtype not in ("auto", "fp8", "int8"):
            raise ValueError(f"kv_cache_dtype must be auto, fp8 or int8, got "
                             f"{self.kv_cache_dtype!r}")
        if self.kv_open_block not in ("model", "kv"):
            raise ValueError(f"kv_open_block must be model or kv, got {self.kv_open_block!r}")
        if self.tier.lookahead and self.kv_mode != "oasis":
            raise ValueError("draft (lookahead) needs kv_mode=oasis")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        parse_dtype(self.dtype)

    @property
    def fp8_summaries(self) -> bool:
        """Whether tiered KV stores its block summaries as FP8 (``summary_dtype``; ``auto``
        follows ``kv_cache_dtype``: FP8 summaries with either 8-bit KV)."""
        dtype = self.tier.summary_dtype
        return dtype == "fp8" or dtype == "auto" and self.kv_cache_dtype != "auto"

    @classmethod
    def from_flat(cls, **settings) -> "EngineConfig":
        """An ``EngineConfig`` from flat keyword settings: ``TierConfig`` field names go to
        ``tier``. Raises TypeError on an unknown name."""
        tier_names = {f.name for f in fields(TierConfig)}
        tier = {k: settings.pop(k) for k in list(settings) if k in tier_names}
        base = settings.pop("tier", TierConfig())
        return cls(**settings, tier=replace(base, **tier) if tier else base)

    @staticmethod
    def cli_fields():
        """Fields the CLI turns into flags, with their help text: the engine's, then the tier's."""
        return [f for f in fields(EngineConfig) + fields(TierConfig) if f.metadata.get("cli", True)]
