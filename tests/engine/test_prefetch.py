"""The lookahead prefetch pipeline: modes agree, the stage's failures reach only their requests, and
(on the GPU) the side streams keep event order even when the copy stage is slowed, with no host sync
on the decode path. Also the benchmark-only emulated host capacity.

Without CUDA ``async`` runs its stages in line, so the async-vs-inline tests only compare two code
paths on the GPU (``scripts/gpu_check.sh oasis-tests`` runs this whole file there)."""
import json

import pytest
import torch

from oasiskv import LLM, SamplingParams
from oasiskv.bench.harness import EmulatedHostStore, emulated_host, oasis_backend
from oasiskv.kv import prefetch
from oasiskv.kv.probes import TierProbes
from tests.engine.test_oasis import dense_tokens, prompts
from tests.helpers import eval_prompts, write_tiny_checkpoint

PARAMS = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("qwen3"), "qwen3")


def run(llm, batch, params=PARAMS):
    """Token ids and their logprobs per request, plus the summed decode-step counters (the stall
    time included: the tier's device clock)."""
    engine = llm.engine
    for p in batch:
        engine.add_request(p, params)
    outs, totals = {}, {"fetched_blocks": 0, "decode_rows": 0}
    stall = 0.0  # timing: not compared between runs
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o
        if not engine.stats.last_step_prefill:
            for key in ("fetched_blocks", "decode_rows"):
                totals[key] += engine.stats.kv[key]
            stall += engine.stats.kv["stall_seconds"]
    ordered = [outs[k] for k in sorted(outs, key=lambda r: int(r.split("-")[1]))]
    return [(o.token_ids, [lp.logprob for lp in o.logprobs]) for o in ordered], totals, stall


@pytest.mark.parametrize("draft", ["previous", "ngram"])
def test_async_and_inline_prefetch_agree_when_blocks_are_fetched(tiny, draft):
    batch = prompts(4, lo=90, hi=200, seed=21)
    kw = dict(kv_mode="oasis", topk_blocks=3, fetch_ratio=0.34, host_kv_gib=0.01, draft=draft)
    inline, inline_totals, _ = run(LLM(str(tiny), prefetch="inline", **kw), batch)
    got, totals, _ = run(LLM(str(tiny), prefetch="async", **kw), batch)
    assert inline_totals["fetched_blocks"] > 0, "the run must fetch blocks during decode"
    assert got == inline and totals == inline_totals


def test_prefetch_off_fetches_nothing_after_seeding(tiny):
    batch = prompts(3, lo=90, hi=200, seed=22)
    llm = LLM(str(tiny), kv_mode="oasis", topk_blocks=3, fetch_ratio=0.34, host_kv_gib=0.01,
              draft="previous", prefetch="off")
    _, totals, _ = run(llm, batch)
    assert totals["fetched_blocks"] == 0 and totals["decode_rows"] > 0
    # with every block resident from the start there is nothing to fetch: still exactly dense
    full = LLM(str(tiny), kv_mode="oasis", topk_blocks=64, fetch_ratio=1.0, host_kv_gib=0.01,
               draft="previous", prefetch="off")
    assert [o.token_ids for o in full.generate(batch, PARAMS)] == dense_tokens(tiny, batch, PARAMS)


@pytest.mark.parametrize("prefetch,enforce_eager", [
    ("async", True), ("inline", True),
    # graphs: the copies a replay leaves behind are launched from the host after the step
    pytest.param("async", False, marks=pytest.mark.gpu, id="async-graphs")])
def test_a_failing_prefetch_stage_fails_its_requests_not_the_engine(tiny, monkeypatch, prefetch,
                                                                    enforce_eager):
    if not enforce_eager and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    llm = LLM(str(tiny), kv_mode="oasis", topk_blocks=3, fetch_ratio=0.34, host_kv_gib=0.01,
              draft="ngram", prefetch=prefetch, enforce_eager=enforce_eager)
    engine, backend = llm.engine, llm.engine.runner.backend
    ws = backend.kv.ws
    assert (engine.runner.graphs is None) == enforce_eager
    engine.add_request(prompts(1, lo=120, hi=121, seed=23)[0], PARAMS, request_id="doomed")
    engine.step()  # prefill (seeding fetches through the same copy)
    engine.step()  # a healthy decode step with a prefetch stage
    broken = {"on": True}

    def failing(real):
        def call(*args, **kwargs):
            if broken["on"]:
                raise RuntimeError("host copy failed")
            return real(*args, **kwargs)
        return call

    monkeypatch.setattr(ws, "gather", failing(ws.gather))
    if not enforce_eager:  # a replay's copies are launched as one graph (the step's tail)
        for tail in backend.retrieval._tails.values():
            monkeypatch.setattr(tail.graph, "replay", failing(tail.graph.replay))
    outs = engine.step()
    assert [(o.request_id, o.finish_reason) for o in outs] == [("doomed", "error")]
    assert "host copy failed" in outs[0].error
    assert not engine.has_unfinished()
    engine.allocator.check_invariants([])
    assert engine.allocator.num_free_blocks == engine.allocator.num_total_blocks
    broken["on"] = False  # the engine goes on serving, with correct results
    batch = prompts(2, lo=90, hi=200, seed=24)
    kw = dict(kv_mode="oasis", topk_blocks=3, fetch_ratio=0.34, host_kv_gib=0.01, draft="ngram",
              prefetch=prefetch, enforce_eager=enforce_eager)
    assert run(llm, batch)[0] == run(LLM(str(tiny), **kw), batch)[0]


def test_emulated_host_admits_past_the_physical_store_and_shares_its_blocks(tiny):
    probes = TierProbes(host_store=emulated_host(0.002))
    llm = LLM(str(tiny), kv_mode="oasis", topk_blocks=4, host_kv_gib=0.0002,
              backend_factory=oasis_backend(probes))
    host, alloc = llm.engine.runner.backend.kv.host, llm.engine.allocator
    assert isinstance(host, EmulatedHostStore)
    assert alloc.num_total_blocks == host.num_blocks >= 10 * host.num_physical
    ids = torch.tensor([-1, 0, host.num_physical + 3, 5 * host.num_physical + 1])
    assert host.physical_blocks(ids).tolist() == [-1, 0, 3, 1]
    summaries = llm.engine.runner.backend.kv.summaries.tables[0]
    assert summaries.shape[0] == host.num_blocks, \
        "summaries stay per block id: their HBM cost is real"
    with pytest.raises(ValueError, match="at least one block"):
        EmulatedHostStore(host.layout, host.num_blocks, pin=False, num_physical=0)
    engine, peak = llm.engine, 0
    for p in prompts(6, lo=100, hi=101, seed=25):
        engine.add_request(p, SamplingParams(max_tokens=8, ignore_eos=True))
    while engine.has_unfinished():
        outs = engine.step()
        assert all(o.finish_reason != "error" for o in outs)
        peak = max(peak, len(engine.scheduler.running))
    # 7 blocks each: more than the physical store holds
    assert peak == 6 and 6 * 7 > host.num_physical


def test_bench_labels_emulated_points_and_reports_stall():
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-m", "oasiskv.cli", "--log-level", "WARNING", "bench",
                          "qwen3-tiny", "--context-lens", "256", "--concurrency", "2",
                          "--output-lens", "16", "--kv-mode", "oasis",
                          "--topk-blocks", "4", "--fetch-ratio", "0.25", "--host-kv-gib", "0.001",
                          "--emulated-host-gib", "0.01", "--draft", "previous", "--enforce-eager"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    point = result["points"][0]
    assert point["engine"] == "oasis-K4-previous-async-EMULATED" and "EMULATED" in point["note"]
    assert "EMULATED" in result["environment"]["emulated_host"] and point["stall_ms"] > 0
    assert "*** EMULATED host" in out.stdout and "stall ms" in out.stdout


# ---- GPU: side streams ---------------------------------------------------------------------------

def oasis_fixture_llm(fixtures_path, probes=None, **kw):
    kw = dict(dtype="float32", kv_mode="oasis", topk_blocks=8, fetch_ratio=0.25, host_kv_gib=0.5,
              draft="ngram", max_num_seqs=8) | kw
    return LLM(str(fixtures_path / "target"), backend_factory=oasis_backend(probes or TierProbes()),
               **kw)


class CopyDelay:
    """A ``before_copy`` probe: holds the copy stream ``cycles`` GPU cycles before each copy."""

    def __init__(self):
        self.cycles = 0

    def __call__(self):
        if self.cycles:
            torch.cuda._sleep(self.cycles)


FIXTURE_PARAMS = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, logprobs=0)


def assert_same_run(got, want):
    assert [t for t, _ in got] == [t for t, _ in want]
    for (_, a), (_, b) in zip(got, want):
        assert a == pytest.approx(b, abs=1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "graphs"])
def test_slowed_copy_stage_still_gives_inline_results(cuda_device, fixtures_path, enforce_eager):
    """Each gather is held back ~10 ms on the copy stream: the foreground must wait for it at the
    next step's layer (eager: on the layer's event; graphs: the replay's device-side wait on the
    copy the previous replay left behind), and the stall clock sees that wait."""
    inline_llm = oasis_fixture_llm(fixtures_path, prefetch="inline", enforce_eager=True)
    batch = eval_prompts(fixtures_path, inline_llm, 6, 700)
    want, totals, _ = run(inline_llm, batch, FIXTURE_PARAMS)
    assert totals["fetched_blocks"] > 0
    del inline_llm
    delay = CopyDelay()
    slow = oasis_fixture_llm(fixtures_path, TierProbes(before_copy=delay),
                             enforce_eager=enforce_eager)
    pipeline = slow.engine.runner.backend.retrieval.pipeline
    assert pipeline.asynchronous and (slow.engine.runner.graphs is None) == enforce_eager
    got, _, stall = run(slow, batch, FIXTURE_PARAMS)
    assert_same_run(got, want)
    steps = FIXTURE_PARAMS.max_tokens - 1
    unslowed_stall = stall / steps
    delay.cycles = 20_000_000
    if not enforce_eager:  # the delay must be inside the graphs: capture again
        slow.engine.runner.graphs._capture()
    got, _, stall = run(slow, batch, FIXTURE_PARAMS)
    assert_same_run(got, want)
    slowed_stall = stall / steps
    assert slowed_stall > 5e-3 and unslowed_stall < slowed_stall / 5, (unslowed_stall, slowed_stall)
    # control: without the per-layer wait the slowed copy is visible
    kept = []  # (the stages' tensors stay referenced: only the ordering is broken)
    pipeline.wait = lambda layer: kept.append(pipeline._pending[layer])
    if not enforce_eager:  # the graphs must be captured without their wait nodes
        slow.engine.runner.graphs._capture()
    broken = run(slow, batch, FIXTURE_PARAMS)[0]
    torch.cuda.synchronize()
    assert broken != want


@pytest.mark.gpu
def test_a_copy_that_never_arrives_fails_its_step_instead_of_hanging(cuda_device, fixtures_path,
                                                                     monkeypatch):
    delay = CopyDelay()
    llm = oasis_fixture_llm(fixtures_path, TierProbes(before_copy=delay))
    engine = llm.engine
    monkeypatch.setattr(prefetch, "WAIT_POLLS", 1000)  # far shorter than a copy held back 10 ms
    delay.cycles = 20_000_000
    engine.runner.graphs._capture()
    batch = eval_prompts(fixtures_path, llm, 3, 700, seed=3)
    for p in batch:
        engine.add_request(p, FIXTURE_PARAMS)
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.finished]
    assert len(outs) == 3 and all(o.finish_reason == "error" and "waited more than" in o.error
                                  for o in outs)
    delay.cycles = 0  # the engine goes on serving, with correct results
    monkeypatch.undo()
    engine.runner.graphs._capture()
    want = run(oasis_fixture_llm(fixtures_path, prefetch="inline", enforce_eager=True), batch,
               FIXTURE_PARAMS)[0]
    assert_same_run(run(llm, batch, FIXTURE_PARAMS)[0], want)


@pytest.mark.gpu
@pytest.mark.parametrize("draft", ["none", "previous", "ngram"])
def test_cuda_graph_oasis_decode_equals_eager(cuda_device, fixtures_path, draft):
    eager = oasis_fixture_llm(fixtures_path, draft=draft, enforce_eager=True)
    batch = eval_prompts(fixtures_path, eager, 6, 700, seed=2)
    want, totals, _ = run(eager, batch, FIXTURE_PARAMS)
    del eager
    graphs = oasis_fixture_llm(fixtures_path, draft=draft)
    runner = graphs.engine.runner.graphs
    assert runner is not None and (runner.rows_per_seq == 2) == (draft == "ngram")
    replays, real_run = [], runner.run
    runner.run = lambda rows, *rest: replays.append(len(rows.ids)) or real_run(rows, *rest)
    got, graph_totals, _ = run(graphs, batch, FIXTURE_PARAMS)
    assert len(replays) >= FIXTURE_PARAMS.max_tokens - 2, "decode steps must replay graphs"
    if draft == "ngram":
        assert all(n == 2 * len(batch) for n in replays[:1]), \
            "replays carry a draft row per sequence"
    assert_same_run(got, want)
    assert graph_totals == totals and totals["fetched_blocks"] > 0


@pytest.mark.gpu
def test_lookahead_decode_step_never_syncs_the_host(cuda_device, fixtures_path, monkeypatch):
    llm = oasis_fixture_llm(fixtures_path, dtype="auto", enforce_eager=True)
    backend = llm.engine.runner.backend
    real_decode = backend._decode

    def decode(*args):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return real_decode(*args)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    monkeypatch.setattr(backend, "_decode", decode)
    outs = llm.generate(eval_prompts(fixtures_path, llm, 4, 600, seed=1),
                        SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    assert all(o.finish_reason == "length" and o.error is None for o in outs)
