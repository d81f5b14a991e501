"""The engine's step protocol: teacher forcing (``step(forced=...)``), replacing a sampled token
before it is computed, and what a drafter reserves counting in the tiered HBM budget."""
import random

import pytest

from oasiskv import LLM, SamplingParams
from oasiskv.attention.sparse import CPU_HBM_BYTES
from oasiskv.bench.harness import oasis_backend
from oasiskv.kv.probes import TierProbes
from oasiskv.spec.base import Drafter
from tests.helpers import write_tiny_checkpoint


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("qwen3"), "qwen3")


def run_forced(engine, prompt, forced, top_n=2):
    """Teacher-force ``forced`` after ``prompt`` -> the request's final output."""
    params = SamplingParams(max_tokens=len(forced), temperature=0, logprobs=top_n, ignore_eos=True)
    rid = engine.add_request(prompt, params)
    done = 0
    while engine.has_unfinished():
        for out in engine.step({rid: forced[done]} if done < len(forced) else {}):
            done += len(out.new_token_ids)
            if out.finished:
                return out


@pytest.mark.parametrize("mode", ["dense", "oasis"])
def test_forced_tokens_are_appended_and_scored_like_prompt_tokens(tiny, mode):
    rng = random.Random(0)
    prompt = [rng.randrange(1, 320) for _ in range(40)]
    forced = [rng.randrange(1, 320) for _ in range(6)]
    kw = {} if mode == "dense" else dict(kv_mode="oasis", topk_blocks=64, fetch_ratio=1.0,
                                         host_kv_gib=0.01)
    engine = LLM(str(tiny), **kw).engine
    out = run_forced(engine, prompt, forced)
    assert out.token_ids == forced and [lp.token_id for lp in out.logprobs] == forced
    # the same tokens as prompt tokens, scored in one prefill: entry k scores token k + 1
    ref = LLM(str(tiny), num_kv_blocks=64).generate(
        [prompt + forced], SamplingParams(max_tokens=1, prompt_logprobs=2))[0].prompt_logprobs
    for i, lp in enumerate(out.logprobs):
        want = ref[len(prompt) + i - 1]
        assert lp.logprob == pytest.approx(want.logprob, abs=1e-4)
        assert [t for t, _ in lp.top] == [t for t, _ in want.top]


def test_replaced_token_is_the_one_the_next_step_computes(tiny):
    rng = random.Random(1)
    prompt = [rng.randrange(1, 320) for _ in range(30)]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    engine = LLM(str(tiny), num_kv_blocks=64).engine
    rid = engine.add_request(prompt, params)
    with pytest.raises(ValueError, match="no sampled token"):
        engine.replace_last_token(rid, 5)  # nothing sampled yet
    engine.step()
    with pytest.raises(ValueError, match="vocabulary"):
        engine.replace_last_token(rid, 10_000)
    with pytest.raises(ValueError, match="no sampled token"):
        engine.replace_last_token("nobody", 5)
    assert engine.replace_last_token(rid, 7) is None
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.finished]
    want = LLM(str(tiny), num_kv_blocks=64).generate([prompt + [7]], SamplingParams(
        max_tokens=5, temperature=0, ignore_eos=True))[0].token_ids
    assert outs[0].token_ids == [7] + want


class SizedDrafter(Drafter):
    """Guesses nothing; reports the memory it would take and records what it was given."""

    def __init__(self, per_seq: int, fixed: int):
        self.per_seq, self.fixed, self.reserved = per_seq, fixed, None

    def bytes_per_seq(self, max_len):
        return self.per_seq

    def fixed_bytes(self):
        return self.fixed

    def reserve(self, num_seqs, max_len):
        self.reserved = (num_seqs, max_len)

    def propose(self, seqs):
        return [None] * len(seqs)


@pytest.mark.parametrize("per_seq_gib,fixed_gib", [(0.0, 0.0), (1.0, 0.0), (0.7, 1.5)])
def test_drafter_memory_counts_in_the_hbm_budget(tiny, per_seq_gib, fixed_gib):
    drafter = SizedDrafter(int(per_seq_gib * 2**30), int(fixed_gib * 2**30))
    llm = LLM(str(tiny), kv_mode="oasis", topk_blocks=4, host_kv_gib=0.01, draft="previous",
              max_num_seqs=10_000, backend_factory=oasis_backend(TierProbes(), drafter))
    kv, alloc = llm.engine.runner.backend.kv, llm.engine.allocator
    fixed = kv.host.num_blocks * kv.layout.summary_bytes_per_block + drafter.fixed
    per_seq = kv.layout.working_set_bytes + drafter.per_seq
    slots = min(10_000, (CPU_HBM_BYTES - fixed) // per_seq - 1)
    assert alloc.num_seq_slots == slots and drafter.reserved == (slots, llm.engine.max_model_len)
    if per_seq_gib:  # the drafter, not the working sets or max_num_seqs, bounds the batch
        assert slots == int((4 - fixed_gib) / per_seq_gib - 1e-3) - 1
    out = llm.generate([[3] * 40], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 4


def test_draft_model_lookahead_equals_dense_and_guesses(fixtures_path):
    """The ``model:`` drafter inside a tiered engine (its pool reserved per working-set slot, its
    mirrors driven through its engine's public step): dense tokens when K covers every block, and
    its guesses hit."""
    import json
    from tests.conftest import fixture_part
    target, draft = str(fixtures_path / "target"), fixture_part(fixtures_path, "draft")
    text = "\n".join(json.loads((fixtures_path / "eval_dev.json").read_text())["docs"][:3])
    dense = LLM(target, dtype="float32", num_kv_blocks=256)
    ids = dense.engine.encode(text)
    batch = [ids[:300], ids[400:620]]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    want = [o.token_ids for o in dense.generate(batch, params)]
    llm = LLM(target, dtype="float32", kv_mode="oasis", topk_blocks=64, fetch_ratio=1.0,
              host_kv_gib=0.05, draft=f"model:{draft}", max_num_seqs=4)
    assert [o.token_ids for o in llm.generate(batch, params)] == want
    totals = llm.engine.stats.kv_totals
    assert totals["draft_guesses"] >= 40 and totals["draft_hits"] > 0.2 * totals["draft_guesses"]
    mirror = llm.engine.runner.backend.lookahead.drafter.engine
    assert not mirror.has_unfinished(), "finished sequences' mirrors are dropped"
