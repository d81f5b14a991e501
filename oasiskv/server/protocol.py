"""Pydantic models of the OpenAI API subset the server speaks: request bodies and response objects.

Request models check JSON types only (strictly: ``"1"`` is not a number, NaN and Infinity are not
numbers either); value ranges and limits that
depend on the model are checked by the handlers (HTTP 400). Unknown request fields are ignored, but
known OpenAI fields this server cannot honour are reported by ``unsupported()`` so they are refused
rather than silently dropped. Extensions beyond OpenAI (vLLM spelling): ``top_k``, ``min_p``,
``ignore_eos``, ``stop_token_ids``.
"""
from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_core import PydanticCustomError


def _has_lone_surrogate(value) -> bool:
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return True
        return False
    if isinstance(value, (list, tuple)):
        return any(_has_lone_surrogate(v) for v in value)
    if isinstance(value, dict):
        return any(_has_lone_surrogate(k) or _has_lone_surrogate(v) for k, v in value.items())
    return False


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)

    @field_validator("*", mode="after")
    @classmethod
    def _unicode_text(cls, value):
        """Text fields must be Unicode text: JSON may carry lone UTF-16 surrogates (``"\\ud800"``),
        which no tokenizer or response can encode (HTTP 400, code ``lone_surrogate``)."""
        if _has_lone_surrogate(value):
            raise PydanticCustomError("lone_surrogate",
                                      "contains a lone UTF-16 surrogate, which is not Unicode text")
        return value


class StreamOptions(_Request):
    include_usage: bool = False


class SamplingRequest(_Request):
    """Fields shared by completions and chat completions."""
    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None

    def unsupported(self) -> list[str]:
        """Names of fields set to something this server cannot do."""
        names = [f for f in ("presence_penalty", "frequency_penalty") if getattr(self, f)]
        return names + (["logit_bias"] if self.logit_bias else [])


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = None
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def unsupported(self) -> list[str]:
        return (super().unsupported() + (["suffix"] if self.suffix else [])
                + (["best_of"] if self.best_of not in (None, 1, self.n or 1) else []))


class TextPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None

    def as_dict(self) -> dict:
        """``{"role", "content"}`` with text parts joined, as ``render_chat`` takes it."""
        content = (self.content if not isinstance(self.content, list)
                   else "".join(p.text for p in self.content))
        return {"role": self.role, "content": content}


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict] | None = None
    response_format: dict | None = None

    def unsupported(self) -> list[str]:
        rf = self.response_format
        return (super().unsupported() + (["tools"] if self.tools else [])
                + (["response_format"] if rf and rf.get("type") != "text" else []))


class KVPromptRequest(_Request):
    """Disaggregated serving: a prompt's token ids, to a prefill worker (prefill them and hold
    their KV) or a memory worker (hold the KV of the prompt's prefix it has). ``summaries_from``
    (to a prefill worker): hand the prompt off (partial admission) with the summaries of its
    complete blocks from this one on (the asker holds those before)."""
    prompt_token_ids: list[int] = Field(min_length=1)
    summaries_from: int | None = Field(default=None, ge=0)


class KVReleaseRequest(_Request):
    """Disaggregated serving, to a prefill or memory worker: let go of a lease's blocks (or,
    to ``/v1/kv/renew``, hold them longer)."""
    lease: str = Field(max_length=64)


class KVOffloadRequest(_Request):
    """Disaggregated serving, a prefill worker to a memory worker: read ``blocks`` (the complete
    blocks of ``prompt_token_ids``, in chain order) from the store ``descriptor`` describes
    (base64 of ``RemoteStore.descriptor()``) and hold them under a lease."""
    descriptor: str = Field(max_length=1 << 20)
    blocks: list[int] = Field(min_length=1)
    prompt_token_ids: list[int] = Field(min_length=2)


# ---- responses ---------------------------------------------------------------------------------
class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    """Legacy completions shape; ``top_logprobs`` maps token text to logprob and includes the chosen
    token. With ``echo`` the first prompt token has ``None`` entries (nothing predicts it)."""
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None


def _now() -> int:
    return int(time.time())


class CompletionResponse(BaseModel):
    """A whole completion, or one streamed chunk of it (then ``usage`` is set only on the last
    chunk)."""
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length"]


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: Usage


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: Delta
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "oasiskv"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
