"""``model:PATH`` drafter: a small LM with the target's tokenizer guesses the next token greedily.

It runs its own dense engine (own weights, own paged KV cache, built in ``reserve`` with a pool of
``max_len`` tokens per sequence, so the tier counts it in its HBM budget) over mirrors of the
target's sequences, through that engine's public calls only. Each call corrects every mirror's last
guess with the target's newest token (``replace_last_token``) and runs one decode step: every
mirror computes that token and its argmax is the next guess. Sequences new to the drafter get a
mirror (their tokens as the prompt) after that step, prefilled in steps of their own; a mirror that
fell out of step with its sequence (preemption, recomputation) is rebuilt. Mirrors of sequences not
in the call are dropped.
"""
from __future__ import annotations

import torch

from oasiskv.config import EngineConfig, ModelConfig
from oasiskv.engine.sequence import Sequence
from oasiskv.models.loader import resolve_model_path
from oasiskv.sampling_params import SamplingParams
from oasiskv.spec.base import Drafter

_MIRROR = SamplingParams(max_tokens=1 << 30, temperature=0.0, ignore_eos=True)


class ModelDrafter(Drafter):
    def __init__(self, path: str, device: torch.device | None = None):
        self.path, self.device = path, str(device or "auto")
        self.model_config = ModelConfig.from_file(resolve_model_path(path) / "config.json")
        self.engine = None  # built by ``reserve``
        #: seq id -> (the mirror's request id, the sequence's length and newest token when the
        #: mirror last guessed: the mirror is in step while the sequence grew by exactly the guessed
        #: token)
        self.mirrors: dict[int, tuple[str, int, int]] = {}

    def _dtype(self) -> torch.dtype:
        cuda = self.device != "cpu" and torch.cuda.is_available()
        return self.model_config.dtype if cuda else torch.float32

    def bytes_per_seq(self, max_len: int) -> int:
        return -(-max_len // 16) * 16 * self.model_config.kv_bytes_per_token(self._dtype())

    def fixed_bytes(self) -> int:
        from safetensors import safe_open
        numel = 0
        for file in resolve_model_path(self.path).glob("*.safetensors"):
            with safe_open(str(file), "pt") as f:
                for name in f.keys():
                    shape = f.get_slice(name).get_shape()
                    numel += int(torch.Size(shape).numel())
        return numel * self._dtype().itemsize

    def reserve(self, num_seqs: int, max_len: int) -> None:
        from oasiskv.engine.llm_engine import LLMEngine
        blocks = num_seqs * -(-max_len // 16)
        self.engine = LLMEngine(EngineConfig(model=self.path, device=self.device,
                                             num_kv_blocks=blocks, enforce_eager=True,
                                             async_scheduling=False,  # (replace_last_token)
                                             max_model_len=max_len + 1,
                                             max_num_seqs=max(1, num_seqs)))

    def propose(self, seqs):
        if self.engine is None:
            self.reserve(max(1, len(seqs)), max(len(s) for s in seqs) + 1024)
        wanted = {s.seq_id for s in seqs}
        for seq_id in [i for i in self.mirrors if i not in wanted]:  # preempted or paused
            self._drop(seq_id)
        in_step, new = {}, []
        for i, seq in enumerate(seqs):
            if self._correct(seq):
                in_step[self.mirrors[seq.seq_id][0]] = i
            else:
                new.append(i)
        guesses: list[int | None] = [None] * len(seqs)
        if in_step:  # one decode step: each mirror computes the target's newest token
            for out in self.engine.step():
                if out.request_id in in_step:
                    guesses[in_step[out.request_id]] = out.new_token_ids[-1]
        waiting = {}
        for i in new:  # mirrors prefilled now take their guess from their last prefill step
            rid = self.engine.add_request(list(seqs[i].token_ids), _MIRROR,
                                          request_id=f"mirror-{seqs[i].seq_id}")
            waiting[rid] = i
        while waiting:
            outs = self.engine.step()
            if not outs:
                break
            for out in outs:
                i = waiting.pop(out.request_id, None)
                if i is not None:
                    guesses[i] = out.new_token_ids[-1]
        for seq, guess in zip(seqs, guesses):
            rid = f"mirror-{seq.seq_id}"
            if guess is not None:
                self.mirrors[seq.seq_id] = (rid, len(seq), seq.token_ids[-1])
            else:
                self.mirrors.pop(seq.seq_id, None)
                self.engine.abort(rid)
        return guesses

    def _correct(self, seq: Sequence) -> bool:
        """Give ``seq``'s mirror the target's newest token in place of its last guess; False when
        there is no mirror in step (dropped: the caller builds a new one)."""
        if seq.seq_id not in self.mirrors:
            return False
        rid, length, newest = self.mirrors[seq.seq_id]
        if len(seq) == length + 1 and seq.token_ids[length - 1] == newest:
            try:
                if self.engine.replace_last_token(rid, seq.token_ids[-1]) is None:
                    return True
            except ValueError:  # the mirror ended (its context limit)
                pass
        self._drop(seq.seq_id)
        return False

    def release(self, seq: Sequence) -> None:
        self._drop(seq.seq_id)

    def _drop(self, seq_id: int) -> None:
        mirror = self.mirrors.pop(seq_id, None)
        if mirror is not None:
            self.engine.abort(mirror[0])
