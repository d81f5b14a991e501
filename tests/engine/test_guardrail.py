"""The online fidelity guardrail (``guardrail_rate``): sampled rows measured against exact attention
over their whole context. With K covering every block the working set is the context: recall 1,
no output error, top-K agreement 1; with a small K they move, and low recall comes with large output
error; a set the real query chose itself agrees fully, one chosen a step ahead less; the sampling
rate holds; off, nothing is tapped. GPU: the same inside CUDA graphs (side stream)."""
import pytest

from oasiskv import LLM, SamplingParams
from tests.engine.test_oasis import prompts
from tests.helpers import write_tiny_checkpoint

PARAMS = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def run(llm, batch, agreement=None, dropped=0):
    """Every guardrail sample of the run: (recall, relative error), and the decode rows run; the
    top-K agreement samples are appended to ``agreement`` when given. The measurements still in
    flight at the end are waited for; the samples dropped must be ``dropped`` (a callable: a check
    of their count)."""
    engine, samples, rows = llm.engine, [], 0
    for p in batch:
        engine.add_request(p, PARAMS)
    while engine.has_unfinished():
        engine.step()
        s = engine.stats
        rows += 0 if s.last_step_prefill else s.last_batch_size
        samples += zip(s.kv_samples.get("guardrail_recall", []),
                       s.kv_samples.get("guardrail_rel_error", []))
        if agreement is not None:
            agreement += s.kv_samples.get("guardrail_topk_agreement", [])
    rest = llm.engine.runner.backend.guardrail.drain()
    samples += zip(rest.get("guardrail_recall", []), rest.get("guardrail_rel_error", []))
    if agreement is not None:
        agreement += rest.get("guardrail_topk_agreement", [])
    count = engine.stats.kv_totals.get("guardrail_dropped", 0)
    assert dropped(count) if callable(dropped) else count == dropped, count
    return samples, rows


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("m"), "qwen3")


def test_k_covering_every_block_has_full_recall_and_no_error(tiny):
    llm = LLM(str(tiny), kv_mode="oasis", host_kv_gib=0.01, topk_blocks=64, fetch_ratio=1.0,
              guardrail_rate=1.0)
    agreement = []
    samples, rows = run(llm, prompts(3, lo=100, hi=180, seed=5), agreement)
    assert len(samples) == rows > 0  # rate 1: every decode row, each at one layer
    assert all(abs(r - 1) < 1e-5 and e < 1e-5 for r, e in samples), samples[:3]
    assert len(agreement) == rows and set(agreement) == {1.0}
    layers = {layer for _, _, layer, _, _ in llm.engine.runner.backend.guardrail.last}
    assert layers <= set(range(llm.engine.model_config.num_layers))


@pytest.mark.parametrize("draft,fetch_ratio", [("none", 1.0), ("previous", 0.5)])
def test_topk_agreement_of_the_set_the_query_chose_and_of_a_predicted_one(tiny, draft,
                                                                        fetch_ratio):
    """Synchronous retrieval without a cap selects with the token's own query: the working set is
    exactly its top-K, agreement 1. Lookahead selects one step ahead with the previous query
    under a cap of one block: less, on average."""
    llm = LLM(str(tiny), kv_mode="oasis", host_kv_gib=0.01, topk_blocks=2,
              fetch_ratio=fetch_ratio, draft=draft, guardrail_rate=1.0)
    agreement = []
    run(llm, prompts(3, lo=150, hi=200, seed=9), agreement)
    assert agreement and all(0 <= a <= 1 for a in agreement)
    mean = sum(agreement) / len(agreement)
    assert mean == 1.0 if draft == "none" else mean < 0.95


@pytest.mark.parametrize("draft", ["none", "ngram"])
def test_a_small_working_set_loses_mass_and_the_error_follows(tiny, draft):
    llm = LLM(str(tiny), kv_mode="oasis", host_kv_gib=0.01, topk_blocks=2, fetch_ratio=0.5,
              draft=draft, guardrail_rate=1.0)
    samples, rows = run(llm, prompts(3, lo=150, hi=200, seed=6))
    assert len(samples) == rows
    recall = sorted(samples)
    assert all(0 < r < 1 and e > 0 for r, e in recall)
    # (random weights spread attention: little mass in 3 of ~10 blocks)
    low, high = recall[: len(recall) // 3], recall[-len(recall) // 3:]
    assert sum(e for _, e in low) / len(low) > sum(e for _, e in high) / len(high)


def test_rate_samples_that_share_of_rows_and_zero_taps_nothing(tiny):
    llm = LLM(str(tiny), kv_mode="oasis", host_kv_gib=0.01, topk_blocks=2, guardrail_rate=0.3)
    samples, rows = run(llm, prompts(6, lo=100, hi=120, seed=7))
    assert 0.1 * rows < len(samples) < 0.5 * rows
    off = LLM(str(tiny), kv_mode="oasis", host_kv_gib=0.01, topk_blocks=2)
    samples, rows = run(off, prompts(2, lo=100, hi=120, seed=7))
    assert samples == [] and rows > 0 and off.engine.runner.backend.guardrail._q is None
    with pytest.raises(ValueError, match="guardrail_rate"):
        LLM(str(tiny), kv_mode="oasis", guardrail_rate=1.5)


def test_samples_beyond_the_measurements_in_flight_are_dropped_and_counted(tiny, monkeypatch):
    """With no room for a measurement in flight, every sampled row is dropped, counted on the
    ``guardrail_dropped`` counter, and the step goes on."""
    from oasiskv.kv import guardrail
    monkeypatch.setattr(guardrail, "MAX_PENDING", 0)
    llm = LLM(str(tiny), kv_mode="oasis", host_kv_gib=0.01, topk_blocks=2, guardrail_rate=1.0)
    rows = []
    samples, n = run(llm, prompts(3, lo=100, hi=120, seed=3), dropped=lambda k: rows.append(k) or 1)
    assert samples == [] and rows == [n] and n > 0


@pytest.mark.gpu
def test_guardrail_in_graph_replays(cuda_device, fixtures_path):
    """Fixture target, graphs on, lookahead async: K covering every block gives recall 1 (taps
    written by the replays, measured on the side stream)."""
    llm = LLM(str(fixtures_path / "target"), dtype="float32", kv_mode="oasis", topk_blocks=64,
              fetch_ratio=1.0, host_kv_gib=0.5, draft="ngram", guardrail_rate=1.0)
    assert llm.engine.runner.graphs is not None
    drops = []
    samples, rows = run(llm, prompts(4, vocab=1000, lo=300, hi=400, seed=8),
                        dropped=lambda n: drops.append(n) or True)
    # every row measured or (a side stream that lags MAX_PENDING steps) dropped and counted
    assert len(samples) + drops[0] == rows and len(samples) >= rows // 2
    assert all(abs(r - 1) < 1e-4 and e < 1e-3 for r, e in samples), samples[:3]


def test_exact_attention_in_chunks_equals_one_pass(tiny, monkeypatch):
    """The guardrail's exact attention runs over the context in chunks (online softmax, bounded
    memory): chunks of 2 blocks give what one pass over the ~10-block contexts gives."""
    from oasiskv.kv import guardrail

    def measured():
        llm = LLM(str(tiny), kv_mode="oasis", host_kv_gib=0.01, topk_blocks=2, fetch_ratio=0.5,
                  guardrail_rate=1.0)
        agreement = []
        samples, _ = run(llm, prompts(3, lo=150, hi=200, seed=6), agreement)
        return samples, agreement

    whole = measured()
    lay = LLM(str(tiny), kv_mode="oasis", host_kv_gib=0.01).engine.runner.backend.kv.layout
    monkeypatch.setattr(guardrail, "CHUNK_BYTES", 32 * 4 * lay.num_kv_heads * lay.head_dim)
    chunked = measured()
    assert whole[1] == chunked[1] and len(whole[0]) == len(chunked[0]) > 0
    for (r1, e1), (r2, e2) in zip(*(s for s, _ in (whole, chunked))):
        assert abs(r1 - r2) < 1e-5 and abs(e1 - e2) < 1e-4 * max(1.0, e1)


def test_hbm_gauge_counts_the_guardrail_taps(tiny):
    """``hbm_bytes_in_use`` includes the guardrail's per-layer query and map taps."""
    def gauge(rate):
        llm = LLM(str(tiny), kv_mode="oasis", host_kv_gib=0.01, topk_blocks=2, max_num_seqs=4,
                  guardrail_rate=rate)
        run(llm, prompts(1, lo=40, hi=41, seed=3))
        return llm.engine.stats.kv["hbm_bytes_in_use"]

    layers, rows, heads, kv_heads, dim, k = 2, 4, 4, 2, 32, 2  # tiny qwen3, max_num_seqs 4
    taps = layers * rows * (heads * dim * 4 + kv_heads * k * 4)  # float32 queries, int32 maps
    assert gauge(0.5) - gauge(0.0) == taps
