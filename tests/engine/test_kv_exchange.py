"""Moving a prompt's complete blocks between two tiered engines (``kv/exchange.py``), the bytes
copied here by hand (the NIXL transport has its own tests): the importing engine prefills only the
rest of the prompt and decodes the tokens one engine decodes alone from the same prefix cached
(8-bit KV: the stored rows), with K covering every block; a
prefix it already holds is not read again; holds never leak; a full host store refuses with nothing
held."""
import pytest
import torch

from oasiskv import LLM, SamplingParams
from oasiskv.bench.host_cache import copy_blocks, prefill_and_export
from oasiskv.kv.exchange import KVExchange
from tests.engine.test_oasis import GREEDY, prompts
from tests.helpers import write_tiny_checkpoint

TIER = dict(kv_mode="oasis", topk_blocks=64, fetch_ratio=1.0, host_kv_gib=0.01)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("m"), "qwen3")


def exchange(llm) -> KVExchange:
    return KVExchange(llm.engine.runner.backend)


def cached_prefix_tokens(llm, ids: list[int], shared: int) -> list[int]:
    """``llm``'s greedy tokens for ``ids`` once its prefix cache holds the first ``shared`` (whole
    blocks), as an importing engine holds them: the rest is prefilled over the cached prefix (with
    8-bit KV: the stored rows, as the importer reads them, not the exact ones a single prefill
    attends)."""
    llm.generate([ids[:shared + 1]], SamplingParams(max_tokens=1))
    before = llm.engine.stats.prompt_tokens_total
    tokens = llm.generate([ids], GREEDY)[0].token_ids
    assert llm.engine.stats.prompt_tokens_total - before == len(ids) - shared
    return tokens


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8", "int8"])
def test_imported_prefix_decodes_the_single_engine_tokens(tiny, kv_cache_dtype):
    batch = prompts(3, lo=60, hi=150, seed=11)
    alone = LLM(str(tiny), kv_cache_dtype=kv_cache_dtype, **TIER)
    B = exchange(alone).allocator.block_size
    want = [cached_prefix_tokens(alone, ids, (len(ids) - 1) // B * B) for ids in batch]
    prefill = LLM(str(tiny), kv_cache_dtype=kv_cache_dtype, **TIER)
    decode = LLM(str(tiny), kv_cache_dtype=kv_cache_dtype, **TIER)
    src, dst = exchange(prefill), exchange(decode)
    for ids, tokens in zip(batch, want):
        offered = prefill_and_export(prefill, ids)
        assert len(offered) == (len(ids) - 1) // B  # the whole shareable prefix, held
        imp = dst.begin_import(dst.prompt_hashes(ids)[:len(offered)])
        assert imp.missing == list(range(len(offered)))
        copy_blocks(src, dst, [offered[i] for i in imp.missing],
                    [imp.blocks[i] for i in imp.missing])
        dst.finish_import(imp)
        src.release(offered)
        before = decode.engine.stats.prompt_tokens_total
        assert decode.generate([ids], GREEDY)[0].token_ids == tokens
        # only the last partial block (and the last token) was prefilled
        assert decode.engine.stats.prompt_tokens_total - before == len(ids) - len(offered) * B
    for llm in (prefill, decode):
        llm.engine.allocator.check_invariants([])
        assert not llm.engine.allocator.held
        assert llm.engine.allocator.num_free_blocks == llm.engine.allocator.num_total_blocks


def test_a_prefix_the_decode_host_holds_is_not_read_again(tiny):
    ids = prompts(1, lo=120, hi=121, seed=4)[0]
    longer = ids + prompts(1, lo=40, hi=41, seed=5)[0]
    prefill, decode = LLM(str(tiny), **TIER), LLM(str(tiny), **TIER)
    src, dst = exchange(prefill), exchange(decode)
    first = prefill_and_export(prefill, ids)
    B = dst.allocator.block_size
    assert dst.uncached(dst.prompt_hashes(ids)) == len(first) == (len(ids) - 1) // B
    imp = dst.begin_import(dst.prompt_hashes(ids)[:len(first)])
    copy_blocks(src, dst, first, imp.blocks)
    dst.finish_import(imp)
    src.release(first)
    # held here now: none of the prompt's blocks is missing, only the longer one's new ones
    assert dst.uncached(dst.prompt_hashes(ids)) == 0
    assert dst.uncached(dst.prompt_hashes(longer)) == (len(longer) - 1) // B - len(first)
    second = prefill_and_export(prefill, longer)
    assert second[:len(first)] == first  # the prefill worker reused its own prefix too
    imp = dst.begin_import(dst.prompt_hashes(longer)[:len(second)])
    assert imp.missing == list(range(len(first), len(second)))
    dst.abort_import(imp)  # nothing read: the fresh blocks go back unnamed
    src.release(second)
    assert not dst.allocator.held and not src.allocator.held
    imp = dst.begin_import(dst.prompt_hashes(longer)[:len(second)])
    assert imp.missing == list(range(len(first), len(second)))
    dst.abort_import(imp)
    # a memory worker keeps what it imports held, to serve it on: named, and held until released
    src_blocks = prefill_and_export(prefill, longer)
    imp = dst.begin_import(dst.prompt_hashes(longer)[:len(src_blocks)])
    copy_blocks(src, dst, [src_blocks[i] for i in imp.missing],
                [imp.blocks[i] for i in imp.missing])
    kept = dst.finish_import(imp, keep=True)
    src.release(src_blocks)
    assert kept == imp.blocks and all(dst.allocator.held[b] == 1 for b in kept)
    assert dst.uncached(dst.prompt_hashes(longer)) == 0
    dst.release(kept)
    assert not dst.allocator.held
    dst.allocator.check_invariants([])


def test_a_full_host_store_or_too_many_holds_refuse_with_nothing_held(tiny):
    """An import needs free blocks, and exchanges may hold at most half of the store (an export
    past that offers nothing): both refusals leave nothing held."""
    ids = prompts(1, lo=150, hi=151, seed=6)[0]
    decode = LLM(str(tiny), **TIER)
    dst = exchange(decode)
    total, n = dst.allocator.num_total_blocks, (len(ids) - 1) // dst.allocator.block_size
    assert dst.max_held == total // 2
    hog = dst.allocator.hold_new(dst.max_held - 2)
    with pytest.raises(RuntimeError, match=f"at most {dst.max_held}"):
        dst.begin_import(dst.prompt_hashes(ids)[:n])
    decode.generate([ids], SamplingParams(max_tokens=1, temperature=0))  # its blocks cached
    assert dst.export(ids) == []
    dst.allocator.release(hog)
    dst.max_held = 10 * total  # only the free blocks bound it now
    hog = dst.allocator.hold_new(dst.allocator.num_free_blocks - 2)
    with pytest.raises(RuntimeError, match="exhausted"):
        dst.begin_import(dst.prompt_hashes(prompts(1, lo=150, hi=151, seed=7)[0])[:n])
    assert sum(dst.allocator.held.values()) == len(hog)
    dst.allocator.release(hog)
    dst.allocator.check_invariants([])
    assert not dst.allocator.held


def test_exchange_needs_the_tiered_path(tiny):
    with pytest.raises(ValueError, match="kv-mode oasis"):
        KVExchange(LLM(str(tiny), num_kv_blocks=64).engine.runner.backend)


def test_prefix_cache_evictions_are_counted(tiny):
    """A host store too small to keep earlier prompts cached hands their blocks out again, and
    says how many; a large one keeps them all."""
    batch = prompts(6, lo=100, hi=150, seed=12)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    for gib, evicting in ((0.0004, True), (0.01, False)):
        llm = LLM(str(tiny), **(TIER | dict(host_kv_gib=gib)))
        for ids in batch:
            llm.generate([ids], params)
        evictions = llm.engine.stats.kv_totals["prefix_evictions"]
        assert (evictions > 0) == evicting, (gib, evictions)


def test_a_handoff_counts_its_blocks_once_pending_then_held(tiny):
    """A ``hand_off`` request's blocks are pending until its prefill ends, held from then on,
    never both: the room a prefill worker sees for more handoffs (pending + held) stays the same
    through the step that ends the prefill, and goes when the holder lets go."""
    engine = LLM(str(tiny), **TIER).engine
    ids = prompts(2, lo=70, hi=110, seed=13)
    B = engine.allocator.block_size
    need = [-(-len(p) // B) for p in ids]
    rids = [engine.add_request(p, SamplingParams(max_tokens=n, temperature=0), hand_off=True)
            for p, n in zip(ids, (1, 3))]  # (one decodes on after its prefill, still held)
    engine.add_request(ids[0], SamplingParams(max_tokens=3, temperature=0))  # (not counted)
    held = lambda: sum(engine.allocator.held.values())  # noqa: E731
    assert (engine.pending_handoff_blocks(), held()) == (sum(need), 0)
    while engine.has_unfinished():
        engine.step()
        assert engine.pending_handoff_blocks() + held() == sum(need)
    assert engine.pending_handoff_blocks() == 0
    for rid, n in zip(rids, need):
        handoff = engine.take_handoff(rid)
        assert len(handoff.blocks) == n
        engine.allocator.release(handoff.blocks)
    assert held() == 0


def test_an_export_leaves_room_for_the_handoffs_still_prefilling(tiny):
    """A prefill worker's exchange counts the blocks its handoffs will hold once their prefills
    end (``reserved``) against its bound: an export that fits the holds alone but not with them
    holds nothing; once the handoff is taken and let go, the same export holds its blocks."""
    engine = LLM(str(tiny), **TIER).engine
    ex = KVExchange(engine.runner.backend)
    ex.reserved = engine.pending_handoff_blocks
    cached, handed = prompts(2, lo=70, hi=110, seed=15)
    engine.add_request(cached, SamplingParams(max_tokens=1, temperature=0))
    while engine.has_unfinished():
        engine.step()
    shareable = len(ex.prompt_hashes(cached))
    rid = engine.add_request(handed, SamplingParams(max_tokens=1, temperature=0), hand_off=True)
    pending = engine.pending_handoff_blocks()
    assert pending == -(-len(handed) // engine.allocator.block_size) and shareable > 0
    ex.max_held = shareable + pending - 1  # (room for the export, or for the handoff)
    assert ex.export(cached) == [] and not engine.allocator.held
    while engine.has_unfinished():
        engine.step()
    handoff = engine.take_handoff(rid)
    assert len(handoff.blocks) == pending and engine.pending_handoff_blocks() == 0
    assert ex.export(cached) == []  # (the handoff holds its blocks now)
    engine.allocator.release(handoff.blocks)
    blocks = ex.export(cached)
    assert len(blocks) == shareable
    ex.release(blocks)
    assert not engine.allocator.held


def test_an_engineless_store_relays_a_prefix_with_the_engines_layout(tiny):
    """A memory worker's exchange (``KVExchange.store_only``: a bare host store in the layout
    ``TieredLayout.of`` gives for the model's config and the flags, no engine, no summaries)
    takes a prefilled prompt's blocks and serves them on: an engine importing them from there
    prefills only the rest and decodes the tokens of one engine alone. Its holds may take every
    block; a second import of the same prefix reads nothing."""
    from oasiskv.config import EngineConfig, ModelConfig
    from oasiskv.kv.host_store import HostStore
    from oasiskv.kv.layout import TieredLayout
    ids = prompts(1, lo=130, hi=131, seed=14)[0]
    alone = LLM(str(tiny), **TIER)
    want = alone.generate([ids], GREEDY)[0].token_ids
    prefill, decode = LLM(str(tiny), **TIER), LLM(str(tiny), **TIER)
    config = EngineConfig.from_flat(model=str(tiny), **TIER)
    layout = TieredLayout.of(config, ModelConfig.from_file(tiny / "config.json"), torch.float32)
    assert layout == decode.engine.runner.backend.kv.layout
    store = KVExchange.store_only(layout, HostStore(layout, 40, pin=False))
    assert store.max_held == 40 and not store.summarises
    src, dst = exchange(prefill), exchange(decode)
    offered = prefill_and_export(prefill, ids)
    held = []
    for missing in (len(offered), 0):  # (the second time: all cached there, nothing read)
        relay = store.begin_import(store.prompt_hashes(ids)[:len(offered)])
        assert len(relay.missing) == missing
        copy_blocks(src, store, [offered[i] for i in relay.missing],
                    [relay.blocks[i] for i in relay.missing])
        held.append(store.finish_import(relay, keep=True))
    kept = held[0]
    assert held[1] == kept
    store.release(held[1])
    src.release(offered)
    imp = dst.begin_import(dst.prompt_hashes(ids)[:len(kept)])
    copy_blocks(store, dst, kept, imp.blocks)
    dst.finish_import(imp)
    store.release(kept)
    assert not store.allocator.held
    assert store.allocator.num_free_blocks == 40
    before = decode.engine.stats.prompt_tokens_total
    assert decode.generate([ids], GREEDY)[0].token_ids == want
    B = layout.block_size
    assert decode.engine.stats.prompt_tokens_total - before == len(ids) - len(kept) * B
