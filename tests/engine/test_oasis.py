"""Tiered KV (kv_mode=oasis): equivalence with dense decode when K covers every block and nothing is
capped; cap / LRU / mapping invariants during real runs; no leaked host block; admission by both
budgets."""
import random

import pytest
import torch

from oasiskv import LLM, SamplingParams
from tests.helpers import write_tiny_checkpoint

GREEDY = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)


def prompts(n, vocab=320, lo=20, hi=200, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def tiny(request, tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp(request.param), request.param)


def dense_tokens(path, batch, params=GREEDY, kv_cache_dtype="auto", **kw):
    """Dense decode's tokens (with 8-bit K/V, ``kv_open_block`` and the 16-token blocks of the
    tiered engine it is compared with: the two store and read the same rows; a dense 8-bit pool
    would pick 32-token blocks, whose open block holds other tokens exact)."""
    llm = LLM(str(path), num_kv_blocks=512, block_size=16, kv_cache_dtype=kv_cache_dtype, **kw)
    return [o.token_ids for o in llm.generate(batch, params)]


@pytest.mark.parametrize("engine_kw", [
    dict(),
    # chunked prefill: later chunks read their prefix from the host store (40: a prefix that
    # ends inside a block)
    dict(max_num_batched_tokens=48), dict(max_num_batched_tokens=40),
    # host store too small for all at once: queueing + preemption
    dict(host_kv_gib=0.0004, max_num_seqs=8),
    # FP8 summaries (with FP8 K/V: summaries in the model's dtype): scores change, the selection of
    # every block does not
    dict(summary_dtype="fp8"), dict(summary_dtype="model"),
], ids=["plain", "chunked-prefill", "chunks-mid-block", "tight-host-store", "fp8-summaries",
        "model-summaries"])
@pytest.mark.parametrize("kv_cache_dtype,open_block", [
    ("auto", "model"), ("fp8", "model"), ("fp8", "kv"), ("int8", "model")])
def test_oasis_equals_dense_when_k_covers_every_block(tiny, engine_kw, kv_cache_dtype,
                                                      open_block):
    """8-bit KV: the host store, working sets and dense pool quantise every row the same way, and
    with open blocks both keep each sequence's last block exact, so tiered decode equals dense
    decode in the same storage (chunked the same way: a later chunk reads its prefix quantised,
    a partly written last block of it exact) token for token."""
    batch = prompts(5, seed=1)
    kw = dict(kv_mode="oasis", topk_blocks=64, fetch_ratio=1.0, host_kv_gib=0.01,
              kv_cache_dtype=kv_cache_dtype, kv_open_block=open_block) | engine_kw
    llm = LLM(str(tiny), **kw)
    chunk = {k: v for k, v in engine_kw.items() if k == "max_num_batched_tokens"}
    want = dense_tokens(tiny, batch, kv_cache_dtype=kv_cache_dtype, kv_open_block=open_block,
                        **chunk)
    assert [o.token_ids for o in llm.generate(batch, GREEDY)] == want
    alloc = llm.engine.allocator
    alloc.check_invariants([])
    assert alloc.num_free_blocks == alloc.num_total_blocks


@pytest.mark.parametrize("draft", ["none", "ngram"])
def test_moe_oasis_equals_dense_when_k_covers_every_block(tmp_path, draft):
    """Qwen3-MoE (experts in all layers but one): the tiered KV path does not care what the MLP
    is; with every block resident it decodes dense's tokens, synchronous or lookahead."""
    path = write_tiny_checkpoint(tmp_path / "moe", "qwen3-moe")
    batch = prompts(4, seed=3)
    llm = LLM(str(path), kv_mode="oasis", topk_blocks=64, fetch_ratio=1.0, host_kv_gib=0.01,
              draft=draft)
    assert [o.token_ids for o in llm.generate(batch, GREEDY)] == dense_tokens(path, batch)


@pytest.mark.parametrize("draft", ["none", "ngram"])
def test_sequences_recomputed_in_chunks_are_reseeded(tmp_path, draft):
    """A preempted sequence is recomputed in chunks that can stop one token short of its end (decode
    computes that token): its working set must be seeded there, not only when a chunk ends a
    prompt."""
    path = write_tiny_checkpoint(tmp_path / "m", "qwen3")
    batch = prompts(8, seed=11)
    llm = LLM(str(path), kv_mode="oasis", topk_blocks=64, fetch_ratio=1.0, host_kv_gib=0.0004,
              max_num_batched_tokens=40, draft=draft)
    assert [o.token_ids for o in llm.generate(batch, GREEDY)] == dense_tokens(path, batch)
    assert llm.engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("kw", [
    dict(topk_blocks=64, fetch_ratio=1.0),  # every block resident: equal to dense
    dict(topk_blocks=3, fetch_ratio=0.34, draft="ngram"),  # selection from shared summaries
], ids=["k-covers-all", "small-k-lookahead"])
def test_prefix_sharing_in_the_host_store_skips_prefill_and_keeps_tokens(tmp_path, kw):
    """A second request whose prompt starts with the first's takes its complete host blocks (and
    their summaries) instead of prefilling them, and decodes the tokens it would have alone."""
    path = write_tiny_checkpoint(tmp_path / "m", "qwen3")
    shared = prompts(1, lo=150, hi=151, seed=21)[0]
    batch = [shared + [5, 6, 7], shared + [8, 9]]
    llm = LLM(str(path), kv_mode="oasis", host_kv_gib=0.01, **kw)
    engine = llm.engine
    first = llm.generate(batch[:1], GREEDY)[0].token_ids
    before = engine.stats.prompt_tokens_total
    second = llm.generate(batch[1:], GREEDY)[0].token_ids
    computed = engine.stats.prompt_tokens_total - before
    assert computed == len(batch[1]) - (len(shared) // 16) * 16  # every complete shared block
    engine.allocator.check_invariants([])
    solo = LLM(str(path), kv_mode="oasis", host_kv_gib=0.01, **kw).generate(batch, GREEDY)
    assert [first, second] == [o.token_ids for o in solo]
    if kw["topk_blocks"] == 64:
        assert [first, second] == dense_tokens(path, batch)


def test_no_prefix_sharing_with_a_drafter_that_reads_target_features(tmp_path):
    """EAGLE-3 reads the target's features of every prompt token: a prompt cannot start after a
    shared prefix, so the tiered allocator shares nothing."""
    from oasiskv.bench.harness import oasis_backend
    from oasiskv.config import EngineConfig
    from oasiskv.engine.llm_engine import LLMEngine
    from oasiskv.kv.allocator import TieredAllocator
    from oasiskv.kv.probes import TierProbes
    from oasiskv.spec.base import Drafter

    class Features(Drafter):
        aux_layers = (0,)

        def propose(self, seqs):
            return [None] * len(seqs)

    path = write_tiny_checkpoint(tmp_path / "m", "qwen3")
    shared = prompts(1, lo=150, hi=151, seed=21)[0]
    config = EngineConfig.from_flat(model=str(path), kv_mode="oasis", host_kv_gib=0.01,
                                    draft="ngram")
    engine = LLMEngine(config, backend_factory=oasis_backend(TierProbes(), Features()))
    assert isinstance(engine.allocator, TieredAllocator)
    assert not engine.allocator.enable_prefix_sharing
    for p in (shared + [5], shared + [6]):
        engine.add_request(p, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()
    assert engine.stats.prompt_tokens_total == 2 * (len(shared) + 1)


def test_fixture_target_oasis_equals_dense(fixtures_path):
    import json
    target = str(fixtures_path / "target")
    text = "\n".join(json.loads((fixtures_path / "eval_dev.json").read_text())["docs"][:3])
    dense = LLM(target, dtype="float32", num_kv_blocks=256)
    prompt = dense.engine.encode(text)[:700]
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    want = dense.generate([prompt], params)[0].token_ids
    oasis = LLM(target, dtype="float32", kv_mode="oasis", topk_blocks=64, fetch_ratio=1.0,
                host_kv_gib=0.05)
    assert oasis.generate([prompt], params)[0].token_ids == want


def check_working_sets(engine):
    """Every running sequence's per-(layer, head) mapping holds distinct, existing blocks."""
    kv, slot_of = engine.runner.backend.kv, engine.allocator.slot_of
    K = kv.layout.topk_blocks
    for seq in engine.scheduler.running:
        if seq.in_prefill or seq.seq_id not in slot_of:
            continue
        slot, complete = slot_of[seq.seq_id], (len(seq) - 1) // kv.layout.block_size
        for layer in range(kv.layout.num_layers):
            for blocks in kv.ws.map[layer][slot, :, :K].tolist():
                held = [b for b in blocks if b >= 0]
                assert len(held) == len(set(held)) and all(b < complete + 1 for b in held)
            assert (kv.ws.map[layer][slot, :, K] == -1).all(), "local slot is never mapped"


def test_cap_and_mapping_invariants_during_a_run(tiny):
    llm = LLM(str(tiny), kv_mode="oasis", topk_blocks=3, fetch_ratio=0.34, host_kv_gib=0.01)
    engine, backend = llm.engine, llm.engine.runner.backend.kv
    assert backend.cap == 2  # ceil(0.34 * 3)
    for p in prompts(4, lo=60, hi=160, seed=2):
        engine.add_request(p, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    fetched_total = deferred_total = 0
    while engine.has_unfinished():
        engine.step()
        stats = engine.stats.kv
        if not engine.stats.last_step_prefill:
            layers, heads = backend.layout.num_layers, backend.layout.num_kv_heads
            assert stats["fetched_blocks"] <= backend.cap * heads * layers * stats["decode_rows"]
            assert stats["hits"] + stats["misses"] <= 3 * heads * layers * stats["decode_rows"]
            # how full the cap ran, in total and per layer
            assert stats["cap_slots"] == backend.cap * heads * layers * stats["decode_rows"]
            assert stats["cap_fill"] == stats["fetched_blocks"] / stats["cap_slots"] <= 1
            per_layer = engine.stats.kv_per_layer["fetched_blocks"]
            assert len(per_layer) == layers and sum(per_layer) == stats["fetched_blocks"]
            fetched_total += stats["fetched_blocks"]
            deferred_total += stats["deferred"]
        check_working_sets(engine)
    assert fetched_total > 0 and deferred_total > 0, "the run must exercise fetches and the cap"
    engine.allocator.check_invariants([])


def test_abort_frees_host_blocks_and_slot(tiny):
    llm = LLM(str(tiny), kv_mode="oasis", topk_blocks=4, host_kv_gib=0.01)
    engine = llm.engine
    rid = engine.add_request(prompts(1, lo=100, hi=101)[0],
                             SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.allocator.num_free_blocks < engine.allocator.num_total_blocks
    engine.abort(rid)
    engine.allocator.check_invariants([])
    assert engine.allocator.num_free_blocks == engine.allocator.num_total_blocks


def test_admission_respects_both_budgets(tiny):
    llm = LLM(str(tiny), kv_mode="oasis", topk_blocks=4, host_kv_gib=0.0004, max_num_seqs=3)
    engine, backend = llm.engine, llm.engine.runner.backend.kv
    blocks = engine.allocator.num_total_blocks
    assert blocks == int(0.0004 * 2**30) // backend.layout.host_block_bytes
    assert engine.max_model_len == blocks * 16
    with pytest.raises(ValueError, match="context limit"):
        engine.add_request([7] * (blocks * 16 + 1), SamplingParams())
    # blocks // 2 blocks each: two fit in the host store, three do not
    length = 16 * (blocks // 2 - 1) + 1
    for p in prompts(5, lo=length, hi=length + 1, seed=3):
        engine.add_request(p, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    peak = 0
    while engine.has_unfinished():
        engine.step()
        running = engine.scheduler.running
        peak = max(peak, len(running))
        assert sum(len(s.block_table) for s in running) <= blocks and len(running) <= 3
        engine.allocator.check_invariants(running)
    assert peak == 2, "the host budget, not max_num_seqs, bounded the batch"
    totals = engine.stats.kv_totals
    assert totals["admissions_refused_host_blocks"] > 0
    assert totals["admissions_refused_working_set_slots"] == 0


def test_sampler_and_stats_on_cpu_do_not_need_cuda(tiny):
    llm = LLM(str(tiny), kv_mode="oasis", topk_blocks=2, fetch_ratio=0.5, host_kv_gib=0.01)
    out = llm.generate(prompts(2, seed=4), SamplingParams(max_tokens=8, temperature=0.8, seed=3))
    assert all(len(o.token_ids) == 8 for o in out)
    assert set(llm.engine.stats.kv) >= {"hits", "misses", "fetched_blocks", "fetched_bytes",
                                        "deferred", "hit_rate", "host_bytes_in_use",
                                        "hbm_bytes_in_use"}
    assert torch.get_default_device().type == "cpu"


def test_eval_tool_reports_exact_agreement_when_k_covers_everything(tmp_path):
    import json
    import subprocess
    import sys
    from oasiskv.models.loader import DEMO_MODEL
    text = tmp_path / "text.json"
    text.write_text(json.dumps({"docs": ["def f(x):\n    return x * 2\n" * 120]}))
    out = subprocess.run([sys.executable, "-m", "oasiskv.cli", "--log-level", "WARNING", "eval",
                          str(DEMO_MODEL), "--text", str(text), "--windows", "2",
                          "--window-len", "256", "--last", "24",
                          "--topk-blocks", "2,16", "--fetch-ratio", "0.5", "--guardrail"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    runs = {r["setting"]: r for r in result["runs"]}
    assert set(runs) == {"dense", "oasis K=2 no cap", "oasis K=2 cap f=0.5", "oasis K=16 no cap",
                         "oasis K=16 cap f=0.5"}
    assert runs["oasis K=16 no cap"]["top1_agreement"] == 1.0
    assert abs(runs["oasis K=16 no cap"]["delta"]) < 1e-4
    assert runs["dense"]["cap_fill"] is None
    capped = runs["oasis K=2 cap f=0.5"]["cap_fill"]  # cap 1 block per head per layer per step
    assert 0 < capped["mean"] <= 1 and capped["p10"] <= capped["p50"] <= capped["p90"] <= 1
    assert len(capped["per_layer"]) == 2 and 0 < min(capped["per_layer"])
    # the guardrail's recall tables: every decoded position of the two capped runs, measured at
    # both layers (23 per window: the first prediction comes from the prefill), pooled by its mean
    # and its lowest recall; K=16 holds every block of a 256-token window: the top bucket
    for table in result["top1_by_recall"].values():
        assert sum(row["positions"] for row in table) == 2 * 2 * 23
        assert table[-1]["recall"] == "[0.99, 1.00]" and table[-1]["positions"] >= 2 * 23
        assert all(0 <= row["top1_agreement"] <= 1 for row in table)
    assert "top-1 = dense by guardrail recall" in out.stdout
    assert set(result["guardrail_signal"]) == {"recall mean", "recall min", "error mean",
                                               "error max"}
    for signal in result["guardrail_signal"].values():  # (None when every position agrees)
        assert signal is None or (
            0 <= signal["auc"] <= 1
            and sum(q["positions"] for q in signal["quartiles"]) == 2 * 2 * 23)


def test_eval_names_the_block_size_of_the_dense_8_bit_run(tmp_path):
    """``--kv-cache-dtype fp8`` adds a dense FP8 run, labelled with its block size: the engine's
    auto (32 tokens for a dense 8-bit pool) unless ``--block-size`` says otherwise."""
    import json
    import subprocess
    import sys
    from oasiskv.models.loader import DEMO_MODEL
    text = tmp_path / "text.json"
    text.write_text(json.dumps({"docs": ["def f(x):\n    return x * 2\n" * 120]}))
    for flags, label in (([], "dense fp8 b32 (open block exact)"),
                         (["--block-size", "16"], "dense fp8 b16 (open block exact)")):
        out = subprocess.run([sys.executable, "-m", "oasiskv.cli", "--log-level", "WARNING", "eval",
                              str(DEMO_MODEL), "--text", str(text), "--windows", "1",
                              "--window-len", "128", "--last", "8", "--topk-blocks", "",
                              "--kv-cache-dtype", "fp8", *flags],
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        runs = {r["setting"]: r for r in json.loads(out.stdout.strip().splitlines()[-1])["runs"]}
        assert set(runs) == {"dense", label}
        assert 0 <= runs[label]["top1_agreement"] <= 1


def test_guardrail_predictor_auc_and_quartiles():
    from oasiskv.bench.fidelity import predictor_signal
    separated = [(0.1, False), (0.2, False), (0.3, True), (0.4, True)]
    assert predictor_signal(separated)["auc"] == 1.0
    assert predictor_signal([(r, not s) for r, s in separated])["auc"] == 0.0
    # an error: worse when higher, so the same positions separate perfectly the other way
    assert predictor_signal([(r, not s) for r, s in separated], worse_when_higher=True)["auc"] == 1
    # pairs (disagree, agree): (0.5, 0.5) a tie, the other three lower: (3 + 0.5) / 4
    assert predictor_signal([(0.5, True), (0.5, False), (0.7, True), (0.2, False)])["auc"] == 0.875
    signal = predictor_signal(separated)
    assert [q["top1_agreement"] for q in signal["quartiles"]] == [0.0, 0.0, 1.0, 1.0]
    assert signal["mean_agree"] == pytest.approx(0.35)
    assert signal["mean_disagree"] == pytest.approx(0.15)
    assert predictor_signal([(0.3, True)]) is None


@pytest.mark.parametrize("kv_cache_dtype,summary_dtype", [("auto", "auto"), ("fp8", "auto"),
                                                          ("fp8", "model"), ("auto", "fp8"),
                                                          ("int8", "auto")])
def test_oasis_through_the_triton_kernels_equals_dense(tmp_path, monkeypatch, kv_cache_dtype,
                                                       summary_dtype):
    """The engine's calls into every Triton kernel (interpreter on CPU) give dense decode's tokens
    (dense decode through the references, in the same storage dtype): catches argument mismatches
    (strides, index layouts, scales) that the torch references would forgive."""
    import os
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs the kernels in the Triton interpreter (CPU machines)")
    import oasiskv.kernels.dispatch as dispatch
    path = write_tiny_checkpoint(tmp_path / "m", "qwen3")
    batch = prompts(2, lo=20, hi=90, seed=5)
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    want = dense_tokens(path, batch, params, kv_cache_dtype)
    real = dispatch.kernel
    monkeypatch.setattr(dispatch, "kernel", lambda name, cuda: real(name, True))
    assert dense_tokens(path, batch, params, kv_cache_dtype) == want  # the paged path's kernels
    # (no stall clock: its kernel reads the GPU's timer in inline assembly, which the interpreter
    # cannot run)
    llm = LLM(str(path), kv_mode="oasis", topk_blocks=64, fetch_ratio=1.0, host_kv_gib=0.01,
              kv_cache_dtype=kv_cache_dtype, summary_dtype=summary_dtype, measure_stall=False)
    assert [o.token_ids for o in llm.generate(batch, params)] == want


def test_bench_reports_oasis_points_with_pcie_traffic():
    import json
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-m", "oasiskv.cli", "--log-level", "WARNING", "bench",
                          "qwen3-tiny", "--context-lens", "256", "--concurrency", "2",
                          "--output-lens", "24", "--kv-mode", "oasis",
                          "--topk-blocks", "4", "--fetch-ratio", "0.25", "--host-kv-gib", "0.01"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    point = json.loads(out.stdout.strip().splitlines()[-1])["points"][0]
    assert point["engine"] == "oasis-K4-sync" and point["tok_s"] > 0 and point["pcie_gb_s"] > 0
    assert 0 < point["cap_fill"] <= 1 and "cap fill" in out.stdout
    assert "PCIe GB/s" in out.stdout


@pytest.mark.parametrize("draft", ["previous", "ngram"])
def test_lookahead_equals_dense_when_k_covers_every_block(tiny, draft):
    batch = prompts(4, seed=6)
    llm = LLM(str(tiny), kv_mode="oasis", topk_blocks=64, fetch_ratio=1.0, host_kv_gib=0.01,
              draft=draft)
    assert [o.token_ids for o in llm.generate(batch, GREEDY)] == dense_tokens(tiny, batch)


def test_draft_rows_see_the_working_set_the_real_token_and_themselves(tiny):
    """A draft row's final hidden state equals a dense forward of the sequence extended by the draft
    token (K covers every block), and the real row is untouched by it."""
    from oasiskv.engine.scheduler import ScheduledBatch
    from oasiskv.engine.sequence import Sequence
    llm = LLM(str(tiny), kv_mode="oasis", topk_blocks=64, fetch_ratio=1.0, host_kv_gib=0.01,
              draft="ngram")
    engine = llm.engine
    engine.add_request(prompts(1, lo=70, hi=71, seed=7)[0],
                       SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    for _ in range(4):  # prefill + a few decode steps: the local block holds several tokens
        engine.step()
    seq = engine.scheduler.running[0]
    guess = engine.runner.backend.lookahead.guesses[seq.seq_id]
    batch = engine.scheduler.schedule()
    hidden = engine.runner.forward(batch)
    assert hidden.shape[0] == 2
    dense = LLM(str(tiny), num_kv_blocks=64).engine
    for tokens, row in ((seq.token_ids, 0), (seq.token_ids + [guess], 1)):
        ref = Sequence(list(tokens), SamplingParams())
        dense.allocator.allocate(ref, len(tokens))
        want = dense.runner.forward(ScheduledBatch([ref], [len(tokens)], True))[-1]
        torch.testing.assert_close(hidden[row], want, rtol=1e-4, atol=1e-4)


def test_eval_lookahead_measures_drafters_and_set_agreement(tmp_path):
    import json
    import subprocess
    import sys
    from oasiskv.models.loader import DEMO_MODEL
    text = tmp_path / "text.json"
    text.write_text(json.dumps({"docs": [f"def f{i}(x):\n    return x * {i}\n"
                                         for i in range(200)]}))
    out = subprocess.run([sys.executable, "-m", "oasiskv.cli", "--log-level", "WARNING", "eval",
                          str(DEMO_MODEL), "--text", str(text), "--windows", "2",
                          "--window-len", "256", "--last", "32", "--topk-blocks", "4",
                          "--drafts", "previous,ngram,oracle", "--draft-k", "4",
                          "--fetch-ratio", "0.25"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    runs = {r["setting"]: r for r in json.loads(out.stdout.strip().splitlines()[-1])["runs"]}
    none, ngram, oracle = (runs[f"lookahead K=4 f=0.25 {d}"]
                           for d in ("previous", "ngram", "oracle"))
    assert none["draft_hit_rate"] is None and oracle["draft_hit_rate"] == 1.0
    assert 0.0 <= ngram["draft_hit_rate"] <= 1.0
    assert len(oracle["set_agreement_per_layer"]) == 2  # the demo model's layers
    mean = lambda r: sum(r["set_agreement_per_layer"]) / 2  # noqa: E731
    assert mean(oracle) >= mean(none) and mean(oracle) > 0.9


def test_a_failing_drafter_costs_predictions_not_requests(tiny, monkeypatch):
    llm = LLM(str(tiny), kv_mode="oasis", topk_blocks=4, host_kv_gib=0.01, draft="ngram")
    drafter = llm.engine.runner.backend.lookahead.drafter
    monkeypatch.setattr(drafter, "propose", lambda seqs: [][len(seqs)])  # raises IndexError
    outs = llm.generate(prompts(2, seed=8),
                        SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    assert all(o.finish_reason == "length" and len(o.token_ids) == 6 for o in outs)
