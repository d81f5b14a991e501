"""Tensor parallelism on CPU: rank 0 in this process, rank 1 a real worker process, collectives on
gloo. TP = 2 gives TP = 1's greedy tokens; a rank that dies ends the engine's steps with a clear
error."""
import random
import time

import pytest

from oasiskv import LLM, SamplingParams
from oasiskv.config import ModelConfig
from tests.helpers import write_tiny_checkpoint

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 320) for _ in range(rng.randrange(5, 80))] for _ in range(n)]


def _tokens(llm: LLM, batch, params=GREEDY) -> list[list[int]]:
    outs = llm.generate(batch, params)
    assert all(o.error is None for o in outs), [o.error for o in outs]
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen2", "qwen3-moe", "qwen3-moe-fused"])
def test_two_ranks_give_one_ranks_greedy_tokens(tmp_path, arch):
    """(qwen3-moe-fused: experts stored as 3-D tensors, each rank cuts gate and up on its own)"""
    path = write_tiny_checkpoint(tmp_path / arch, arch.removesuffix("-fused"),
                                 fused_experts=arch.endswith("-fused"))
    batch = prompts(5, seed=1)
    want = _tokens(LLM(str(path), device="cpu", num_kv_blocks=256), batch)
    llm = LLM(str(path), device="cpu", num_kv_blocks=256, tensor_parallel_size=2,
              max_num_batched_tokens=64)  # chunked prefill too
    try:
        assert llm.engine.runner.model.cfg.num_kv_heads == 1  # this rank's share of 2
        assert _tokens(llm, batch) == want
        # logprobs, prompt logprobs and seeded sampling follow the same collectives
        params = SamplingParams(max_tokens=6, temperature=0.8, seed=3, logprobs=2,
                                prompt_logprobs=1)
        # (a one-rank engine in the same process as a two-rank one)
        one = LLM(str(path), device="cpu", num_kv_blocks=256).generate(batch[:2], params)
        two = llm.generate(batch[:2], params)
        assert all(o.error is None and len(o.token_ids) == 6 for o in one + two)
        assert [o.token_ids for o in two] == [o.token_ids for o in one]
        for a, b in zip(one, two):
            for x, y in zip(a.prompt_logprobs[1:] + a.logprobs, b.prompt_logprobs[1:] + b.logprobs):
                assert x.token_id == y.token_id and abs(x.logprob - y.logprob) < 1e-4
                assert [t for t, _ in x.top] == [t for t, _ in y.top]
    finally:
        llm.close()


def test_two_ranks_with_fp8_open_blocks_give_one_ranks_tokens(tmp_path):
    """Dense FP8 with open blocks: each worker rank reads its open blocks from the sequence slots
    rank 0's allocator gave (``sequence_state``); chunked prefill too."""
    path = write_tiny_checkpoint(tmp_path / "qwen3", "qwen3")
    batch = prompts(5, seed=2)
    kw = dict(device="cpu", num_kv_blocks=256, kv_cache_dtype="fp8", max_num_batched_tokens=64)
    want = _tokens(LLM(str(path), **kw), batch)
    llm = LLM(str(path), tensor_parallel_size=2, **kw)
    try:
        assert llm.engine.runner.backend.open_slots > 0
        assert _tokens(llm, batch) == want
    finally:
        llm.close()


@pytest.mark.parametrize("arch,draft", [("qwen3", "none"), ("qwen3", "ngram"),
                                        ("qwen3-moe", "ngram")])
def test_two_ranks_tiered_equal_one_rank_dense_when_k_covers_every_block(tmp_path, arch, draft):
    """Each rank keeps the host store, working sets and summaries of its kv heads; rank 0's
    allocator picks host blocks and slots for both. A small host store (26 blocks: requests
    queue) and chunked prefill on top."""
    path = write_tiny_checkpoint(tmp_path / "m", arch)
    batch = prompts(6, seed=5)
    want = _tokens(LLM(str(path), device="cpu", num_kv_blocks=256), batch)
    llm = LLM(str(path), device="cpu", tensor_parallel_size=2, kv_mode="oasis", topk_blocks=64,
              fetch_ratio=1.0, host_kv_gib=0.0004, max_num_seqs=4, max_num_batched_tokens=48,
              draft=draft)
    try:
        assert _tokens(llm, batch) == want
        assert llm.engine.allocator.num_total_blocks == 26
        alloc = llm.engine.allocator
        alloc.check_invariants([])
        assert alloc.num_free_blocks == alloc.num_total_blocks
    finally:
        llm.close()


def test_two_ranks_tiered_select_per_head_as_one_rank(tmp_path):
    """With a small K the working sets matter: selection is per kv head, so splitting the heads
    over two ranks selects the same blocks and decodes one rank's tokens."""
    path = write_tiny_checkpoint(tmp_path / "m", "qwen3")
    batch = prompts(6, seed=5)
    kw = dict(device="cpu", kv_mode="oasis", topk_blocks=2, fetch_ratio=0.5, host_kv_gib=0.01,
              draft="ngram")
    want = _tokens(LLM(str(path), **kw), batch)
    llm = LLM(str(path), tensor_parallel_size=2, **kw)
    try:
        assert _tokens(llm, batch) == want
    finally:
        llm.close()


def test_fixture_two_ranks_with_an_eagle3_drafter_equal_one_rank_dense(fixtures_path):
    """EAGLE-3 lookahead: the head reads the target's (vocabulary-split) embedding when it drafts
    in ``finish``, so the ranks finish each step together, after the sampled tokens reached
    them."""
    target = str(fixtures_path / "target")
    batch = prompts(3, seed=8)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    kw = dict(device="cpu", dtype="float32")
    want = _tokens(LLM(target, num_kv_blocks=512, **kw), batch, params)
    llm = LLM(target, tensor_parallel_size=2, kv_mode="oasis", topk_blocks=64, fetch_ratio=1.0,
              host_kv_gib=0.01, draft=f"eagle3:{fixtures_path / 'eagle3'}", **kw)
    try:
        assert _tokens(llm, batch, params) == want
        assert llm.engine.stats.kv_totals["draft_hits"] > 0
    finally:
        llm.close()


def test_a_replaced_token_reaches_every_rank(tmp_path):
    """``replace_last_token`` after a step: the next step feeds the new token on every rank."""
    path = write_tiny_checkpoint(tmp_path / "m", "qwen3")

    def run(llm):
        engine = llm.engine
        rid = engine.add_request(prompts(1, seed=9)[0], GREEDY)
        while not any(o.new_token_ids for o in engine.step()):
            pass
        engine.replace_last_token(rid, 7)
        out = None
        while engine.has_unfinished():
            for o in engine.step():
                out = o
        return out.token_ids

    want = run(LLM(str(path), device="cpu", num_kv_blocks=256))
    llm = LLM(str(path), device="cpu", num_kv_blocks=256, tensor_parallel_size=2)
    try:
        assert want[0] == 7 and run(llm) == want
    finally:
        llm.close()


def test_two_ranks_through_preemption_equal_one(tmp_path):
    """A KV pool too small for the batch: sequences are preempted and recomputed (new block
    tables), on two ranks as on one."""
    path = write_tiny_checkpoint(tmp_path / "m", "qwen3")
    batch = prompts(6, seed=1)
    want = _tokens(LLM(str(path), device="cpu", num_kv_blocks=256), batch)
    llm = LLM(str(path), device="cpu", num_kv_blocks=14, max_num_seqs=8, tensor_parallel_size=2)
    try:
        assert _tokens(llm, batch) == want
        assert llm.engine.scheduler.num_preemptions > 0
    finally:
        llm.close()


def test_fixture_target_two_ranks_equal_one(fixtures_path):
    target = str(fixtures_path / "target")
    batch = prompts(3, seed=4)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    want = _tokens(LLM(target, device="cpu", dtype="float32", num_kv_blocks=512), batch, params)
    llm = LLM(target, device="cpu", dtype="float32", num_kv_blocks=512, tensor_parallel_size=2)
    try:
        assert _tokens(llm, batch, params) == want
    finally:
        llm.close()


def test_a_dead_rank_ends_steps_with_an_error_not_a_hang(tmp_path):
    path = write_tiny_checkpoint(tmp_path / "m", "qwen3")
    llm = LLM(str(path), device="cpu", num_kv_blocks=256, tensor_parallel_size=2)
    try:
        assert len(_tokens(llm, prompts(1))[0]) == 16
        worker = llm.engine.driver.procs[0]
        worker.kill()
        worker.join(5)
        start = time.monotonic()
        outs = llm.generate(prompts(2, seed=7), GREEDY)
        assert time.monotonic() - start < 60
        for out in outs:
            assert out.finish_reason == "error" and "tensor-parallel rank 1 exited" in out.error
        with pytest.raises(RuntimeError, match="rank 1 exited"):
            llm.engine.driver.check()
    finally:
        llm.close()


def test_a_failed_step_on_rank_0_stops_the_ranks_with_an_error(tmp_path):
    """Rank 0 fails inside a step the worker has started: the ranks cannot get back in step, so
    the worker is stopped and every later step fails at once with the reason (no hang, no
    mismatched collectives)."""
    path = write_tiny_checkpoint(tmp_path / "m", "qwen3")
    llm = LLM(str(path), device="cpu", num_kv_blocks=256, tensor_parallel_size=2)
    try:
        model = llm.engine.runner.model

        def boom(*args, **kwargs):
            raise RuntimeError("out of memory (injected)")

        model.forward = boom
        start = time.monotonic()
        out = llm.generate(prompts(1), GREEDY)[0]
        assert out.finish_reason == "error" and "injected" in out.error
        del model.forward  # rank 0 could run again, but the worker is gone
        out = llm.generate(prompts(1), GREEDY)[0]
        assert out.finish_reason == "error" and "tensor-parallel engine stopped" in out.error
        assert time.monotonic() - start < 60
        llm.engine.driver.procs[0].join(10)
        assert not llm.engine.driver.procs[0].is_alive()
    finally:
        llm.close()


def test_shapes_that_do_not_divide_are_refused():
    cfg = ModelConfig.from_hf_dict(dict(architectures=["Qwen3ForCausalLM"], hidden_size=64,
                                        intermediate_size=96, num_hidden_layers=1,
                                        num_attention_heads=6, num_key_value_heads=3,
                                        vocab_size=321))
    assert (cfg.shard(3).num_kv_heads, cfg.shard(3).intermediate_size) == (1, 32)
    with pytest.raises(ValueError, match="num_key_value_heads .3. does not divide by "
                                         "tensor_parallel_size 2"):
        cfg.shard(2)
    # a harness's own backend goes to every rank pickled: one that cannot be is refused
    from oasiskv.attention import make_backend
    from oasiskv.engine.llm_engine import LLMEngine
    with pytest.raises(ValueError, match="backend_factory must be picklable"):
        LLMEngine(backend_factory=lambda *a: make_backend(*a), kv_mode="oasis", device="cpu",
                  tensor_parallel_size=2)


def test_every_rank_builds_the_harness_backend(tmp_path):
    """The bench's emulated host store (block ids beyond the physical blocks, ids sharing rows)
    exists on each rank: two ranks decode what one does over the same emulation, 32 requests
    taking block ids far past the physical blocks of each rank's store (two at a time, so that
    live requests never share a row: what shared rows hold is meaningless, and differs with the
    ranks' rounding)."""
    from oasiskv.bench.harness import emulated_host, oasis_backend
    from oasiskv.kv.probes import TierProbes
    path = write_tiny_checkpoint(tmp_path / "q", "qwen3")
    batch = prompts(32, seed=4)
    kw = dict(device="cpu", kv_mode="oasis", topk_blocks=2, fetch_ratio=0.5, host_kv_gib=0.0006,
              max_num_seqs=2)

    def emulating(size: int) -> LLM:  # 0.004 GiB of block ids in all, each rank its share
        return LLM(str(path), tensor_parallel_size=size, **kw, backend_factory=oasis_backend(
            TierProbes(host_store=emulated_host(0.004 / size))))
    one = emulating(1)
    host = one.engine.runner.backend.kv.host
    assert host.num_blocks > 6 * host.num_physical
    want = _tokens(one, batch)
    two = emulating(2)
    try:
        assert _tokens(two, batch) == want
    finally:
        two.close()


@pytest.mark.gpu
@pytest.mark.parametrize("kv_mode", ["dense", "oasis"])
@pytest.mark.parametrize("model", ["fixture", "qwen3-moe"])
def test_two_gpus_give_one_gpus_greedy_tokens(tmp_path, fixtures_path, kv_mode, model):
    """NCCL on two GPUs, CUDA graphs captured on each rank: the fixture target and a tiny
    Qwen3-MoE decode one GPU's greedy tokens, dense and tiered (K covering every block, lookahead
    prefetch). Needs a machine with two GPUs."""
    import torch
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA GPUs")
    path = (fixtures_path / "target" if model == "fixture"
            else write_tiny_checkpoint(tmp_path / model, model))
    batch = prompts(6, seed=9)
    kw = dict(dtype="float32") | (dict(kv_mode="oasis", topk_blocks=64, fetch_ratio=1.0,
                                       host_kv_gib=0.05, draft="ngram")
                                  if kv_mode == "oasis" else {})
    one = LLM(str(path), **kw)
    assert one.engine.runner.graphs is not None
    want = _tokens(one, batch)
    one.close()
    del one  # (its pool and graphs give the GPU back before rank 0 sizes its own)
    import gc
    gc.collect()
    torch.cuda.empty_cache()
    two = LLM(str(path), tensor_parallel_size=2, **kw)
    try:
        assert two.engine.runner.graphs is not None
        assert _tokens(two, batch) == want
    finally:
        two.close()
