"""Block manager and scheduler invariants under random add / step / abort / finish sequences:
no leaked block, no block owned twice, ref counts equal table membership, budgets respected; the
same for the tiered allocator (host blocks with prefix sharing, plus fewer working-set slots than
the scheduler's batch)."""
import random
import time

from hypothesis import given, settings, strategies as st

from oasiskv.engine.block_manager import BlockManager
from oasiskv.engine.handoff import Handoff
from oasiskv.engine.scheduler import Scheduler
from oasiskv.engine.sequence import Sequence
from oasiskv.kv.allocator import TieredAllocator
from oasiskv.sampling_params import SamplingParams
from tests.helpers import random_request

OPS = st.lists(st.tuples(st.sampled_from(["add", "step", "step", "step", "abort", "finish"]),
                         st.integers(0, 10_000)), min_size=1, max_size=120)


def live(sched: Scheduler) -> list[Sequence]:
    return list(sched.running) + [s for s in sched.waiting if s.block_table]


def step(sched: Scheduler, rng: random.Random, check=lambda batch: None) -> bool:
    """One scheduled step as the engine runs it (``check`` sees the batch first): computed tokens
    recorded, a random token sampled where the prompt is done, finished at ``max_tokens``. False
    when nothing was scheduled."""
    batch = sched.schedule()
    if batch is None:
        return False
    check(batch)
    sched.postprocess(batch)
    for seq in batch.seqs:
        if seq.num_computed_tokens == len(seq):
            seq.append_token(rng.randrange(4))
            if len(seq.output_token_ids) >= seq.params.max_tokens:
                sched.finish(seq, "length")
    return True


@settings(max_examples=150, deadline=None)
@given(ops=OPS, num_blocks=st.integers(8, 40), block_size=st.sampled_from([1, 2, 4, 16]),
       budget=st.integers(1, 64), share=st.booleans(), tiered=st.booleans())
def test_random_operations_keep_invariants(ops, num_blocks, block_size, budget, share, tiered):
    bm = (TieredAllocator(num_blocks, 4, block_size, enable_prefix_sharing=share) if tiered
          else BlockManager(num_blocks, block_size, enable_prefix_sharing=share))
    sched = Scheduler(bm, max_num_seqs=6, max_num_batched_tokens=budget)
    all_seqs: list[Sequence] = []
    for op, arg in ops:
        rng = random.Random(arg)
        if op == "add":
            seq = random_request(rng, num_blocks * block_size, 4)
            sched.add(seq)
            all_seqs.append(seq)
        elif op == "step":
            def check(batch):
                assert len(batch) <= 6
                if batch.is_prefill:
                    assert sum(batch.num_tokens) <= budget
                for seq, n in zip(batch.seqs, batch.num_tokens):
                    assert seq.num_computed_tokens + n <= len(seq.block_table) * block_size
            step(sched, rng, check)
        elif all_seqs:
            seq = rng.choice(all_seqs)
            if not seq.is_finished and (seq in sched.running or seq in sched.waiting):
                if op == "abort":
                    sched.abort(seq)
                elif seq in sched.running:
                    sched.finish(seq, "stop")
                all_seqs.remove(seq)
        bm.check_invariants(live(sched))
    for seq in list(sched.running) + list(sched.waiting):
        sched.abort(seq)
    bm.check_invariants([])
    assert bm.num_free_blocks == num_blocks


def test_everything_finishes_when_driven_to_completion():
    bm = BlockManager(10, 4)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=8)
    seqs = [Sequence(list(range(i + 3)), SamplingParams(max_tokens=6)) for i in range(7)]
    for s in seqs:
        sched.add(s)
    rng = random.Random(0)
    for _ in range(500):
        if not step(sched, rng):
            break
    assert all(s.is_finished for s in seqs)
    assert bm.num_free_blocks == 10


HOLD_OPS = st.lists(st.tuples(st.sampled_from(["add", "step", "step", "step", "finish", "export",
                                               "import", "release", "handoff", "expire"]),
                              st.integers(0, 10_000)), min_size=1, max_size=120)


@settings(max_examples=150, deadline=None)
@given(ops=HOLD_OPS, num_blocks=st.integers(8, 40), block_size=st.sampled_from([1, 2, 4]))
def test_holds_of_moving_prompt_kv_keep_invariants(ops, num_blocks, block_size):
    """Blocks held outside any table (exported for a reader, or imported: cached ones plus fresh
    ones named after their bytes arrive; handoffs, adopted by their request's table or expired)
    interleaved with scheduling: never handed out while held, ref counts equal tables plus holds,
    nothing left held or owned at the end."""
    bm = TieredAllocator(num_blocks, 4, block_size)
    sched = Scheduler(bm, max_num_seqs=6, max_num_batched_tokens=32)
    seqs: list[Sequence] = []
    prompts: list[list[int]] = []
    holds: list[list[int]] = []
    for op, arg in ops:
        rng = random.Random(arg)
        if op == "add":
            seq = random_request(rng, num_blocks * block_size, 4)
            sched.add(seq)
            seqs.append(seq)
            prompts.append(list(seq.token_ids))
        elif op == "step":
            step(sched, rng)
        elif op == "finish" and seqs:
            seq = rng.choice(seqs)
            if seq in sched.running:
                sched.finish(seq, "stop")
        elif op == "export" and prompts:
            holds.append(bm.hold_cached(bm.prompt_hashes(rng.choice(prompts))))
        elif op == "import":
            tokens = (rng.choice(prompts) if prompts and rng.random() < 0.5
                      else [rng.randrange(4) for _ in range(rng.randrange(1, 4 * block_size))])
            hashes = bm.prompt_hashes(tokens)
            cached = bm.hold_cached(hashes)
            try:
                fresh = bm.hold_new(len(hashes) - len(cached))
            except RuntimeError:
                bm.release(cached)
                continue
            for block, h in zip(fresh, hashes[len(cached):]):
                bm.register(block, h)
            holds.append(cached + fresh)
        elif op == "release" and holds:
            bm.release(holds.pop(rng.randrange(len(holds))))
        elif op == "handoff":  # a prompt prefilled elsewhere: held blocks for all of it
            seq = random_request(rng, num_blocks * block_size, 4)
            hashes = bm.prompt_hashes(seq.prompt_token_ids)
            cached = bm.hold_cached(hashes)
            try:
                fresh = bm.hold_new(-(-len(seq) // block_size) - len(cached))
            except RuntimeError:
                bm.release(cached)
                continue
            sched.handoffs.add(tuple(seq.prompt_token_ids), Handoff(None, None, cached + fresh))
            if rng.random() < 0.8:  # (else nobody takes it: it expires)
                sched.add(seq)
                seqs.append(seq)
        elif op == "expire":
            sched.handoffs.expire(now=time.monotonic() + sched.handoffs.grace_s + 1)
        for held in holds:
            assert all(bm.ref_counts[b] > 0 and b not in bm.free_blocks for b in held)
        bm.check_invariants(live(sched))
    for held in holds:
        bm.release(held)
    for seq in list(sched.running) + list(sched.waiting):
        sched.abort(seq)
    sched.handoffs.clear()
    bm.check_invariants([])
    assert bm.num_free_blocks == num_blocks and not bm.held


def test_freed_blocks_join_the_free_list_last_block_first_and_shared_ones_stay():
    """``free`` gives back a sequence's blocks in one pass with ``_drop``'s order: the blocks no one
    references any more go to the end of the free list, the sequence's last block first (the prefix
    cache hands out the oldest freed first, so a prompt's first blocks live longest)."""
    bm = BlockManager(num_blocks=8, block_size=2)
    first = Sequence(list(range(1, 7)), SamplingParams(max_tokens=1))
    bm.allocate(first, 6)
    first.num_computed_tokens = 6
    bm.on_computed(first)
    second = Sequence(list(range(1, 8)), SamplingParams(max_tokens=1))
    assert bm.reuse_prefix(second) == 6 and second.block_table == [0, 1, 2]
    bm.allocate(second, 1)
    assert second.block_table == [0, 1, 2, 3]
    bm.free(first)  # every block still in use by the second
    assert list(bm.free_blocks) == [4, 5, 6, 7]
    bm.free(second)
    assert list(bm.free_blocks) == [4, 5, 6, 7, 3, 2, 1, 0]
    bm.check_invariants([])


def test_a_handoff_is_admitted_in_order_and_goes_with_its_waiting_request():
    """A prompt prefilled elsewhere: its request is admitted in a step of its own once it is first
    in line (a prefill ahead of it goes first), adopting the handoff's blocks; expiry spares a
    handoff whose request waits; aborting the waiting request lets its handoff go."""
    bm = TieredAllocator(32, 3, 4)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    prompt = list(range(1, 11))
    ahead, handed = (Sequence(list(p), SamplingParams(max_tokens=2)) for p in ([9] * 6, prompt))
    blocks = bm.hold_new(3)
    sched.handoffs.add(tuple(prompt), Handoff(None, None, blocks))
    sched.add(ahead)
    sched.add(handed)
    later = time.monotonic() + sched.handoffs.grace_s + 1
    assert sched.handoffs.expire(now=later, keep={tuple(prompt)}) == 0
    first = sched.schedule()
    assert not first.handoff and first.seqs == [ahead]
    sched.postprocess(first)
    second = sched.schedule()
    assert second.handoff and second.seqs == [handed] and second.samples == [True]
    assert handed.block_table == blocks and handed.num_computed_tokens == len(prompt) - 1
    assert not bm.held and not sched.handoffs
    bm.check_invariants([ahead, handed])
    again = Sequence(list(prompt), SamplingParams(max_tokens=2))
    sched.handoffs.add(tuple(prompt), Handoff(None, None, bm.hold_new(3)))
    sched.add(again)
    sched.abort(again)
    assert not sched.handoffs and not bm.held
    bm.check_invariants([ahead, handed])
