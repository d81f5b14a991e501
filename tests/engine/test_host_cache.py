"""The decode-host cache (``kv/host_cache.py``, ``f_host < 1``): a decode engine that keeps only
``f_host * P + F`` of each request's blocks in host memory and reads evicted prompt blocks again
from where they came from decodes the tokens of the same engine that keeps them all; the cache's
bookkeeping keeps its invariants under random use. The remote tier here copies from another
engine's host store in this process (the NIXL transport has its own tests, and the server tests run
the two together)."""
import json
import random
import time

import pytest
import torch

from oasiskv import LLM
from oasiskv.bench.host_cache import decode_imported
from oasiskv.kv.allocator import TieredAllocator
from oasiskv.kv.host_cache import HostCache, NoHostRows
from oasiskv.kv.layout import TieredLayout
from oasiskv.kv.remote_fetch import RemoteFetch
from tests.engine.test_oasis import GREEDY, prompts
from tests.helpers import write_tiny_checkpoint

# "previous": every decode step has its lookahead query, so on a GPU every step replays a graph and
# the blocks are made resident between the replay and its tail of copies
TIER = dict(kv_mode="oasis", topk_blocks=2, fetch_ratio=1.0, host_kv_gib=0.01, draft="previous")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("m"), "qwen3")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_bounded_decode_host_decodes_the_tokens_of_one_that_keeps_everything(tiny, device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    batch = prompts(3, lo=500, hi=700, seed=21)
    want = decode_imported(str(tiny), batch, GREEDY, 1.0, device=device, **TIER)
    run = decode_imported(str(tiny), batch, GREEDY, 0.25, device=device, **TIER)
    assert [o.token_ids for o in run.outputs] == [o.token_ids for o in want.outputs]
    host, idle = run.host, run.idle
    assert isinstance(host, HostCache) and host.num_blocks == 4 * host.num_physical
    # prompt blocks were evicted by the LRU pass and read again when selected
    assert host.stats.evictions > 0 and host.stats.misses > 0
    # read again a layer at a time, as the selections want them; on a GPU by the replays'
    # remote-fetch stage
    assert host.reader.units == host.stats.units and host.reader.layer_units > 0
    assert (host.stats.staged_reads > 0) == (device == "cuda")
    # the requests ended: every lease is idle, nothing is located, rows and ids agree
    assert sorted(idle) == [0, 1, 2] and not host.where
    host.check_invariants()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_handed_off_prompt_decodes_the_tokens_of_the_engine_that_prefilled_it(tiny, device):
    """Partial admission: only the last block and the summaries move at admission; the decode
    engine seeds its working sets from the prefill engine's queries, samples the first token from
    its hidden state, and reads the selected blocks layer by layer: the tokens of one engine that
    prefills and decodes, at a K that leaves most blocks out."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    batch = prompts(3, lo=500, hi=700, seed=21)
    batch[2] = batch[2][:16 * 40]  # a prompt of whole blocks: its last block is a complete one
    llm = LLM(str(tiny), device=device, **TIER)
    want = [o.token_ids for o in llm.generate(batch, GREEDY)]
    block = llm.engine.runner.backend.kv.layout.host_block_bytes
    del llm
    run = decode_imported(str(tiny), batch, GREEDY, 0.25, partial=True, device=device, **TIER)
    assert [o.token_ids for o in run.outputs] == want
    host = run.host
    # admission moved one block per prompt and the summaries, not the prompt
    full = sum((len(ids) - 1) // 16 for ids in batch) * block
    assert 3 * block <= run.admission_bytes < full / 4
    # what the seeding selected was read a layer at a time (K = 2 of ~40 blocks per head)
    assert host.reader.layer_units > 0 and host.stats.misses > 0
    assert sorted(run.idle) == [0, 1, 2] and not host.where and not run.held
    host.check_invariants()


def test_a_handed_off_prompt_with_8_bit_kv_opens_its_local_block_dequantized(tiny, monkeypatch):
    """Partial admission with FP8 K/V and open blocks: the decode engine has only the 8-bit copy
    of a prompt's last, partly written block, so at seeding its open block (what decode attends)
    becomes those rows dequantized, at every layer, and decode goes on from there."""
    from oasiskv.kernels.fp8 import as_bytes, dequantize
    from oasiskv.kv.working_set import WorkingSet
    opened, real = [], WorkingSet.open_from_local

    part = 5  # the prompts' tokens in their last block (its other rows are never read)

    def spy(ws, layer, slots):
        real(ws, layer, slots)
        slot = slots.long()
        k_local, v_local = ws.local(layer)  # (8-bit values, V too, in token order)
        for open_rows, local, scale in zip((ws.open_k, ws.open_v), (k_local, v_local),
                                           ws.local_scales(layer)):
            rows = as_bytes(local)[slot].view(local.dtype)
            want = dequantize(rows, scale[slot]).to(open_rows[layer].dtype)
            assert torch.equal(open_rows[layer][slot][:, :, :part], want[:, :, :part])
        written = ws.open_k[layer][slot][:, :, :part]
        opened.append((layer, int(slot[0]), float(written.abs().sum())))
    monkeypatch.setattr(WorkingSet, "open_from_local", spy)
    batch = prompts(2, lo=500, hi=700, seed=21)
    batch = [ids[:16 * 30 + part] for ids in batch]
    run = decode_imported(str(tiny), batch, GREEDY, 0.25, partial=True, kv_cache_dtype="fp8",
                          **TIER)
    layers = json.loads((tiny / "config.json").read_text())["num_hidden_layers"]
    assert len(opened) == 2 * layers and all(total > 0 for _, _, total in opened)
    assert all(o.finish_reason == "length" and len(o.token_ids) == GREEDY.max_tokens
               for o in run.outputs)


def test_a_lost_remote_tier_ends_only_the_requests_whose_blocks_it_held(tiny):
    batch = prompts(3, lo=500, hi=700, seed=21)
    want = [o.token_ids for o in decode_imported(str(tiny), batch, GREEDY, 1.0, **TIER).outputs]
    run = decode_imported(str(tiny), batch, GREEDY, 0.25, down=("prompt-1",), **TIER)
    got, host, idle = run.outputs, run.host, run.idle
    assert got[1].finish_reason == "error" and "prompt-1 is gone" in got[1].error
    assert len(got[1].token_ids) < len(want[1])
    assert [got[i].token_ids for i in (0, 2)] == [want[i] for i in (0, 2)]
    assert host.stats.misses > 0 and sorted(idle) == [0, 1, 2] and not host.where
    host.check_invariants()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_slow_remote_tier_holds_back_only_the_requests_that_read_from_it(tiny, device):
    """Reads of prompt 1's blocks take 0.3 s (copied only then): each step waits for them 2 ms at
    most, then request 1 sits out steps until its blocks land while the others go on; every
    request decodes the tokens of a decode host that keeps all its blocks (on a GPU the copies
    are taken out of a replayed graph's tail, on the CPU out of the eager step's gathers)."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    batch = prompts(3, lo=500, hi=700, seed=21)
    want = [o.token_ids for o in decode_imported(str(tiny), batch, GREEDY, 1.0, device=device,
                                                 **TIER).outputs]
    run = decode_imported(str(tiny), batch, GREEDY, 0.25, device=device,
                          slow={"prompt-1": 0.3}, **TIER)
    assert [o.token_ids for o in run.outputs] == want
    last = max(i for i, ids in enumerate(run.progress) if "1" in ids)
    others_only = [i for i in range(last) if run.progress[i] and "1" not in run.progress[i]]
    assert run.host.stats.deferred > 0 and len(others_only) > 5
    assert (run.host.stats.staged_reads > 0) == (device == "cuda")
    run.host.check_invariants()


def test_a_remote_read_past_its_deadline_ends_only_its_request(tiny):
    """Reads of prompt 1's blocks never complete: request 1 ends with the read's error when it
    passes the tier's deadline (2 s); the others decode their tokens meanwhile and after."""
    batch = prompts(3, lo=500, hi=700, seed=21)
    want = [o.token_ids for o in decode_imported(str(tiny), batch, GREEDY, 1.0, **TIER).outputs]
    run = decode_imported(str(tiny), batch, GREEDY, 0.25, slow={"prompt-1": 1e9}, **TIER)
    got = run.outputs
    assert got[1].finish_reason == "error" and "did not complete in time" in got[1].error
    assert [got[i].token_ids for i in (0, 2)] == [want[i] for i in (0, 2)]
    assert not run.host.where and sorted(run.idle) == [0, 1, 2]
    run.host.check_invariants()


def test_the_lru_pass_keeps_the_budget_and_spares_working_sets(tiny):
    layout = TieredLayout(1, 1, 16, 16, 2, torch.float32, torch.float32, torch.float32)
    host = HostCache(layout, 64, False, 32, torch.device("cpu"), 0.25)
    alloc = TieredAllocator(64, 2, 16, host=host)
    table = alloc.hold_new(20)  # 20 prompt blocks, located
    host.locate(table, list(range(100, 120)), "peer", "lease")
    host.touch(table[10:])  # the later half used more recently
    pinned = {table[0], table[1]}  # in a working set
    evicted = host.enforce_budgets([(table + alloc.hold_new(3), 20)], pinned)
    # budget ceil(0.25 * 20) + 3 = 8 of 23: 15 evicted, the least recently used first
    assert evicted == 15
    resident = [b for b in table if host.resident(b)]
    assert set(pinned) <= set(resident) and len(resident) == 5
    assert set(resident) - pinned == set(table[17:])
    host.check_invariants()


class Done:
    """A read that completed when it started."""

    def done(self) -> bool:
        return True


def test_random_use_keeps_the_cache_consistent():
    """Random takes, shares, frees, locations, reads (whole blocks or one of two layers; half of
    them complete only a few polls later, and copy only then; some fail, some of those still
    writing), lost leases and LRU passes against a 12-row cache of 48 ids, callers that wait for
    their reads and callers that do not: rows and ids stay one to one, every layer a caller asked
    for holds its block's contents unless it was told the layer is still pending (or its read
    failed), and a block nobody can read again (unlocated, in use) is never evicted. Some callers
    start their reads a layer at a time and wait for them afterwards, as a replay's remote-fetch
    stage does (``start_reads`` then ``wait_reads``): a layer's reads never evict a block an
    earlier layer of the same step wants."""
    rng = random.Random(0)
    layout = TieredLayout(2, 1, 16, 16, 2, torch.float32, torch.float32, torch.float32)
    host = HostCache(layout, 48, False, 12, torch.device("cpu"), 0.5)
    alloc = TieredAllocator(48, 4, 16, host=host)
    remote = torch.arange(1000, 1048, dtype=torch.float32)  # block b's contents there: 1000 + b

    class Read:
        def __init__(self, units):
            self.units, self.polls = units, rng.choice([0, 0, 1, 3])

        def done(self):
            if self.polls:
                self.polls -= 1
                return False
            if rng.random() < 0.05:
                exc = ConnectionError("peer gone")
                exc.unsettled = rng.random() < 0.5
                raise exc
            for b, row, layer in self.units:
                host.k[row, max(layer, 0):None if layer < 0 else layer + 1] = remote[b]
            self.units = []
            return True

    class Tier:
        def start(self, source, remote_blocks, rows, layers):
            assert source == "peer"
            return Read(list(zip(remote_blocks, rows, layers)))

    host.reader = Tier()
    content = {}  # resident block -> what its row must hold
    tables: list[list[int]] = []
    for _ in range(400):
        op = rng.random()
        try:
            if op < 0.3:
                blocks = alloc.hold_new(rng.randint(1, 3))
                for b in blocks:  # written here: contents only this store has, unless located
                    host.k[host._row_of[b]] = -b
                    content[b] = -b
                if rng.random() < 0.5:
                    host.locate(blocks, blocks, "peer", rng.randint(0, 2))
                    for b in blocks:
                        host.k[host._row_of[b]] = 1000 + b
                        content[b] = 1000 + b
                tables.append(blocks)
            elif op < 0.5 and tables:
                alloc.release(tables.pop(rng.randrange(len(tables))))
            elif op < 0.58 and tables:  # a replayed step: per layer, then one wait
                want, keep = {}, set()
                for i in (0, 1):
                    blocks = rng.sample(rng.choice(tables), 1)
                    blocks += [b for b in rng.choice(tables) if rng.random() < 0.5]
                    blocks = list(dict.fromkeys(blocks))
                    keep.update(blocks)
                    for b in blocks:
                        want[b] = want.get(b, 0) | 1 << i
                    host.start_reads(dict.fromkeys(blocks, 1 << i), keep, early=True)
                    for b in keep:  # (nothing the step wants lost its row, but by a failure)
                        assert host.resident(b) or b in host.failed, b
                pending = host.wait_reads(want, rng.choice([0.0, None]))
                host.take_failed()
                for b, mask in want.items():
                    if host.resident(b):
                        for i in (0, 1):
                            if mask >> i & 1 and not pending.get(b, 0) >> i & 1:
                                assert (host.k[host._row_of[b], i] == content[b]).all(), (b, i)
            elif op < 0.8 and tables:
                table, layer = rng.choice(tables), rng.choice([None, 0, 1])
                pending = {}
                if rng.random() < 0.5:  # waits for what it reads
                    host.make_resident(table, layer)
                else:  # does not
                    pending = host.make_resident_layers(
                        [table if layer in (None, i) else [] for i in range(2)], partial=True,
                        stall_s=0.0)
                    host.take_failed()  # (more blocks than rows: those without one failed)
                for b in filter(host.resident, table):
                    for i in (0, 1) if layer is None else (layer,):
                        if not pending.get(b, 0) >> i & 1:
                            assert (host.k[host._row_of[b], i] == content[b]).all(), (b, i)
            elif op < 0.85:
                host.poll()
            elif op < 0.86:
                host.lease_lost(rng.randint(0, 2))
            elif tables:
                host.enforce_budgets([(t, len(t)) for t in tables], set())
        except (RuntimeError, NoHostRows):
            pass  # no row left for unlocated blocks: refused, nothing changed
        host.check_invariants()
        for t in tables:
            for b in t:
                assert host.resident(b) or b in host.where, f"block {b} lost"
                if b in host.where:
                    content[b] = 1000 + b
    for t in tables:
        alloc.release(t)
    assert not host.where and not alloc.held


def test_more_blocks_at_once_than_rows_fail_those_blocks_not_the_caller():
    layout = TieredLayout(1, 1, 16, 16, 2, torch.float32, torch.float32, torch.float32)
    host = HostCache(layout, 32, False, 4, torch.device("cpu"), 0.5)
    alloc = TieredAllocator(32, 2, 16, host=host)
    blocks = alloc.hold_new(4)
    host.locate(blocks, blocks, "peer", "lease")

    class Tier:
        def start(self, source, remote_blocks, rows, layers):
            return Done()

    host.reader = Tier()
    host.enforce_budgets([(blocks, 4)], set())  # 2 of 4 evicted
    more = alloc.hold_new(2)  # in use, not located: they keep the two free rows
    assert all(host.resident(b) for b in more)
    resident = [b for b in blocks if host.resident(b)]
    assert len(resident) == 2
    with pytest.raises(NoHostRows):  # four blocks at once, two rows to be had
        host.make_resident(blocks)
    assert not host.failed and [b for b in blocks if host.resident(b)] == resident
    host.make_resident(blocks, partial=True)
    assert [b for b in blocks if host.resident(b)] == resident
    failed = host.take_failed()
    assert sorted(failed) == sorted(set(blocks) - set(resident))
    assert "rows" in next(iter(failed.values()))
    host.check_invariants()


def test_a_refusal_changes_nothing_and_a_lost_lease_is_not_read_again():
    layout = TieredLayout(2, 1, 16, 16, 2, torch.float32, torch.float32, torch.float32)
    host = HostCache(layout, 32, False, 6, torch.device("cpu"), 0.5)
    alloc = TieredAllocator(32, 2, 16, host=host)
    reads = []

    class Tier:
        def start(self, source, remote_blocks, rows, layers):
            reads.append((source, list(remote_blocks), list(layers)))
            return Done()

    host.reader = Tier()
    kept, lost = alloc.hold_new(2), alloc.hold_new(2)
    host.locate(kept, [0, 1], "a", "kept")
    host.locate(lost, [2, 3], "b", "lost")
    host.touch(kept)
    host.enforce_budgets([(kept + lost, 4)], set())  # the 2 "lost" blocks evicted (LRU)
    before = host.rows_in_use, dict(host.where), host.stats.evictions
    with pytest.raises(RuntimeError):  # 7 rows wanted, 4 free + 2 evictable: refused first
        alloc.hold_new(7)
    assert (host.rows_in_use, dict(host.where), host.stats.evictions) == before
    for i, b in enumerate(lost):  # (named in the prefix cache, as imported blocks are)
        alloc.register(b, 100 + i)
    host.lease_lost("lost")
    host.lease_lost("never held")  # (a lease no block names: nothing to remember)
    assert host._lost == {"lost"}
    # its resident whole blocks stay, without a location; the others fail when read (taking no
    # row from anyone) and are out of the prefix cache at once
    doomed = [b for b in lost if b in host.where]
    assert doomed and all(b not in alloc.block_hash for b in doomed)
    assert all(b not in host.where for b in lost if host.resident(b))
    evictions = host.stats.evictions
    host.make_resident(doomed, partial=True)
    assert host.stats.evictions == evictions
    host.make_resident(kept + lost, layer=1, partial=True)
    failed = host.take_failed()
    assert set(failed) == set(doomed)
    assert all("lease" in why for why in failed.values())
    assert all(source == "a" for source, _, _ in reads) and all(r[2] == [1] * len(r[1])
                                                                for r in reads)
    alloc.release(kept + lost)
    assert not host.where and not host._lost
    host.check_invariants()


def test_blocks_located_for_a_request_that_never_took_them_let_their_lease_go():
    """Imported blocks are located after the import lets go of them, for the request added next to
    take from the prefix cache; if it never does, ``drop_unused`` (after a grace) lets them go as a
    release would: the lease is idle, a resident block stays cached, an evicted one leaves the
    prefix cache. A block a request took keeps its location."""
    layout = TieredLayout(1, 1, 16, 16, 2, torch.float32, torch.float32, torch.float32)
    host = HostCache(layout, 32, False, 8, torch.device("cpu"), 0.5)
    alloc = TieredAllocator(32, 2, 16, host=host)
    idle = []
    host.on_lease_idle = idle.append
    blocks = alloc.hold_new(4)
    for i, b in enumerate(blocks):  # (named, as an import names them)
        alloc.register(b, 100 + i)
    alloc.release(blocks)
    host.locate(blocks, [10, 11, 12, 13], "peer", "lease")
    taken = alloc.hold_cached([100])  # a request takes the first block
    host._evict(blocks[3])  # (the LRU took the last one's row)
    assert host.drop_unused(grace_s=60.0) == 0 and not idle  # within the grace: kept
    host.check_invariants()
    assert host.drop_unused(grace_s=0.0) == 3
    assert idle == [] and set(host.where) == {blocks[0]}  # the taken block keeps the lease
    assert all(alloc.hash_to_block.get(100 + i) == b for i, b in enumerate(blocks[:3]))
    assert 103 not in alloc.hash_to_block  # not resident, no location: out of the prefix cache
    host.check_invariants()
    alloc.release(taken)
    assert idle == ["lease"] and not host.where
    host.check_invariants()


def test_a_block_let_go_while_its_read_is_in_flight_is_never_used_stale():
    """A request ends while one of its blocks is still being read (its step stopped waiting): the
    block leaves the prefix cache at once (its lease may go before the read ends), and when its id
    is handed out again the new block neither waits for the old read nor inherits its failure;
    the old read's row is retired (it may still write there)."""
    layout = TieredLayout(2, 1, 16, 16, 2, torch.float32, torch.float32, torch.float32)
    host = HostCache(layout, 32, False, 8, torch.device("cpu"), 0.5)
    alloc = TieredAllocator(32, 2, 16, host=host)
    landed = []

    class Never:
        def done(self):
            if landed:
                raise ConnectionError("peer gone")
            return False

    class Tier:
        def start(self, source, remote_blocks, rows, layers):
            return Never()

    host.reader = Tier()
    blocks = alloc.hold_new(2)
    host.locate(blocks, [0, 1], "peer", "lease")
    host.enforce_budgets([(blocks, 2)], set())  # one of the two evicted
    (gone,) = [b for b in blocks if not host.resident(b)]
    alloc.register(gone, 1234)
    assert host.make_resident_layers([[gone], []], stall_s=0.0) == {gone: 1}
    alloc.release(blocks)
    assert gone not in alloc.block_hash and gone in host.pending
    rows = host.num_physical
    start = time.monotonic()
    host.taken([gone], fresh=True)
    assert time.monotonic() - start < 0.5 and gone not in host.pending and host.resident(gone)
    assert host.num_physical == rows - 1  # (the old read's row)
    assert host.poll()  # (the old read still runs)
    landed.append(True)
    assert not host.poll()
    assert not host.take_failed()
    host.released([gone])
    host.check_invariants()


def _located_cache(rows: int, blocks: int, slow_polls: int = 0):
    """A 2-layer cache of ``rows`` rows whose first ``blocks`` ids are located on "peer" (their
    contents there: 1000 + id) and evicted; its tier records each transfer started (source,
    layers) and completes a read ``slow_polls`` polls after it starts, copying only then."""
    layout = TieredLayout(2, 1, 16, 16, 2, torch.float32, torch.float32, torch.float32)
    host = HostCache(layout, 64, False, rows, torch.device("cpu"), 0.5)
    alloc = TieredAllocator(64, 4, 16, host=host)
    table = []
    while len(table) < blocks:  # (a few at a time: each takes a row until it is evicted)
        more = alloc.hold_new(min(rows, blocks - len(table)))
        host.locate(more, more, "peer", "lease")
        for b in more:
            host._evict(b)  # (as the LRU pass would, in time)
        table += more
    starts = []

    class Read:
        def __init__(self, units):
            self.units, self.polls = units, slow_polls

        def done(self):
            if self.polls:
                self.polls -= 1
                return False
            for b, row, layer in self.units:  # (layer -1: the whole block)
                host.k[row, max(layer, 0):None if layer < 0 else layer + 1] = 1000 + b
            return True

    class Tier:
        def start(self, source, remote_blocks, rows, layers):
            starts.append((source, sorted(set(layers))))
            return Read(list(zip(remote_blocks, rows, layers)))

    host.reader = Tier()
    return host, table, starts


def _publishes_after_the_first_start(remote: RemoteFetch, starts: list, ids: torch.Tensor):
    """A ``replay_done`` for ``advance`` under which the replay never ends and layer 1's ids are
    published once the host has started layer 0's reads (its selection comes later)."""
    def replay_done() -> bool:
        if len(starts) == 1 and not remote.flags[1].item():
            remote.publish(1, ids)
        return False
    return replay_done


def test_the_remote_fetch_stage_starts_each_layer_as_its_selection_is_published():
    """``RemoteFetch`` (as a replay runs): the ids of layer 0 are published, its reads start (one
    transfer, the misses of both "requests" coalesced) before layer 1's ids exist; layer 1's
    start once published; the device copies out of the store are waited for once; reads still
    running after the step's wait are pending (the copies that need them are deferred), and
    land later with the remote contents."""
    host, table, starts = _located_cache(rows=16, blocks=6, slow_polls=4)
    remote = RemoteFetch(2, 8, torch.device("cpu"))
    tail_waits = []
    ids = [torch.tensor([table[0], table[1], -1, table[0], table[4], -1], dtype=torch.long),
           torch.tensor([table[2], -1, table[3], table[3], -1, -1], dtype=torch.long)]
    remote.arm(6)
    remote.publish(0, ids[0])
    remote.advance(host, lambda: tail_waits.append(1), _publishes_after_the_first_start(
        remote, starts, ids[1]))
    assert starts == [("peer", [0]), ("peer", [1])]
    assert tail_waits == [1] and remote.early_layers == 2
    assert host.stats.staged_reads == host.stats.early_reads == 2
    assert remote.want == {table[0]: 1, table[1]: 1, table[4]: 1, table[2]: 2, table[3]: 2}
    remote.advance(host, lambda: tail_waits.append(1), None)  # finish: nothing left to start
    assert len(starts) == 2 and tail_waits == [1]
    pending = host.wait_reads(remote.want, stall_s=0.0)
    assert pending == remote.want and host.stats.deferred == 2
    # a read still running at a later step's wait is not deferred again
    assert host.wait_reads(remote.want, stall_s=0.0) == pending and host.stats.deferred == 2
    assert host.wait_reads(remote.want, stall_s=None) == {}
    for b, mask in remote.want.items():
        layer = mask.bit_length() - 1
        assert (host.k[host._row_of[b], layer] == 1000 + b).all()
    remote.disarm()
    assert not remote.armed and not remote.want
    host.check_invariants()


def test_layers_published_by_the_time_the_host_looks_are_read_in_one_transfer():
    """A small model's layers outrun the host's work per transfer: the layers whose flags are up
    when the host looks go out together, one transfer per source for all of them."""
    host, table, starts = _located_cache(rows=16, blocks=4)
    remote = RemoteFetch(2, 4, torch.device("cpu"))
    remote.arm(2)
    remote.publish(0, torch.tensor([table[0], table[1]], dtype=torch.long))
    remote.publish(1, torch.tensor([table[1], table[2]], dtype=torch.long))
    remote.advance(host, lambda: None, lambda: False)
    # one transfer: layer 0's units, layer 1's, and the block both want as a whole (-1)
    assert starts == [("peer", [-1, 0, 1])] and remote.early_layers == 2
    assert remote.want == {table[0]: 1, table[1]: 3, table[2]: 2}
    assert host.wait_reads(remote.want, stall_s=None) == {}
    for b, mask in remote.want.items():
        for layer in (0, 1):
            if mask >> layer & 1:
                assert (host.k[host._row_of[b], layer] == 1000 + b).all()
    host.check_invariants()


def test_a_layer_never_published_is_left_to_finish_and_then_is_an_error():
    host, table, starts = _located_cache(rows=8, blocks=2)
    remote = RemoteFetch(2, 4, torch.device("cpu"))
    remote.arm(2)
    remote.publish(0, torch.tensor([table[0], -1], dtype=torch.long))
    remote.advance(host, lambda: None, lambda: True)  # the replay is over, layer 1 never came
    assert starts == [("peer", [0])] and remote.early_layers == 0  # (started after the replay)
    with pytest.raises(RuntimeError, match="layer 1"):
        remote.advance(host, lambda: None, None)


def test_a_later_layer_never_evicts_a_block_an_earlier_layer_of_the_step_wants():
    """Three rows: layer 0 makes two blocks resident; layer 1 wants two others. Without the
    step's ``keep`` the LRU would take layer 0's rows; with it layer 1 gets the free row and its
    other block fails (too many blocks at once), as one call for both layers would have."""
    host, table, starts = _located_cache(rows=3, blocks=4)
    remote = RemoteFetch(2, 4, torch.device("cpu"))
    remote.arm(2)
    remote.publish(0, torch.tensor(table[:2], dtype=torch.long))
    remote.advance(host, lambda: None, _publishes_after_the_first_start(
        remote, starts, torch.tensor(table[2:], dtype=torch.long)))
    assert starts == [("peer", [0]), ("peer", [1])]  # (two calls: layer 1's came later)
    assert host.wait_reads(remote.want, stall_s=None) == {}
    assert host.resident(table[0]) and host.resident(table[1])
    assert sum(host.resident(b) for b in table[2:]) == 1
    failed = host.take_failed()
    assert len(failed) == 1 and set(failed) < set(table[2:])
    assert "rows" in next(iter(failed.values()))
    host.check_invariants()
