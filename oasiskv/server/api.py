"""The FastAPI app (routes, auth, error shapes) and ``serve()``, which runs it under uvicorn.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models`` (all behind the
optional API key), ``GET /health`` and ``GET /metrics`` (always open). Every error body, including
FastAPI's own validation errors (422; malformed JSON is a 400) and unknown routes (404), has
OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``. ``serve`` returns 0 after a
graceful shutdown: on SIGINT/SIGTERM it stops admitting requests, ends the in-flight ones (their
streams finish with an error event), lets uvicorn close the connections and stops the engine thread.
"""
from __future__ import annotations

import contextlib
import hmac
import json
import logging
import os
import signal
import threading
from contextlib import asynccontextmanager
from dataclasses import dataclass

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from oasiskv.config import EngineConfig
from oasiskv.engine.llm_engine import LLMEngine
from oasiskv.models.loader import resolve_model_path
from oasiskv.server.async_engine import AsyncEngine
from oasiskv.server.completions import OpenAIServing
from oasiskv.server.errors import APIError
from oasiskv.server.logprobs import TokenTable
from oasiskv.server.metrics import Metrics
from oasiskv.server.protocol import (ChatCompletionRequest, CompletionRequest, KVOffloadRequest,
                                     KVPromptRequest, KVReleaseRequest, ModelCard, ModelList)

logger = logging.getLogger(__name__)

#: default bound of a request body (--max-request-bytes): far above any context a model here takes
DEFAULT_MAX_REQUEST_BYTES = 32 << 20


def _error_response(exc: APIError) -> Response:
    # ASCII-escaped JSON: a message quoting the request's text can always be encoded
    return Response(json.dumps(exc.body()), status_code=exc.status, headers=exc.headers,
                    media_type="application/json")


def _v1(scope: Scope) -> bool:
    return scope["type"] == "http" and (scope["path"] == "/v1" or scope["path"].startswith("/v1/"))


class _BearerAuth:
    """ASGI middleware: paths under /v1 need ``Authorization: Bearer <key>`` (the scheme in any
    case, as HTTP says; plain ASGI, so streaming and disconnect detection pass through
    untouched)."""

    def __init__(self, app: ASGIApp, api_key: str):
        self.app, self.expected = app, api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if _v1(scope):
            scheme, _, given = dict(scope["headers"]).get(b"authorization", b"").partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(given.strip(),
                                                                        self.expected):
                error = APIError(401, "missing or wrong API key: "
                                      "send 'Authorization: Bearer <key>'",
                                 code="invalid_api_key")
                await _error_response(error)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _BodyLimit:
    """ASGI middleware: a request body under /v1 larger than ``max_bytes`` gets 413 before the app
    parses it. A declared Content-Length is checked at once; a body without one is read (up to the
    limit) and handed on."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not _v1(scope):
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit():
            if int(declared) > self.max_bytes:
                await self._refuse(scope, receive, send)
                return
            await self.app(scope, receive, send)
            return
        chunks, size, message = [], 0, {"more_body": True}
        while message.get("more_body", False):
            message = await receive()
            if message["type"] != "http.request":
                break
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                await self._refuse(scope, receive, send)
                return
        replay = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replayed() -> dict:
            return replay.pop() if replay else await receive()
        await self.app(scope, replayed, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        error = APIError(413, f"the request body is larger than this server's limit of "
                              f"{self.max_bytes} bytes (--max-request-bytes)")
        await _error_response(error)(scope, receive, send)


#: names pydantic puts in an error's location for the member of a union it tried
_UNION_TAGS = {"str", "int", "float", "bool"}


def _validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    first = errors[0] if errors else {"type": "", "loc": (), "msg": "invalid request"}
    if first["type"] == "json_invalid":
        return APIError(400, (f"the request body is not valid JSON: "
                              f"{first.get('ctx', {}).get('error', '')}").strip())
    surrogate = next((e for e in errors if e["type"] == "lone_surrogate"), None)
    if surrogate is not None:  # a bad value, not a wrong type (other union members may say so)
        loc = ".".join(str(part) for part in surrogate["loc"]
                       if part != "body" and str(part) not in _UNION_TAGS and "[" not in str(part))
        return APIError(400, f"{loc}: {surrogate['msg']}", param=loc or None,
                        code="lone_surrogate")
    locs = [[str(part) for part in e["loc"] if part != "body"] for e in errors] or [[]]
    # a union reports one error per member: name the field they share
    common = os.path.commonprefix(locs)
    details = "; ".join(f"{'.'.join(loc) or 'body'}: {e['msg']}"
                        for loc, e in zip(locs[:4], errors))
    return APIError(422, details + ("; ..." if len(errors) > 4 else ""),
                    param=".".join(common) or None)


@dataclass(frozen=True)
class Disaggregation:
    """``serve --role``: ``both`` (one node, the default) or a prefill / decode / memory worker
    (``server/disagg.py``). A decode worker sends prompts to ``prefill_urls``; ``remote_timeout_s``
    bounds a KV read and a control message, ``prefill_timeout_s`` a prefill worker's answer; a
    prompt with at most ``local_prefill_blocks`` complete blocks missing from the decode worker's
    own prefix cache is prefilled there instead (a repeated prompt, the next turn of a chat whose
    earlier turns it decoded). A prefill worker offloads a prompt's blocks to one of
    ``memory_urls`` when fewer than ``offload_below_blocks`` host blocks would stay free (None:
    one prompt of the longest length). ``transfer``: what a decode worker reads at admission,
    ``full`` (every complete prompt block) or ``partial`` (a handoff: the last block, summaries,
    the prefill's last hidden state and queries). ``read_latency_s`` (a decode worker; tests and
    benchmarks): no NIXL read is seen complete sooner than that after its start, as over a slower
    link; below ``remote_timeout_s``."""
    role: str = "both"
    prefill_urls: tuple[str, ...] = ()
    remote_timeout_s: float = 10.0
    prefill_timeout_s: float = 300.0
    local_prefill_blocks: int = 0
    memory_urls: tuple[str, ...] = ()
    offload_below_blocks: int | None = None
    transfer: str = "full"
    read_latency_s: float = 0.0

    def __post_init__(self):
        if self.role not in ("both", "prefill", "decode", "memory"):
            raise ValueError(f"role must be both, prefill, decode or memory, got {self.role!r}")
        if self.transfer not in ("full", "partial"):
            raise ValueError(f"transfer must be full or partial, got {self.transfer!r}")
        if self.role == "decode" and not self.prefill_urls:
            raise ValueError("--role decode needs at least one --prefill-url")
        if self.prefill_urls and self.role != "decode":
            raise ValueError("--prefill-url is for --role decode")
        if self.memory_urls and self.role != "prefill":
            raise ValueError("--memory-url is for --role prefill")
        if self.offload_below_blocks is not None and not self.memory_urls:
            raise ValueError("--offload-below-blocks needs a --memory-url")
        if not 0.0 <= self.read_latency_s < self.remote_timeout_s:
            raise ValueError("--emulated-read-latency-ms must be >= 0 and below --remote-timeout, "
                             f"got {self.read_latency_s * 1e3:g} ms")
        if self.read_latency_s and self.role != "decode":
            raise ValueError("--emulated-read-latency-ms is for --role decode")
        for flag, value in (("--local-prefill-blocks", self.local_prefill_blocks),
                            ("--offload-below-blocks", self.offload_below_blocks or 0)):
            if value < 0:
                raise ValueError(f"{flag} must be >= 0, got {value}")

    def check(self, config: EngineConfig) -> None:
        """Raise ValueError for engine flags this role cannot use."""
        if config.tier.f_host < 1 and self.role != "decode":
            raise ValueError("--f-host < 1 is for --role decode: the rest of each prompt's KV "
                             "stays on the prefill or memory worker it came from")


def _app(lifespan, healthy, render_metrics, api_key: str | None,
         max_request_bytes: int) -> FastAPI:
    """The parts every role's app shares: the body limit and bearer auth, OpenAI-shaped errors
    (a 404 names the route it did not find), ``/health`` (503 once ``healthy()`` is false) and
    ``/metrics`` (``render_metrics()``)."""
    app = FastAPI(title="oasiskv", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url="/openapi.json")
    app.add_middleware(_BodyLimit, max_bytes=max_request_bytes)
    if api_key:  # (added last: runs first)
        app.add_middleware(_BearerAuth, api_key=api_key)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        return _error_response(_validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        message = (f"no route {request.method} {request.url.path}" if exc.status_code == 404
                   else str(exc.detail))
        return _error_response(APIError(exc.status_code, message, headers=exc.headers))

    @app.exception_handler(Exception)
    async def server_error(request: Request, exc: Exception):
        logger.exception("unhandled error in %s %s", request.method, request.url.path)
        return _error_response(APIError(500, f"internal server error: {type(exc).__name__}"))

    @app.get("/health")
    async def health():
        if not healthy():
            return _error_response(APIError(503, "not serving: shutting down, or the engine "
                                                 "stopped"))
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        return Response(render_metrics(), media_type=CONTENT_TYPE_LATEST)

    return app


def _holder_routes(app: FastAPI, service) -> None:
    """The routes of a worker that serves prompt blocks under leases (prefill, memory)."""
    @app.get("/v1/kv/descriptor")
    async def kv_descriptor():
        return service.descriptor()

    @app.post("/v1/kv/release")
    async def kv_release(body: KVReleaseRequest):
        return await service.release(body.lease)

    @app.post("/v1/kv/renew")
    async def kv_renew(body: KVReleaseRequest):
        return service.renew(body.lease)


def create_app(engine: LLMEngine, served_model_name: str | None = None, api_key: str | None = None,
               max_waiting: int = 1024, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
               pd: Disaggregation = Disaggregation()) -> FastAPI:
    """The app around ``engine``; its lifespan starts and stops the engine thread. From here on only
    that thread may use ``engine``. ``app.state.engine`` is the ``AsyncEngine``,
    ``app.state.model_name`` the name clients must use. ``pd``: the worker's role (not
    ``memory``: ``create_memory_app``, which needs no engine)."""
    if pd.role == "memory":
        raise ValueError("a memory worker runs no engine: create_memory_app")
    model_name = served_model_name or engine.model_path.name
    vocab_size = engine.model_config.vocab_size
    metrics = Metrics(lambda: bridge.stats)
    bridge = AsyncEngine(engine, max_waiting, on_finished=metrics.observe,
                         on_unfinished=metrics.observe_unfinished, on_step=metrics.observe_step)
    serving = OpenAIServing(bridge, TokenTable(engine.tokenizer, vocab_size), engine.tokenizer,
                            model_name, vocab_size)
    card = ModelCard(id=model_name, max_model_len=engine.max_model_len)
    pd.check(engine.config)
    if pd.role != "both":  # (transport packages only where they are used)
        from oasiskv.server import disagg
    if pd.role == "decode":
        service = disagg.DecodeRouter(bridge, list(pd.prefill_urls), metrics.registry, api_key,
                                      pd.remote_timeout_s, pd.prefill_timeout_s,
                                      pd.local_prefill_blocks, pd.transfer, pd.read_latency_s)
        serving.admit = service.admit
    elif pd.role == "prefill":
        service = disagg.PrefillService(bridge, metrics.registry, pd.memory_urls,
                                        pd.offload_below_blocks, api_key, pd.remote_timeout_s)
    else:
        service = None

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        bridge.start()
        if service is not None:
            service.start()
        yield
        if service is not None:
            await service.close()
        serving.close()
        await bridge.close()

    app = _app(lifespan, lambda: bridge.healthy, metrics.render, api_key, max_request_bytes)
    app.state.engine, app.state.model_name = bridge, model_name

    @app.get("/v1/models")
    async def models():
        return Response(ModelList(data=[card]).model_dump_json(), media_type="application/json")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await serving.completions(body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await serving.chat(body, request)

    if pd.role == "decode":
        @app.get("/v1/kv/timeline")
        async def kv_timeline(start: float | None = None, end: float | None = None):
            return service.timeline_window(start, end)

    if pd.role == "prefill":
        _holder_routes(app, service)

        @app.post("/v1/kv/prefill")
        async def kv_prefill(body: KVPromptRequest):
            return await service.prefill(body.prompt_token_ids, body.summaries_from)

    return app


def create_memory_app(config: EngineConfig, api_key: str | None = None, max_waiting: int = 1024,
                      max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
                      pd: Disaggregation = Disaggregation("memory")) -> FastAPI:
    """A memory worker's app (``server/disagg.py``): a host store of ``--host-kv-gib`` in the
    layout the other roles store with the same flags, read and served over NIXL, and no model:
    no weights are read and no device memory taken; it serves no completions (404)."""
    from oasiskv.server import disagg
    pd.check(config)
    registry = CollectorRegistry()
    bridge = disagg.StoreBridge(max_waiting)
    service = disagg.MemoryService(bridge, disagg.memory_store(config), registry,
                                   pd.remote_timeout_s)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        service.start()
        yield
        await service.close()

    app = _app(lifespan, lambda: bridge.healthy,
               lambda: generate_latest(registry), api_key, max_request_bytes)
    app.state.engine = bridge
    app.state.model_name = resolve_model_path(config.model).name
    _holder_routes(app, service)

    @app.post("/v1/kv/lookup")
    async def kv_lookup(body: KVPromptRequest):
        return await service.lookup(body.prompt_token_ids)

    @app.post("/v1/kv/offload")
    async def kv_offload(body: KVOffloadRequest):
        return await service.offload(body.descriptor, body.blocks, body.prompt_token_ids)

    return app


class _Server(uvicorn.Server):
    """uvicorn server whose SIGINT/SIGTERM first ends in-flight requests and which then returns
    normally (uvicorn's own handling re-raises the signal after shutdown, killing the process)."""

    def __init__(self, config: uvicorn.Config, on_exit):
        super().__init__(config)
        self.on_exit = on_exit

    def handle_exit(self, sig, frame) -> None:
        self.on_exit()
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit)
                    for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def serve(config: EngineConfig, host: str = "127.0.0.1", port: int = 8000,
          api_key: str | None = None, max_waiting: int = 1024,
          served_model_name: str | None = None,
          max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
          pd: Disaggregation = Disaggregation(), emulated_host_gib: float = 0.0) -> int:
    """Load the engine and serve until SIGINT/SIGTERM; returns the exit status (0 after a clean
    stop). ``api_key`` falls back to ``$OASISKV_API_KEY``; empty means no auth.
    ``emulated_host_gib`` (benchmark only): a one-node or prefill worker's tiered host store
    answers for that many GiB of block ids over its physical blocks (``bench/harness.py``), so a
    random-weight benchmark can hold more prompts' KV than the machine's RAM."""
    api_key = api_key or os.environ.get("OASISKV_API_KEY") or None
    if emulated_host_gib and (pd.role not in ("both", "prefill") or config.kv_mode != "oasis"):
        raise ValueError("--emulated-host-gib emulates the tiered host store of one node or a "
                         "prefill worker: --role both or prefill, --kv-mode oasis")
    if pd.role == "memory":
        app = create_memory_app(config, api_key, max_waiting, max_request_bytes, pd)
    else:
        if emulated_host_gib:  # (the harness's probes only where asked for)
            from oasiskv.bench.harness import make_engine
            engine = make_engine(config, emulated_host_gib)
        else:
            engine = LLMEngine(config)
        try:
            app = create_app(engine, served_model_name, api_key, max_waiting, max_request_bytes,
                             pd)
        except BaseException:
            engine.close()
            raise
    server = _Server(uvicorn.Config(app, host=host, port=port, log_config=None,
                                    timeout_graceful_shutdown=10),
                     on_exit=app.state.engine.begin_shutdown)
    logger.info("serving %s on http://%s:%d (API key %s)", app.state.model_name, host, port,
                "required" if api_key else "off")
    server.run()
    return 0
