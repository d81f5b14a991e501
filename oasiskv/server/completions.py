"""The /v1/completions and /v1/chat/completions handlers: request -> engine requests -> response or
SSE.

Contracts: every user mistake is an ``APIError`` 4xx raised before anything reaches the engine or by
the engine bridge's own checks; a choice that fails inside the engine is a 500. ``n`` choices per
prompt are ``n`` engine requests (choice ``j`` of a seeded request uses ``seed + j``). A stream
sends one chunk per generated token (plus an echo chunk per choice for ``echo``, a role chunk per
choice for chat, and a usage chunk when asked), then ``data: [DONE]``; an error after the stream
started is an ``{"error": ...}`` event before ``[DONE]``. Whenever the client goes away, streaming
or not, the request's unfinished engine requests are aborted at once. Completions with
``max_tokens: 0`` run one token and drop it, so ``echo`` + ``logprobs`` score a prompt
(lm-evaluation-harness loglikelihood). Chat templates are rendered on the event loop (Jinja only);
prompts are tokenized and checked on one tokenizer thread of the server's, with its own copy of the
tokenizer, so a huge prompt never holds up the engine thread (and so the running streams).
"""
from __future__ import annotations

import asyncio
import copy
import dataclasses
import json
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import AsyncIterator, Awaitable, Callable

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from oasiskv.engine.llm_engine import RequestOutput
from oasiskv.llm import render_chat
from oasiskv.sampling_params import SamplingParams
from oasiskv.server.async_engine import AsyncEngine, RequestHandle
from oasiskv.server.errors import APIError
from oasiskv.server.logprobs import CompletionLogprobsBuilder, TokenTable, chat_logprobs
from oasiskv.server.protocol import (AssistantMessage, ChatChoice, ChatChunkChoice,
                                     ChatCompletionChunk, ChatCompletionRequest,
                                     ChatCompletionResponse, CompletionChoice, CompletionRequest,
                                     CompletionResponse, Delta, Usage, SamplingRequest)

# OpenAI's default for /v1/completions; chat defaults to the rest of the context
DEFAULT_COMPLETION_TOKENS = 16
# OpenAI's bound (the offline API takes any finite temperature)
MAX_TEMPERATURE = 2.0


class _EventStream(StreamingResponse):
    """SSE response that aborts its request however the response ends (done, error, disconnect)."""

    def __init__(self, events: AsyncIterator[BaseModel], handle: RequestHandle):
        super().__init__(_sse(events), media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache"})
        self.handle = handle

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.handle.abort()


async def _sse(events: AsyncIterator[BaseModel]) -> AsyncIterator[str]:
    try:
        async for event in events:
            yield f"data: {event.model_dump_json()}\n\n"
    except APIError as exc:
        yield f"data: {json.dumps(exc.body())}\n\n"
    yield "data: [DONE]\n\n"


async def _outputs(handle: RequestHandle) -> AsyncIterator[tuple[int, RequestOutput]]:
    async for index, out in handle.outputs():
        if out.finish_reason == "error":
            raise APIError(500, f"generation failed inside the engine: {out.error}")
        yield index, out


async def _disconnected(request: Request) -> None:
    """Return once the client has gone (the body is already read, so only a disconnect arrives)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _respond(build, request: Request, handle: RequestHandle) -> Response:
    """Await the response ``build`` makes unless the client disconnects first (then abort)."""
    task, gone = asyncio.ensure_future(build), asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            return Response(status_code=499)  # nobody is listening any more
        return Response(task.result().model_dump_json(), media_type="application/json")
    finally:
        task.cancel()
        gone.cancel()
        handle.abort()


def _prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt must not be empty", param="prompt")
    return list(prompt)


def _usage(handle: RequestHandle, completion_tokens: int) -> Usage:
    prompt_tokens = sum(len(ids) for ids in handle.prompt_token_ids)
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                 total_tokens=prompt_tokens + completion_tokens)


class OpenAIServing:
    def __init__(self, engine: AsyncEngine, tokens: TokenTable, tokenizer, model_name: str,
                 vocab_size: int):
        self.engine, self.tokens, self.tokenizer = engine, tokens, tokenizer
        self.model_name, self.vocab_size = model_name, vocab_size
        # the tokenizer thread's own copy (fast tokenizers must not be shared between threads)
        self._encoder = copy.deepcopy(tokenizer)
        self._tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="oasiskv-tokenize")
        #: disaggregated decode: brings in the prompts' KV before the engine takes them
        self.admit: Callable[[list[list[int]]], Awaitable[None]] | None = None

    def close(self) -> None:
        self._tokenizer_thread.shutdown(wait=False, cancel_futures=True)

    async def _prompt_ids(self, prompts: list[str | list[int]], max_tokens: int | None,
                          prefix_kv: bool = True) -> list[list[int]]:
        """Token ids of ``prompts``, checked for the engine (``AsyncEngine.check_prompts``), from
        the tokenizer thread; with ``admit`` (disaggregated decode) and ``prefix_kv`` (false when
        the request recomputes its prompt anyway, for prompt logprobs) their prefix KV is in the
        host store when this returns."""
        def encode() -> list[list[int]]:
            if self._encoder is None and any(isinstance(p, str) for p in prompts):
                raise APIError(400, "this model has no tokenizer: send prompts as token ids",
                               param="prompt")
            ids = [self._encoder.encode(p, add_special_tokens=True) if isinstance(p, str)
                   else p for p in prompts]
            self.engine.check_prompts(ids, max_tokens)
            return ids
        ids = await asyncio.get_running_loop().run_in_executor(self._tokenizer_thread, encode)
        if self.admit is not None and prefix_kv:
            await self.admit(ids)
        return ids

    # ---- shared checks -------------------------------------------------------------------------
    def _check(self, req: SamplingRequest) -> int:
        """Model name, unsupported fields and ``n``; returns ``n``."""
        if req.model is not None and req.model != self.model_name:
            raise APIError(404, f"the model `{req.model}` does not exist; "
                                f"this server serves `{self.model_name}`",
                           param="model", code="model_not_found")
        if bad := req.unsupported():
            raise APIError(400, f"not supported by this server: {', '.join(bad)}", param=bad[0])
        n = 1 if req.n is None else req.n
        if not 1 <= n <= self.engine.max_waiting:
            raise APIError(400, f"n must be in [1, {self.engine.max_waiting}] "
                                f"(the server's queue bound), got {n}",
                           param="n")
        return n

    def _params(self, req: SamplingRequest, n: int, logprobs: int | None,
                prompt_logprobs: int | None = None) -> list[SamplingParams]:
        """One SamplingParams per choice; ``max_tokens`` is set later by the engine bridge."""
        def given(value, default):
            return default if value is None else value

        # Bounds SamplingParams.validate lacks: the engine turns these into int64 tensors /
        # generator seeds mid-step, where an overflow fails the whole batch.
        if req.seed is not None and not 0 <= req.seed <= 2**63 - n:  # choice j samples seed + j
            raise APIError(400, f"seed must be in [0, 2**63 - n] (choice j uses seed + j), got "
                                f"{req.seed}", param="seed")
        if req.temperature is not None and req.temperature > MAX_TEMPERATURE:
            raise APIError(400, f"temperature must be in [0, {MAX_TEMPERATURE}], got "
                                f"{req.temperature}", param="temperature")
        top_k = given(req.top_k, 0)
        if top_k >= self.vocab_size:
            top_k = 0  # keeps every token, as 0 does
        params = SamplingParams(
            max_tokens=1, temperature=given(req.temperature, 1.0), top_p=given(req.top_p, 1.0),
            top_k=top_k, min_p=given(req.min_p, 0.0), seed=req.seed, stop=given(req.stop, []),
            stop_token_ids=given(req.stop_token_ids, []), ignore_eos=req.ignore_eos,
            logprobs=logprobs, prompt_logprobs=prompt_logprobs)
        try:
            params.validate(self.vocab_size)
        except ValueError as exc:
            field = str(exc).split(" ", 1)[0]
            raise APIError(400, str(exc),
                           param=field if field in type(req).model_fields else None) from None
        return [dataclasses.replace(params, seed=None if req.seed is None else req.seed + j)
                for j in range(n)]

    # ---- /v1/completions -----------------------------------------------------------------------
    async def completions(self, req: CompletionRequest, request: Request) -> Response:
        arrival = time.monotonic()
        n = self._check(req)
        prompts = _prompts(req.prompt)
        max_tokens = DEFAULT_COMPLETION_TOKENS if req.max_tokens is None else req.max_tokens
        if max_tokens < 0:
            raise APIError(400, f"max_tokens must be >= 0, got {max_tokens}", param="max_tokens")
        params = self._params(req, n, req.logprobs, req.logprobs if req.echo else None)
        ids = await self._prompt_ids(prompts, max_tokens, params[0].prompt_logprobs is None)
        handle = await self.engine.submit(ids, params, max_tokens, arrival)
        job = _CompletionJob(self, req, n, max_tokens, handle, prompts, f"cmpl-{uuid.uuid4().hex}")
        if req.stream:
            return _EventStream(job.chunks(), handle)
        return await _respond(job.response(), request, handle)

    # ---- /v1/chat/completions ------------------------------------------------------------------
    async def chat(self, req: ChatCompletionRequest, request: Request) -> Response:
        arrival = time.monotonic()
        n = self._check(req)
        try:
            prompt = render_chat(self.tokenizer, [m.as_dict() for m in req.messages])
        except ValueError as exc:
            raise APIError(400, str(exc), param="messages") from None
        except Exception as exc:
            # a chat template's own checks (e.g. role order) reject the conversation
            raise APIError(400, f"the chat template rejected the messages: {exc}",
                           param="messages") from None
        max_tokens = (req.max_tokens if req.max_completion_tokens is None
                      else req.max_completion_tokens)
        if max_tokens is not None and max_tokens < 1:
            raise APIError(400, f"max_tokens must be >= 1, got {max_tokens}", param="max_tokens")
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        if (req.top_logprobs is not None
                and not 0 <= req.top_logprobs <= SamplingParams.MAX_LOGPROBS):
            raise APIError(400, f"top_logprobs must be in [0, {SamplingParams.MAX_LOGPROBS}], got "
                                f"{req.top_logprobs}", param="top_logprobs")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = self._params(req, n, logprobs)
        handle = await self.engine.submit(await self._prompt_ids([prompt], max_tokens), params,
                                          max_tokens, arrival)
        job = _ChatJob(self, req, n, handle, f"chatcmpl-{uuid.uuid4().hex}")
        if req.stream:
            return _EventStream(job.chunks(), handle)
        return await _respond(job.response(), request, handle)


@dataclasses.dataclass
class _CompletionJob:
    """One accepted /v1/completions request, turned into a response or a chunk stream."""
    serving: OpenAIServing
    req: CompletionRequest
    n: int
    max_tokens: int
    handle: RequestHandle
    prompts: list[str | list[int]]
    id: str

    def __post_init__(self):
        self.created = int(time.time())
        tokens = self.serving.tokens
        self.echo_texts = [p if isinstance(p, str) else tokens.text(p) for p in self.prompts]

    def _chunk(self, choices: list[CompletionChoice],
               usage: Usage | None = None) -> CompletionResponse:
        return CompletionResponse(id=self.id, created=self.created, model=self.serving.model_name,
                                  choices=choices, usage=usage)

    def _generated(self, out: RequestOutput) -> tuple[list[int], str, list, str | None]:
        """(token ids, text, logprobs, finish reason) the client sees; ``max_tokens: 0`` drops the
        token."""
        if self.max_tokens == 0:
            return [], "", [], "length" if out.finished else None
        return out.token_ids, out.text, out.logprobs or [], out.finish_reason

    def _builder(self) -> CompletionLogprobsBuilder | None:
        return (CompletionLogprobsBuilder(self.serving.tokens) if self.req.logprobs is not None
                else None)

    async def response(self) -> CompletionResponse:
        finals: dict[int, RequestOutput] = {}
        async for index, out in _outputs(self.handle):
            if out.finished:
                finals[index] = out
        choices, completion_tokens = [], 0
        for index in sorted(finals):
            out, prompt, builder = finals[index], index // self.n, self._builder()
            token_ids, text, lps, reason = self._generated(out)
            completion_tokens += len(token_ids)
            first = None
            if self.req.echo:  # the prompt's first token has no logprob: nothing predicts it
                text, lps = self.echo_texts[prompt] + text, (out.prompt_logprobs or []) + lps
                first = self.handle.prompt_token_ids[prompt][0]
            logprobs = builder.add(lps, first_token=first) if builder else None
            choices.append(CompletionChoice(index=index, text=text, logprobs=logprobs,
                                            finish_reason=reason))
        return self._chunk(choices, _usage(self.handle, completion_tokens))

    async def chunks(self) -> AsyncIterator[CompletionResponse]:
        builders: dict[int, CompletionLogprobsBuilder | None] = {}
        completion_tokens = 0
        async for index, out in _outputs(self.handle):
            if index not in builders:
                builders[index] = builder = self._builder()
                if self.req.echo:
                    prompt = index // self.n
                    lps = (builder.add(out.prompt_logprobs or [],
                                       first_token=self.handle.prompt_token_ids[prompt][0])
                           if builder else None)
                    yield self._chunk([CompletionChoice(index=index, text=self.echo_texts[prompt],
                                                        logprobs=lps)])
            builder = builders[index]
            if self.max_tokens == 0:
                if out.finished:
                    yield self._chunk([CompletionChoice(index=index, text="",
                                                        finish_reason="length")])
                continue
            completion_tokens += len(out.new_token_ids)
            lps = builder.add(out.new_logprobs or []) if builder else None
            yield self._chunk([CompletionChoice(index=index, text=out.new_text, logprobs=lps,
                                                finish_reason=out.finish_reason)])
        if self.req.stream_options and self.req.stream_options.include_usage:
            yield self._chunk([], _usage(self.handle, completion_tokens))


@dataclasses.dataclass
class _ChatJob:
    """One accepted /v1/chat/completions request, turned into a response or a chunk stream."""
    serving: OpenAIServing
    req: ChatCompletionRequest
    n: int
    handle: RequestHandle
    id: str

    def __post_init__(self):
        self.created = int(time.time())

    def _logprobs(self, entries):
        return chat_logprobs(self.serving.tokens, entries or []) if self.req.logprobs else None

    async def response(self) -> ChatCompletionResponse:
        finals: dict[int, RequestOutput] = {}
        async for index, out in _outputs(self.handle):
            if out.finished:
                finals[index] = out
        choices = [ChatChoice(index=i, message=AssistantMessage(content=finals[i].text),
                              logprobs=self._logprobs(finals[i].logprobs),
                              finish_reason=finals[i].finish_reason)
                   for i in sorted(finals)]
        return ChatCompletionResponse(id=self.id, created=self.created,
                                      model=self.serving.model_name, choices=choices,
                                      usage=_usage(self.handle,
                                                   sum(len(o.token_ids) for o in finals.values())))

    def _chunk(self, choices: list[ChatChunkChoice],
               usage: Usage | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.serving.model_name,
                                   choices=choices, usage=usage)

    async def chunks(self) -> AsyncIterator[ChatCompletionChunk]:
        for index in range(len(self.handle.request_ids)):
            yield self._chunk([ChatChunkChoice(index=index,
                                               delta=Delta(role="assistant", content=""))])
        completion_tokens = 0
        async for index, out in _outputs(self.handle):
            completion_tokens += len(out.new_token_ids)
            yield self._chunk([ChatChunkChoice(index=index, delta=Delta(content=out.new_text),
                                               logprobs=self._logprobs(out.new_logprobs),
                                               finish_reason=out.finish_reason)])
        if self.req.stream_options and self.req.stream_options.include_usage:
            yield self._chunk([], _usage(self.handle, completion_tokens))
