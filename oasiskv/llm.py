"""LLM: the offline facade. ``LLM(model, **config).generate(prompts, params)`` and
``.chat(messages)``."""
from __future__ import annotations

from typing import Iterator, Sequence as Seq

from tqdm import tqdm

from oasiskv.attention import make_backend
from oasiskv.config import EngineConfig
from oasiskv.engine.llm_engine import LLMEngine, RequestOutput
from oasiskv.sampling_params import SamplingParams


class LLM:
    """Runs an ``LLMEngine`` to completion for a list of prompts (strings or token-id lists)."""

    def __init__(self, model: str = "", config: EngineConfig | None = None, backend_factory=None,
                 **settings):
        """``settings``: flat ``EngineConfig`` / ``TierConfig`` fields (or a whole ``config``);
        ``backend_factory``: see ``LLMEngine``."""
        config = config or EngineConfig.from_flat(model=model, **settings)
        self.engine = LLMEngine(config, backend_factory=backend_factory or make_backend)
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts: str | list[int] | Seq[str | list[int]],
                 params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in prompt order."""
        single = isinstance(prompts, str) or (isinstance(prompts, list) and prompts
                                              and isinstance(prompts[0], int))
        prompts = [prompts] if single else list(prompts)
        params = (params if isinstance(params, (list, tuple))
                  else [params or SamplingParams()] * len(prompts))
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        ids = [self.engine.add_request(p, sp) for p, sp in zip(prompts, params)]
        done: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), disable=not use_tqdm, desc="generate") as bar:
            while len(done) < len(ids):
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        bar.update(1)
        return [done[i] for i in ids]

    def close(self) -> None:
        """Stop the engine's tensor-parallel worker processes, if any."""
        self.engine.close()

    def stream(self, prompt: str | list[int],
               params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yield incremental outputs of one request as they are produced."""
        rid = self.engine.add_request(prompt, params)
        while True:
            for out in self.engine.step():
                if out.request_id == rid:
                    yield out
                    if out.finished:
                        return

    def chat(self, messages: list[dict], params: SamplingParams | None = None) -> RequestOutput:
        """One chat turn: messages are rendered with the tokenizer's chat template (or a plain
        fallback)."""
        return self.generate(render_chat(self.tokenizer, messages), params)[0]


def render_chat(tokenizer, messages: list[dict]) -> str:
    """Chat messages -> prompt text, by the tokenizer's template when it has one.

    Fallback for models without a template: ``"role: content"`` lines and a final ``"assistant:"``.
    Raises ValueError on empty lists, unknown roles or non-string content.
    """
    if not messages:
        raise ValueError("messages must be a non-empty list")
    for m in messages:
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "tool",
                                                             "developer"):
            raise ValueError(f"invalid message {m!r}: role must be one of system, user, "
                             f"assistant, tool, developer")
        if not isinstance(m.get("content"), str):
            raise ValueError("message content must be a string")
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        try:
            return tokenizer.apply_chat_template(messages, tokenize=False,
                                                 add_generation_prompt=True)
        except Exception as exc:  # the template itself may reject a conversation (e.g. role order)
            raise ValueError(f"the model's chat template rejected these messages: {exc}") from None
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
