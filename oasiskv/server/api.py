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
import logging
import os
import signal
import threading
from contextlib import asynccontextmanager

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from oasiskv.config import EngineConfig
from oasiskv.engine.llm_engine import LLMEngine
from oasiskv.server.async_engine import AsyncEngine
from oasiskv.server.completions import OpenAIServing
from oasiskv.server.errors import APIError
from oasiskv.server.logprobs import TokenTable
from oasiskv.server.metrics import Metrics
from oasiskv.server.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList

logger = logging.getLogger(__name__)


def _error_response(exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


class _BearerAuth:
    """ASGI middleware: paths under /v1 need ``Authorization: Bearer <key>`` (plain ASGI, so
    streaming and disconnect detection pass through untouched)."""

    def __init__(self, app: ASGIApp, api_key: str):
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and (scope["path"] == "/v1" or scope["path"].startswith("/v1/")):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                error = APIError(401, "missing or wrong API key: "
                                      "send 'Authorization: Bearer <key>'",
                                 code="invalid_api_key")
                await _error_response(error)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    first = errors[0] if errors else {"type": "", "loc": (), "msg": "invalid request"}
    if first["type"] == "json_invalid":
        return APIError(400, (f"the request body is not valid JSON: "
                              f"{first.get('ctx', {}).get('error', '')}").strip())
    locs = [[str(part) for part in e["loc"] if part != "body"] for e in errors] or [[]]
    # a union reports one error per member: name the field they share
    common = os.path.commonprefix(locs)
    details = "; ".join(f"{'.'.join(loc) or 'body'}: {e['msg']}"
                        for loc, e in zip(locs[:4], errors))
    return APIError(422, details + ("; ..." if len(errors) > 4 else ""),
                    param=".".join(common) or None)


def create_app(engine: LLMEngine, served_model_name: str | None = None, api_key: str | None = None,
               max_waiting: int = 1024) -> FastAPI:
    """The app around ``engine``; its lifespan starts and stops the engine thread. From here on only
    that thread may use ``engine``. ``app.state.engine`` is the ``AsyncEngine``,
    ``app.state.model_name`` the name clients must use."""
    model_name = served_model_name or engine.model_path.name
    vocab_size = engine.model_config.vocab_size
    metrics = Metrics(lambda: bridge.stats)
    bridge = AsyncEngine(engine, max_waiting, on_finished=metrics.observe)
    serving = OpenAIServing(bridge, TokenTable(engine.tokenizer, vocab_size), engine.tokenizer,
                            model_name, vocab_size)
    card = ModelCard(id=model_name, max_model_len=engine.max_model_len)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        bridge.start()
        yield
        await bridge.close()

    app = FastAPI(title="oasiskv", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.engine, app.state.model_name = bridge, model_name
    if api_key:
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
        return _error_response(APIError(exc.status_code, message))

    @app.exception_handler(Exception)
    async def server_error(request: Request, exc: Exception):
        logger.exception("unhandled error in %s %s", request.method, request.url.path)
        return _error_response(APIError(500, f"internal server error: {type(exc).__name__}"))

    @app.get("/health")
    async def health():
        if not bridge.healthy:
            return _error_response(APIError(503, "the engine is not running"))
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return Response(ModelList(data=[card]).model_dump_json(), media_type="application/json")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await serving.completions(body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await serving.chat(body, request)

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
          served_model_name: str | None = None) -> int:
    """Load the engine and serve until SIGINT/SIGTERM; returns the exit status (0 after a clean
    stop). ``api_key`` falls back to ``$OASISKV_API_KEY``; empty means no auth."""
    api_key = api_key or os.environ.get("OASISKV_API_KEY") or None
    app = create_app(LLMEngine(config), served_model_name, api_key, max_waiting)
    server = _Server(uvicorn.Config(app, host=host, port=port, log_config=None,
                                    timeout_graceful_shutdown=10),
                     on_exit=app.state.engine.begin_shutdown)
    logger.info("serving %s on http://%s:%d (API key %s)", app.state.model_name, host, port,
                "required" if api_key else "off")
    server.run()
    return 0
