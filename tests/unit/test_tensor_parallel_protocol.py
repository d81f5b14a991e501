"""The tensor-parallel step protocol (``engine/tensor_parallel.py``) as pure logic: a real scheduler
and tiered allocator on "rank 0" under random add / step / abort / finish / replace-token
operations, its messages applied to a worker's mirror. Every step the worker's batch has rank 0's
sequences in rank 0's state (tokens, computed counts, block tables, working-set slots, prompt
logprob counts, which sample and which end their prefill), and finished sequences leave it."""
import random

from hypothesis import given, settings, strategies as st

from oasiskv.attention.sparse import SparseBackend
from oasiskv.engine.scheduler import Scheduler
from oasiskv.engine.sequence import Sequence
from oasiskv.engine.tensor_parallel import TensorParallelDriver, _Mirror
from oasiskv.kv.allocator import TieredAllocator
from tests.helpers import random_request

OPS = st.lists(st.tuples(st.sampled_from(["add", "step", "step", "step", "step", "abort",
                                          "finish", "replace"]),
                         st.integers(0, 10_000)), min_size=1, max_size=150)


class _Recorder(TensorParallelDriver):
    """The driver's message building without processes: sent messages go to ``inbox``."""

    def __init__(self):
        self.pipes, self.procs, self._sent, self._broken, self.inbox = [], [], {}, None, []
        self._aborted = []

    def _send(self, kind, message):
        self.inbox.append((kind, message))


class _Backend(SparseBackend):
    """The tiered backend's tensor-parallel methods (``SparseBackend``'s own) over an allocator,
    without storage (its constructor is not run): ``released`` collects the sequences it
    dropped."""

    def __init__(self, allocator: TieredAllocator, released: list):
        self.allocator, self._release = allocator, released.append


def _same(worker: Sequence, seq: Sequence, slot_of: dict, mirror_slots: dict) -> None:
    assert worker.token_ids == seq.token_ids
    assert worker.output_token_ids == seq.output_token_ids
    assert worker.num_computed_tokens == seq.num_computed_tokens
    assert worker.block_table == seq.block_table
    assert len(worker.prompt_logprobs) == len(seq.prompt_logprobs)
    assert mirror_slots.get(seq.seq_id) == slot_of.get(seq.seq_id)


@settings(max_examples=120, deadline=None)
@given(ops=OPS, num_blocks=st.integers(8, 40), block_size=st.sampled_from([1, 2, 4, 16]),
       budget=st.integers(1, 64), share=st.booleans())
def test_worker_mirror_follows_rank_0(ops, num_blocks, block_size, budget, share):
    alloc = TieredAllocator(num_blocks, 4, block_size, enable_prefix_sharing=share)
    sched = Scheduler(alloc, max_num_seqs=6, max_num_batched_tokens=budget)
    driver = _Recorder()
    rank0 = _Backend(alloc, [])
    worker_alloc = TieredAllocator(num_blocks, 4, block_size)
    released = []
    mirror = _Mirror(_Backend(worker_alloc, released))
    seqs: list[Sequence] = []
    for op, arg in ops:
        rng = random.Random(arg)
        if op == "add":
            seq = random_request(rng, num_blocks * block_size, rng.randrange(1, 6))
            sched.add(seq)
            seqs.append(seq)
        elif op == "step":
            batch = sched.schedule()
            if batch is None:
                continue
            driver.step(batch, None, rank0.sequence_state)
            kind, message = driver.inbox.pop()
            mirror.release(message)
            mirror.update(message)
            mine = mirror.batch(message)
            assert [s.seq_id for s in mine.seqs] == [s.seq_id for s in batch.seqs]
            assert mine.samples == batch.samples and mine.ends_prefill == batch.ends_prefill
            for w, s in zip(mine.seqs, batch.seqs):
                _same(w, s, alloc.slot_of, worker_alloc.slot_of)
            # the step runs: computed, sampled, maybe prompt logprobs; then rank 0 finishes it
            sched.postprocess(batch)
            for seq, samples in zip(batch.seqs, batch.samples):
                seq.prompt_logprobs += [None] * rng.randrange(2)
                if samples:
                    seq.append_token(rng.randrange(4))
            driver.finish(batch)
            kind, message = driver.inbox.pop()
            assert kind == "finish"
            mirror.sampled(message)
            for w, s in zip(mine.seqs, batch.seqs):
                _same(w, s, alloc.slot_of, worker_alloc.slot_of)
            for seq in batch.seqs:
                if len(seq.output_token_ids) >= seq.params.max_tokens and not seq.is_finished:
                    sched.finish(seq, "length")
        elif op == "replace":  # a speculative mirror's correction of the newest token
            waiting = [s for s in sched.running if s.output_token_ids
                       and s.num_computed_tokens < len(s)]
            if waiting:
                seq = rng.choice(waiting)
                seq.token_ids[-1] = seq.output_token_ids[-1] = 100 + rng.randrange(4)
        elif seqs:
            seq = rng.choice(seqs)
            if not seq.is_finished and (seq in sched.running or seq in sched.waiting):
                if op == "abort":  # as LLMEngine.abort
                    sched.abort(seq)
                    driver.forget(seq)
                elif seq in sched.running:
                    sched.finish(seq, "stop")
    # whatever finished is forgotten by the worker at the next step
    for seq in list(sched.running) + list(sched.waiting):
        sched.abort(seq)
        driver.forget(seq)
    driver.step(type("Empty", (), {"seqs": [], "num_tokens": [], "is_prefill": False})(), None,
                rank0.sequence_state)
    mirror.release(driver.inbox.pop()[1])
    assert mirror.seqs == {} and worker_alloc.slot_of == {}
    assert {s.seq_id for s in released} <= {s.seq_id for s in seqs}
