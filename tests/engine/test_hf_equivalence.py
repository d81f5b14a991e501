"""Greedy tokens equal transformers' on tiny random checkpoints of every supported architecture,
and on the trained fixture model; also through chunked prefill, a tight KV pool (preemption) and
prefix sharing."""
import random

import pytest

from oasiskv import LLM, SamplingParams
from tests.helpers import hf_greedy, write_tiny_checkpoint

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
               "rope_theta": 500000.0}

CASES = {
    "qwen3": dict(arch="qwen3"),
    "qwen2": dict(arch="qwen2"),
    "llama": dict(arch="llama"),
    "llama3-rope-old-spelling": dict(arch="llama", old_rope_spelling=True,
                                     rope_parameters=LLAMA3_ROPE),
    "llama3-rope-new-spelling": dict(arch="llama", rope_parameters=LLAMA3_ROPE),
}


def prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab) for _ in range(rng.randrange(5, 90))] for _ in range(n)]


@pytest.fixture(scope="module", params=list(CASES))
def checkpoint(request, tmp_path_factory):
    kw = dict(CASES[request.param])
    return write_tiny_checkpoint(tmp_path_factory.mktemp(request.param), kw.pop("arch"), **kw)


def test_greedy_matches_transformers(checkpoint):
    batch = prompts(4, 320)
    want = [hf_greedy(checkpoint, p, 24) for p in batch]
    llm = LLM(str(checkpoint), num_kv_blocks=256)
    got = llm.generate(batch, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    assert [o.token_ids for o in got] == want


@pytest.mark.parametrize("engine_kw", [
    dict(max_num_batched_tokens=32),                       # chunked prefill
    dict(num_kv_blocks=14, max_num_seqs=8),                 # preemption by recompute
    dict(max_num_seqs=2),                                   # queueing
], ids=["chunked-prefill", "preemption", "queueing"])
def test_scheduling_does_not_change_tokens(tmp_path, engine_kw):
    path = write_tiny_checkpoint(tmp_path / "m", "qwen3")
    batch = prompts(6, 320, seed=1)
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    want = [o.token_ids for o in LLM(str(path), num_kv_blocks=256).generate(batch, params)]
    llm = LLM(str(path), **engine_kw)
    got = [o.token_ids for o in llm.generate(batch, params)]
    assert got == want
    if "num_kv_blocks" in engine_kw:
        assert llm.engine.scheduler.num_preemptions > 0


def test_prefix_sharing_reuses_blocks_and_keeps_tokens(tmp_path):
    path = write_tiny_checkpoint(tmp_path / "m", "qwen3")
    shared = prompts(1, 320, seed=2)[0] * 2  # long common prefix
    batch = [shared + [5, 6, 7], shared + [8, 9]]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    llm = LLM(str(path), num_kv_blocks=256)
    first = llm.generate(batch[:1], params)[0].token_ids
    computed_before = llm.engine.stats.prompt_tokens_total
    second = llm.generate(batch[1:], params)[0].token_ids
    reused = len(batch[1]) - (llm.engine.stats.prompt_tokens_total - computed_before)
    assert reused >= (len(shared) // 16) * 16 - 16
    solo = LLM(str(path), num_kv_blocks=256).generate(batch, params)
    assert [first, second] == [o.token_ids for o in solo]


def test_fixture_target_matches_transformers(fixtures_path):
    from oasiskv.config import ModelConfig  # noqa: F401  (import check)
    text = "\n".join(__import__("json").loads(
        (fixtures_path / "eval_dev.json").read_text())["docs"][:3])
    llm = LLM(str(fixtures_path / "target"), dtype="float32", num_kv_blocks=256)
    prompt = llm.engine.encode(text)[:300]
    want = hf_greedy(fixtures_path / "target", prompt, 64)
    got = llm.generate([prompt], SamplingParams(max_tokens=64, temperature=0,
                                                ignore_eos=True))[0].token_ids
    assert got == want


def test_sharded_checkpoint_with_index_loads(tmp_path):
    from transformers import AutoModelForCausalLM
    path = write_tiny_checkpoint(tmp_path / "one", "qwen2")
    AutoModelForCausalLM.from_pretrained(str(path)).save_pretrained(tmp_path / "sharded",
                                                                    max_shard_size="60KB")
    shards = sorted(p.name for p in (tmp_path / "sharded").glob("*.safetensors"))
    assert len(shards) > 2 and (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    batch = prompts(2, 320, seed=3)
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    want = [o.token_ids for o in LLM(str(path), num_kv_blocks=64).generate(batch, params)]
    assert [o.token_ids for o in LLM(str(tmp_path / "sharded"),
                                     num_kv_blocks=64).generate(batch, params)] == want


@pytest.mark.parametrize("fused_experts", [False, True], ids=["per-expert-keys", "fused-keys"])
def test_qwen3_moe_greedy_matches_transformers(tmp_path, fused_experts):
    """Qwen3-MoE (8 experts, top-2 renormalised, one dense layer) from either checkpoint layout of
    its experts: transformers' greedy tokens, through the torch MoE path (CPU)."""
    path = write_tiny_checkpoint(tmp_path / "moe", "qwen3-moe", fused_experts=fused_experts)
    batch = prompts(4, 320, seed=2)
    want = [hf_greedy(path, p, 24) for p in batch]
    llm = LLM(str(path), num_kv_blocks=256)
    assert llm.engine.model_config.moe.sparse_layers == (0,)
    got = llm.generate(batch, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    assert [o.token_ids for o in got] == want


def test_qwen3_moe_checkpoint_missing_an_expert_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file
    path = write_tiny_checkpoint(tmp_path / "moe", "qwen3-moe")
    shard = next(path.glob("*.safetensors"))
    tensors = {k: v for k, v in load_file(str(shard)).items()
               if "experts.5.up_proj" not in k}
    save_file(tensors, str(shard), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="missing tensors.*experts.gate_up_proj"):
        LLM(str(path), num_kv_blocks=64)
