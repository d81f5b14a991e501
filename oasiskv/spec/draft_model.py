"""``model:PATH`` drafter: a small LM with the target's tokenizer guesses the next token greedily.

It runs its own dense engine (own weights, own paged KV cache) over mirrors of the target's
sequences. Each call feeds every mirror the target's newest token in place of the guess the mirror
made last time (teacher forcing), runs the draft model until every mirror has scored its newest
token (a mirror that has its guess sits out the rest of the call), and returns the argmaxes. Mirrors
of sequences not in the call are dropped; a mirror that fell out of step with its sequence
(preemption, recomputation) is rebuilt from the sequence's tokens.
"""
from __future__ import annotations

import torch

from oasiskv.config import EngineConfig
from oasiskv.engine.sequence import Sequence
from oasiskv.sampling_params import SamplingParams
from oasiskv.spec.base import Drafter

DRAFT_KV_BLOCKS = 8192
_MIRROR = SamplingParams(max_tokens=1 << 30, temperature=0.0, ignore_eos=True)


class ModelDrafter(Drafter):
    def __init__(self, path: str, device: torch.device | None = None, num_kv_blocks: int = DRAFT_KV_BLOCKS):
        from oasiskv.engine.llm_engine import LLMEngine
        self.engine = LLMEngine(EngineConfig(model=path, device=str(device or "auto"), num_kv_blocks=num_kv_blocks,
                                             enforce_eager=True, max_model_len=num_kv_blocks * 16))
        self.mirrors: dict[int, Sequence] = {}

    def _sync(self, seq: Sequence) -> Sequence:
        """The mirror of ``seq``, holding its tokens with the newest one not yet computed."""
        m = self.mirrors.get(seq.seq_id)
        in_step = m is not None and len(m) == len(seq) and m.num_computed_tokens == len(seq) - 1 \
            and m.token_ids[-2:-1] == seq.token_ids[-2:-1]
        if in_step:
            m.token_ids[-1] = m.output_token_ids[-1] = seq.token_ids[-1]
            return m
        if m is not None:
            self._drop(seq.seq_id)
        rid = self.engine.add_request(list(seq.token_ids), _MIRROR, request_id=f"mirror-{seq.seq_id}")
        m = self.engine.requests[rid].seq
        self.mirrors[seq.seq_id] = m
        return m

    def propose(self, seqs):
        wanted = {s.seq_id for s in seqs}
        for seq_id in [i for i in self.mirrors if i not in wanted]:  # preempted or paused: rebuilt on return
            self._drop(seq_id)
        want = {id(self._sync(s)): i for i, s in enumerate(seqs)}
        guesses: list[int | None] = [None] * len(seqs)
        sched, runner = self.engine.scheduler, self.engine.runner
        parked = []  # mirrors that have their guess sit out the remaining steps of this call
        while any(g is None for g in guesses):
            batch = sched.schedule()
            if batch is None:
                break
            done, logits = runner.next_token_logits(batch, runner.forward(batch))
            sched.postprocess(batch)
            for row, m in enumerate(done):
                token = int(logits[row].argmax())
                m.append_token(token)  # placeholder: replaced by the target's token on the next call
                guesses[want[id(m)]] = token
                sched.running.remove(m)
                parked.append(m)
        sched.running.extend(parked)
        return guesses

    def release(self, seq: Sequence) -> None:
        self._drop(seq.seq_id)

    def _drop(self, seq_id: int) -> None:
        m = self.mirrors.pop(seq_id, None)
        if m is not None:
            self.engine.abort(m.request_id)
