"""AsyncEngine: the bridge between asyncio request handlers and the one thread that drives
LLMEngine.

Threading contract: only the engine thread touches the ``LLMEngine`` (its tokenizer included:
prompts arrive as token ids, tokenized by the handlers on their own thread with their own copy, see
``completions.py``; ``check_prompts`` may run on any thread). The event loop sends it commands (add,
abort, call a function, stop) through a thread-safe queue; the thread applies all pending commands
between two steps, and blocks on the queue when nothing is unfinished (no busy spin). Results come
back to the loop with ``loop.call_soon_threadsafe``, one call per step, and are routed to the
``RequestHandle`` of the HTTP request they belong to. All handle and routing state lives on the
loop thread.

Failure contract: bad input is refused with ``APIError(400)`` before anything is queued. An
exception escaping ``LLMEngine.step`` fails every unfinished request with ``APIError(500)`` and the
thread goes on serving. On shutdown every unfinished request ends with ``APIError(503)``. A request
whose consumer goes away must be aborted (``RequestHandle.abort``): the engine frees its KV between
the next two steps.
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from oasiskv.engine.llm_engine import EngineStats, LLMEngine, RequestOutput
from oasiskv.sampling_params import SamplingParams
from oasiskv.server.errors import APIError

logger = logging.getLogger(__name__)


#: seconds an overloaded server asks clients to wait before retrying (HTTP Retry-After)
RETRY_AFTER_S = 1
#: seconds the engine thread waits for a command after a step that ran nothing (no busy spin)
IDLE_WAIT_S = 0.005


@dataclass
class _Add:
    request_ids: list[str]            # len(prompts) * len(params), prompt-major
    prompts: list[str | list[int]]
    params: list[SamplingParams]
    max_tokens: int | None
    reply: asyncio.Future
    # TTFT counts queueing too
    arrival_time: float = dataclasses.field(default_factory=time.monotonic)
    # keep each prompt's Handoff (``LLMEngine.take_handoff``) (a predicate: asked on adding)
    hand_off: bool | Callable[[], bool] = False


@dataclass
class _Abort:
    request_ids: list[str]


@dataclass
class _Call:
    fn: Callable[[], object]
    reply: asyncio.Future | None  # None: nobody waits (an undo)
    undo: Callable[[object], None] | None = None


@dataclass
class _Raised:
    exc: Exception


_STOP = object()


class RequestHandle:
    """The engine requests of one API request: choice ``i`` is prompt ``i // n``'s ``i % n``-th
    sample.

    ``prompt_token_ids`` holds each prompt's tokens once the engine accepted the request.
    Iterate ``outputs()`` to receive ``(choice index, RequestOutput)`` in the order the engine
    produced them.
    """

    def __init__(self, engine: "AsyncEngine", request_ids: list[str]):
        self._engine = engine
        self.request_ids = request_ids
        self.prompt_token_ids: list[list[int]] = []
        self.hand_off = False  # whether the engine keeps the prompts' handoffs (``submit``)
        self._queue: asyncio.Queue[tuple[int, RequestOutput | APIError]] = asyncio.Queue()

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Yield until every choice finished; raises the ``APIError`` that ends a choice early."""
        unfinished = len(self.request_ids)
        while unfinished:
            index, item = await self._queue.get()
            if isinstance(item, APIError):
                raise item
            unfinished -= item.finished
            yield index, item

    def abort(self) -> None:
        """Abort the choices that have not finished (idempotent; safe after completion)."""
        self._engine._abort(self.request_ids)


class AsyncEngine:
    """Owns the engine thread. ``start()`` and every other method run on the event loop, except
    ``begin_shutdown`` which may be called from any thread or a signal handler."""

    def __init__(self, engine: LLMEngine, max_waiting: int,
                 on_finished: Callable[[RequestOutput], None] | None = None,
                 on_unfinished: Callable[[str, int], None] | None = None,
                 on_step: Callable[[EngineStats], None] | None = None):
        """``on_finished(output)`` is told of every finished engine request, ``on_unfinished(why,
        count)`` of those that ended otherwise: ``aborted`` (the client went away) or ``error``;
        ``on_step(stats)`` of the stats after every step (on the engine thread)."""
        if max_waiting < 1:
            raise ValueError(f"max_waiting must be >= 1, got {max_waiting}")
        self.engine = engine
        self.max_waiting = max_waiting
        self.on_finished = on_finished
        self.on_unfinished = on_unfinished or (lambda why, count: None)
        self.on_step = on_step or (lambda stats: None)
        self.stats: EngineStats = dataclasses.replace(engine.stats)  #: snapshot after the last step
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        # unfinished engine request -> (handle, choice)
        self._routes: dict[str, tuple[RequestHandle, int]] = {}
        self._ids = itertools.count()
        # engine thread only: requests added and not finished or aborted
        self._live: set[str] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._closing = False
        self._idle = False  # engine thread: the last step ran nothing

    # ---- event-loop side -------------------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="oasiskv-engine", daemon=True)
        self._thread.start()

    @property
    def healthy(self) -> bool:
        return not self._closing and self._thread is not None and self._thread.is_alive()

    @property
    def num_unfinished(self) -> int:
        """Engine requests submitted and not yet finished, failed or aborted."""
        return len(self._routes)

    def check_prompts(self, prompt_ids: list[list[int]], max_tokens: int | None) -> None:
        """Raise ``APIError(400)`` for a prompt the engine cannot take: empty, a token outside the
        vocabulary, or prompt plus ``max_tokens`` over the context limit (any thread)."""
        limit, vocab = self.engine.max_model_len, self.engine.model_config.vocab_size
        for ids in prompt_ids:
            if not ids:
                raise APIError(400, "the prompt is empty: give at least one token", param="prompt")
            if len(ids) >= limit:
                raise APIError(400, f"the prompt has {len(ids)} tokens but the context limit is "
                                    f"{limit} tokens (prompt + output): shorten the prompt",
                               param="prompt")
            if max_tokens is not None and len(ids) + max_tokens > limit:
                raise APIError(400, f"max_tokens is {max_tokens} but the prompt has {len(ids)} "
                                    f"tokens and the context limit is {limit}: "
                                    f"ask for at most {limit - len(ids)} tokens",
                               param="max_tokens")
            if not all(type(t) is int and 0 <= t < vocab for t in ids):
                raise APIError(400, f"prompt token ids must be integers in [0, {vocab})",
                               param="prompt")

    async def submit(self, prompts: list[list[int]], params: list[SamplingParams],
                     max_tokens: int | None, arrival_time: float | None = None,
                     hand_off: bool | Callable[[], bool] = False) -> RequestHandle:
        """Start ``len(prompts) * len(params)`` engine requests, all or none.

        ``prompts``: token ids that passed ``check_prompts`` with this ``max_tokens``. ``params[j]``
        is choice ``j`` of every prompt; their ``max_tokens`` is replaced: by ``max_tokens`` (0
        still generates one token, for the caller to drop), or by whatever the context leaves after
        the prompt when ``max_tokens`` is None. Raises ``APIError``: 400 when ``n`` exceeds what
        the server ever admits (or the engine refuses a prompt), 503 when more than
        ``max_waiting`` engine requests would be unfinished or the server is shutting down.
        ``arrival_time`` (``time.monotonic``, default now): where TTFT and latency start, e.g.
        before a disaggregated decode worker brought the prompt's KV in. ``hand_off``: the engine
        keeps each prompt's ``Handoff`` (a prefill worker's partial admission); a predicate is
        asked on the engine thread just before the requests are added (e.g. whether the host store
        has room for the blocks the handoffs will hold), and ``handle.hand_off`` says what it gave.
        """
        count = len(prompts) * len(params)
        if not self.healthy:
            raise APIError(503, "the server is shutting down", headers={"Retry-After": "5"})
        if count > self.max_waiting:
            raise APIError(400, f"this request needs {count} generations (prompts x n) but the "
                                f"server admits at most {self.max_waiting} at a time", param="n")
        if self.num_unfinished + count > self.max_waiting:
            raise APIError(503, f"the server is overloaded: {self.num_unfinished} requests are "
                                f"queued or running (limit {self.max_waiting}); retry later",
                           code="overloaded", headers={"Retry-After": str(RETRY_AFTER_S)})
        base = f"r{next(self._ids)}"
        handle = RequestHandle(self, [f"{base}-{i}" for i in range(count)])
        for i, rid in enumerate(handle.request_ids):
            self._routes[rid] = (handle, i)
        reply = self._loop.create_future()
        self._commands.put(_Add(handle.request_ids, prompts, params, max_tokens, reply,
                                arrival_time or time.monotonic(), hand_off))
        try:
            handle.prompt_token_ids, handle.hand_off = await reply
        except BaseException:  # refused, or the client left while waiting: nothing may stay queued
            handle.abort()
            raise
        return handle

    async def call(self, fn: Callable[[], object],
                   undo: Callable[[object], None] | None = None):
        """Run ``fn()`` on the engine thread between two steps and return its result (or raise
        its exception): the way to touch engine state (e.g. its KV allocator) from the loop.
        ``undo(result)`` runs on the engine thread instead when the caller stopped waiting (was
        cancelled) before the result came back, so that nothing ``fn`` took is lost."""
        if not self.healthy:
            raise APIError(503, "the server is shutting down", headers={"Retry-After": "5"})
        reply = self._loop.create_future()
        self._commands.put(_Call(fn, reply, undo))
        return await reply

    def _abort(self, request_ids: list[str]) -> None:
        live = [rid for rid in request_ids if self._routes.pop(rid, None) is not None]
        if live:
            self.on_unfinished("aborted", len(live))
        if live and self.healthy:
            self._commands.put(_Abort(live))

    def begin_shutdown(self) -> None:
        """Stop admitting requests and end every unfinished one (thread- and signal-safe)."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._shutdown)

    def _shutdown(self) -> None:
        if not self._closing:
            self._closing = True
            self._commands.put(_STOP)

    async def close(self, timeout: float = 10.0) -> None:
        """Shut down (if not yet) and wait for the engine thread to exit."""
        self._shutdown()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, timeout)
        if self._thread is None or not self._thread.is_alive():
            self.engine.close()

    def _dispatch(self, items: list[tuple[str, RequestOutput | APIError]]) -> None:
        for rid, item in items:
            route = self._routes.get(rid)
            if route is None:
                continue  # aborted: its consumer is gone
            handle, index = route
            if isinstance(item, APIError):
                del self._routes[rid]
                self.on_unfinished("error", 1)
            elif item.finished:
                del self._routes[rid]
                if self.on_finished is not None:
                    self.on_finished(item)
            handle._queue.put_nowait((index, item))

    def _resolve_call(self, cmd: _Call, result) -> None:
        if cmd.reply.done() and cmd.undo is not None and not isinstance(result, _Raised):
            undo = cmd.undo  # the caller left: give back what it took
            self._commands.put(_Call(lambda: undo(result), None))
        self._resolve(cmd.reply, result)

    def _resolve(self, future: asyncio.Future, result) -> None:
        if not future.done():  # cancelled when the client left first
            failed = isinstance(result, (APIError, _Raised))
            (future.set_exception if failed else future.set_result)(
                result.exc if isinstance(result, _Raised) else result)

    # ---- engine thread ---------------------------------------------------------------------------
    def _post(self, fn, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            pass

    def _run(self) -> None:
        try:
            while self._serve_once():
                pass
        finally:  # stopped (or, by a bug, crashed): nothing may be left waiting for this thread
            self._fail_live(APIError(503, "the engine has stopped (the server is shutting down); "
                                          "the request was aborted"))
            while True:
                try:
                    cmd = self._commands.get_nowait()
                except queue.Empty:
                    break
                if isinstance(cmd, (_Add, _Call)) and cmd.reply is not None:
                    self._post(self._resolve, cmd.reply,
                               APIError(503, "the server is shutting down"))

    def _serve_once(self) -> bool:
        """Apply pending commands (waiting for one when idle), then run one step. False on stop."""
        try:
            if not self.engine.has_unfinished():
                # (background work left, e.g. reads still landing: settled again shortly)
                commands = self._next_command(IDLE_WAIT_S if self.engine.idle() else None)
            elif self._idle:  # unfinished work the scheduler cannot run yet (e.g. held blocks)
                commands = self._next_command(IDLE_WAIT_S)
            else:
                commands = []
            while True:
                try:
                    commands.append(self._commands.get_nowait())
                except queue.Empty:
                    break
            for cmd in commands:
                if cmd is _STOP:
                    return False
                self._apply(cmd)
            if self.engine.has_unfinished():
                outputs = self.engine.step()
                self._idle = self.engine.stats.last_batch_size == 0
                self.on_step(self.engine.stats)
                self._live.difference_update(o.request_id for o in outputs if o.finished)
                self._post(self._dispatch, [(o.request_id, o) for o in outputs])
        except Exception as exc:
            logger.exception("the engine loop failed; failing its %d unfinished requests",
                             len(self._live))
            self._fail_live(APIError(500, f"internal engine error: {type(exc).__name__}: {exc}"))
        self.stats = dataclasses.replace(self.engine.stats)
        return True

    def _next_command(self, timeout: float | None) -> list:
        """The next command, waiting ``timeout`` seconds at most (None: until one comes)."""
        try:
            return [self._commands.get(timeout=timeout)]
        except queue.Empty:
            return []

    def _apply(self, cmd: _Add | _Abort | _Call) -> None:
        if isinstance(cmd, _Call):
            try:
                result = cmd.fn()
            except Exception as exc:  # the caller's to handle
                if cmd.reply is None:
                    logger.exception("an engine-thread call failed")
                result = _Raised(exc)
            if cmd.reply is not None:
                self._post(self._resolve_call, cmd, result)
            return
        if isinstance(cmd, _Abort):
            for rid in cmd.request_ids:
                if rid in self._live:
                    self._live.discard(rid)
                    self.engine.abort(rid)
            return
        try:
            added = self._add(cmd)
        except APIError as exc:
            self._post(self._resolve, cmd.reply, exc)
        except ValueError as exc:  # the engine refused the prompt
            self._post(self._resolve, cmd.reply, APIError(400, str(exc), param="prompt"))
        except Exception as exc:
            logger.exception("adding a request failed")
            self._post(self._resolve, cmd.reply,
                       APIError(500, f"internal engine error: {type(exc).__name__}: {exc}"))
        else:
            self._post(self._resolve, cmd.reply, added)

    def _add(self, cmd: _Add) -> tuple[list[list[int]], bool]:
        limit = self.engine.max_model_len
        prompt_ids = [list(p) for p in cmd.prompts]  # checked by the caller (check_prompts)
        hand_off = bool(cmd.hand_off()) if callable(cmd.hand_off) else cmd.hand_off
        added: list[str] = []
        try:
            rids = iter(cmd.request_ids)
            for ids in prompt_ids:
                budget = limit - len(ids) if cmd.max_tokens is None else max(cmd.max_tokens, 1)
                for p in cmd.params:
                    added.append(self.engine.add_request(ids,
                                                         dataclasses.replace(p, max_tokens=budget),
                                                         next(rids), cmd.arrival_time,
                                                         hand_off))
        except BaseException:
            for rid in added:
                self.engine.abort(rid)
            raise
        self._live.update(added)
        return prompt_ids, hand_off

    def _fail_live(self, error: APIError) -> None:
        failed = list(self._live)
        self._live.clear()
        for rid in failed:
            try:
                self.engine.abort(rid)
            except Exception:
                logger.exception("aborting %s failed", rid)
        self._post(self._dispatch, [(rid, error) for rid in failed])
