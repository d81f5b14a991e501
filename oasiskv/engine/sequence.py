"""Sequence: one request's tokens, progress and KV block table, as the scheduler sees it."""
from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

from oasiskv.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class TokenLogprobs:
    """Logprob of the chosen token plus the top-N alternatives ``[(token_id, logprob), ...]``."""
    token_id: int
    logprob: float
    top: list[tuple[int, float]]


_ids = itertools.count()


@dataclass(eq=False)
class Sequence:
    """A request in flight.

    ``num_computed_tokens`` tokens already have K/V in the cache; the rest of ``token_ids`` must
    still be run through the model (the whole prompt at first; after preemption everything again).
    The block table maps the sequence's blocks, in order, to KV pool blocks.
    """
    prompt_token_ids: list[int]
    params: SamplingParams
    request_id: str = ""
    seq_id: int = field(default_factory=lambda: next(_ids))
    status: SequenceStatus = SequenceStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    output_logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)  # for prompt tokens 1..P-1
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    num_preemptions: int = 0
    # torch.Generator of a seeded request, made by the model runner
    sampler_generator: object = None
    #: the ``engine/handoff.py`` Handoff this sequence is admitted from (until its admission step)
    handoff: object = None
    #: keep a Handoff of this prompt when its prefill ends (``LLMEngine.take_handoff``)
    hand_off: bool = False

    def __post_init__(self):
        # all tokens, grows
        self.token_ids: list[int] = self.prompt_token_ids + self.output_token_ids

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def in_prefill(self) -> bool:
        """True while more than the last token still needs a forward pass (asked of every
        running sequence twice a step: kept to one subtraction)."""
        left = len(self.token_ids) - self.num_computed_tokens
        return left > 1 or left > 0 and not self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.token_ids.append(token_id)
