"""GPU-only engine tests: CUDA graphs vs eager, async scheduling vs one step at a time, GPU vs
transformers, memory-sized KV pool."""
import pytest

from oasiskv import LLM, SamplingParams
from tests.helpers import eval_prompts, hf_greedy

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype,kv", [("float32", "auto"), ("bfloat16", "auto"),
                                      ("float32", "fp8"), ("bfloat16", "fp8")])
def test_cuda_graph_decode_equals_eager(cuda_device, fixtures_path, dtype, kv):
    """(8-bit K/V: with open blocks, whose slots are the graphs' static inputs.)"""
    target = str(fixtures_path / "target")
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    kw = dict(dtype=dtype, num_kv_blocks=4096, max_model_len=4096, kv_cache_dtype=kv)
    eager = LLM(target, enforce_eager=True, **kw)
    batch = eval_prompts(fixtures_path, eager, 20, 700)
    want = [o.token_ids for o in eager.generate(batch, params)]
    del eager
    graphs = LLM(target, max_graph_batch=32, **kw)
    assert graphs.engine.runner.graphs is not None
    got = [o.token_ids for o in graphs.generate(batch, params)]
    same = sum(a == b for a, b in zip(got, want))
    assert same == len(want) if dtype == "float32" else same >= len(want) - 2


@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_async_scheduling_equals_one_step_at_a_time(cuda_device, fixtures_path, kv):
    """Graph replays whose token ids come from the previous step on the device; requests that end
    at different steps sit out the next step (its inputs gathered)."""
    target = str(fixtures_path / "target")
    kw = dict(dtype="float32", num_kv_blocks=4096, max_model_len=4096, kv_cache_dtype=kv,
              max_graph_batch=32)
    sync = LLM(target, async_scheduling=False, **kw)
    batch = eval_prompts(fixtures_path, sync, 12, 500, seed=4)
    params = [SamplingParams(max_tokens=6 + 3 * i, temperature=0, ignore_eos=True)
              for i in range(len(batch))]
    want = [o.token_ids for o in sync.generate(batch, params)]
    del sync
    ahead = LLM(target, **kw)
    assert ahead.engine.runner.graphs is not None
    assert [o.token_ids for o in ahead.generate(batch, params)] == want
    assert ahead.engine.stats.num_steps_ahead > 30


def test_gpu_greedy_matches_transformers_on_fixture(cuda_device, fixtures_path):
    target = fixtures_path / "target"
    llm = LLM(str(target), dtype="float32", num_kv_blocks=2048, max_model_len=4096)
    prompt = eval_prompts(fixtures_path, llm, 1, 1500, seed=3)[0]
    got = llm.generate([prompt], SamplingParams(max_tokens=64, temperature=0,
                                                ignore_eos=True))[0].token_ids
    assert got == hf_greedy(target, prompt, 64)


def test_kv_pool_is_sized_from_free_memory_and_preemption_recovers(cuda_device, fixtures_path):
    import torch
    llm = LLM(str(fixtures_path / "target"), gpu_memory_utilization=0.5)
    free, total = torch.cuda.mem_get_info()
    assert llm.engine.allocator.num_total_blocks > 1000
    assert torch.cuda.memory_reserved() <= 0.55 * total
    small = LLM(str(fixtures_path / "target"), num_kv_blocks=300, max_model_len=2048,
                max_num_seqs=64)
    batch = eval_prompts(fixtures_path, small, 40, 600, seed=5)
    # 7 prompts of 38 blocks fill the pool; growing by 10 blocks each forces preemption
    outs = small.generate(batch, SamplingParams(max_tokens=160, temperature=0, ignore_eos=True))
    assert small.engine.scheduler.num_preemptions > 0
    assert all(len(o.token_ids) == 160 for o in outs)
    assert small.engine.allocator.num_free_blocks == 300


def test_the_runner_tells_while_the_device_still_runs_a_step(cuda_device):
    """``ModelRunner._running``, which times the engine's release of ended requests: true while
    the work launched before it runs, false once it is done."""
    import types

    import torch

    from oasiskv.engine.model_runner import ModelRunner
    runner = types.SimpleNamespace(device=torch.device("cuda", torch.cuda.current_device()))
    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU cycles
    running = ModelRunner._running(runner)
    assert running()
    torch.cuda.synchronize()
    assert not running()
