"""SamplingParams: what a request asks of the sampler and of the stopping rules.

``validate()`` raises ``ValueError`` naming the bad field and the allowed range; the engine calls it
on every request before the request touches any engine state.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """Per-request sampling settings (vLLM / OpenAI semantics).

    temperature 0 means greedy. ``top_k`` <= 0 and ``top_p`` = 1 and ``min_p`` = 0 disable those
    filters. ``stop`` strings end generation when they appear in the output text (they are not
    included in it); ``stop_token_ids`` end it on those tokens (the token is kept). ``logprobs`` = N
    returns the sampled token's logprob plus the top-N alternatives per generated token;
    ``prompt_logprobs`` = N does the same for prompt tokens (the first prompt token has none).
    """
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    MAX_LOGPROBS = 20

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])

    #: temperatures below this sample greedily (dividing logits by a smaller, e.g. subnormal,
    #: temperature overflows to inf and every probability to NaN)
    GREEDY_BELOW = 1e-5

    @property
    def greedy(self) -> bool:
        return self.temperature < self.GREEDY_BELOW

    def validate(self, vocab_size: int | None = None) -> "SamplingParams":
        def bad(name, value, want):
            raise ValueError(f"{name} must be {want}, got {value!r}")

        if not _integer(self.max_tokens) or self.max_tokens < 1:
            bad("max_tokens", self.max_tokens, "an integer >= 1")
        if not _number(self.temperature) or not 0 <= self.temperature < math.inf:
            bad("temperature", self.temperature, "a finite number >= 0")
        if not _number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            bad("top_p", self.top_p, "in (0, 1]")
        if not _integer(self.top_k) or not -1 <= self.top_k < 2**31:
            bad("top_k", self.top_k, "an integer below 2**31; 0 or -1 disables it")
        if not _number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            bad("min_p", self.min_p, "in [0, 1]")
        if self.seed is not None and (not _integer(self.seed) or not 0 <= self.seed < 2**63):
            bad("seed", self.seed, "an integer in [0, 2**63) or None")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _integer(value) or not 0 <= value <= self.MAX_LOGPROBS):
                bad(name, value, f"an integer in [0, {self.MAX_LOGPROBS}] or None")
        if not all(isinstance(s, str) and s for s in self.stop):
            bad("stop", self.stop, "a list of non-empty strings")
        for tok in self.stop_token_ids:
            if not _integer(tok) or tok < 0 or (vocab_size is not None and tok >= vocab_size):
                bad("stop_token_ids", self.stop_token_ids, f"token ids in [0, {vocab_size})")
        return self


def _integer(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value) -> bool:
    """A real number (NaN fails every range check that follows, so it is rejected too)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)
