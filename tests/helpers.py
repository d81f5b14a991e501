"""Test helpers: tiny random HF checkpoints written with transformers, and greedy reference
decoding."""
from __future__ import annotations

import json
import random
from pathlib import Path

import torch

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=320, max_position_embeddings=1024, rms_norm_eps=1e-6)


#: Qwen3-MoE: 8 experts, 2 per token; layer 1 keeps a dense MLP (mixed layers)
TINY_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48,
                norm_topk_prob=True, mlp_only_layers=[1])


def write_tiny_checkpoint(path: Path, arch: str, old_rope_spelling: bool = False,
                          fused_experts: bool = False, **overrides) -> Path:
    """Save a randomly initialised Qwen3 / Qwen2 / Llama / Qwen3-MoE model (fp32) to ``path`` with
    transformers (which writes MoE experts one by one); ``fused_experts``: rewrite the weights
    with the experts as 3-D tensors (transformers-5's in-memory layout)."""
    import transformers
    cls_cfg, cls_model = {
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen3-moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
    }[arch]
    kw = dict(TINY, **(TINY_MOE if arch == "qwen3-moe" else {}), **overrides)
    if arch.startswith("qwen3"):
        kw.setdefault("head_dim", 32)
    torch.manual_seed(0)
    cfg = cls_cfg(**kw)
    model = cls_model(cfg).to(torch.float32)
    with torch.no_grad():  # make biases, norms and routers non-trivial so switches matter
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)
    model.save_pretrained(path)
    if fused_experts:
        from safetensors.torch import save_file
        for shard in path.glob("*.safetensors"):
            shard.unlink()
        save_file({k: v.contiguous() for k, v in model.state_dict().items()},
                  str(path / "model.safetensors"))
    if old_rope_spelling:
        raw = json.loads((path / "config.json").read_text())
        params = raw.pop("rope_parameters", None) or {}
        raw["rope_theta"] = params.pop("rope_theta", 10000.0)
        if params.get("rope_type", "default") != "default":
            raw["rope_scaling"] = params
        (path / "config.json").write_text(json.dumps(raw))
    return path


def random_request(rng: random.Random, pool_tokens: int, max_tokens: int):
    """A ``Sequence`` of 1 to 40 random prompt tokens in [0, 4) (repeats share prefixes), small
    enough to fit a pool of ``pool_tokens`` alone (the engine enforces that)."""
    from oasiskv.engine.sequence import Sequence
    from oasiskv.sampling_params import SamplingParams
    limit = max(1, pool_tokens - 4)
    prompt = [rng.randrange(4) for _ in range(rng.randrange(1, min(40, limit) + 1))]
    return Sequence(prompt, SamplingParams(max_tokens=max_tokens))


def hf_greedy(path: Path, prompt: list[int], max_new_tokens: int) -> list[int]:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def capture_graph(step):
    """``step`` captured in a CUDA graph, after one warm-up run (kernel compilation) on a side
    stream."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph


def eval_prompts(fixtures_path, llm, n, length, seed=0):
    """``n`` windows of ``length`` tokens at random offsets of the fixture's held-out text."""
    text = "\n".join(json.loads((fixtures_path / "eval_dev.json").read_text())["docs"][:40])
    ids = llm.engine.encode(text)
    rng = random.Random(seed)
    return [ids[s:s + length] for s in (rng.randrange(0, len(ids) - length) for _ in range(n))]
