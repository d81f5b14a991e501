"""Engine failures through the HTTP API (app and uvicorn in this process, so faults can be
injected): the affected requests get a 500 ``server_error`` (or an error event mid-stream), their KV
is freed, and the server keeps serving."""
from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
import uvicorn

from oasiskv.engine.llm_engine import LLMEngine
from oasiskv.server.api import create_app

from server_process import MAX_MODEL_LEN, NUM_KV_BLOCKS, assert_openai_error, free_port


class FailAfter:
    """Stand-in for an engine method: calls through ``calls`` times, then raises once."""

    def __init__(self, real, calls: int = 0):
        self.real, self.calls, self.raised = real, calls, False

    def __call__(self, *args, **kwargs):
        if not self.raised and self.calls == 0:
            self.raised = True
            raise RuntimeError("injected fault")
        self.calls -= 1
        return self.real(*args, **kwargs)


@pytest.fixture(scope="module")
def live():
    engine = LLMEngine(max_model_len=MAX_MODEL_LEN, num_kv_blocks=NUM_KV_BLOCKS)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(engine), host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "in-process server did not start"
        time.sleep(0.05)
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as http:
        yield engine, http
    server.should_exit = True
    thread.join(15)


def _kv_free(http) -> bool:
    text = http.get("/metrics").text
    values = {line.split()[0]: line.split()[1] for line in text.splitlines()
              if line.startswith("oasiskv_kv_blocks")}
    return values["oasiskv_kv_blocks_free"] == values["oasiskv_kv_blocks_total"]


def _check_recovered(http) -> None:
    ok = http.post("/v1/completions",
                   json={"prompt": "def f():", "max_tokens": 4, "ignore_eos": True})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
    deadline = time.monotonic() + 5
    while not _kv_free(http):
        assert time.monotonic() < deadline, "KV blocks were not freed"
        time.sleep(0.05)


def test_model_failure_inside_step_is_a_500(live, monkeypatch):
    engine, http = live
    monkeypatch.setattr(engine.runner, "launch", FailAfter(engine.runner.launch))
    resp = http.post("/v1/completions", json={"prompt": "def f():", "max_tokens": 8})
    error = assert_openai_error(resp, 500)
    assert error["type"] == "server_error" and "injected fault" in error["message"]
    _check_recovered(http)


def test_exception_escaping_step_fails_requests_and_keeps_serving(live, monkeypatch):
    engine, http = live
    monkeypatch.setattr(engine, "step", FailAfter(engine.step, calls=3))
    body = {"prompt": "def f():", "max_tokens": 50, "ignore_eos": True, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        events = [line.removeprefix("data: ") for line in resp.iter_lines() if line]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["type"] == "server_error" and "injected fault" in error["message"]
    assert len(events) == 3 + 2  # three tokens streamed before the failure
    _check_recovered(http)


def test_chat_failure_is_a_500(live, monkeypatch):
    engine, http = live
    monkeypatch.setattr(engine, "step", FailAfter(engine.step))
    resp = http.post("/v1/chat/completions",
                     json={"messages": [{"role": "user", "content": "hi"}], "n": 2})
    assert assert_openai_error(resp, 500)["type"] == "server_error"
    _check_recovered(http)
