"""Servers with their own flags: API key (flag and $OASISKV_API_KEY), the waiting-queue bound (503),
and graceful shutdown on SIGTERM with a stream open."""
from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx
import openai
import pytest

from server_process import ServerProcess, assert_openai_error

KEY = "test-key-123"


@pytest.fixture(scope="module")
def limited(tmp_path_factory):
    """API key from the environment, at most one unfinished request."""
    srv = ServerProcess(tmp_path_factory.mktemp("limited") / "server.log", "--max-waiting", "1",
                        env={"OASISKV_API_KEY": KEY})
    yield srv
    assert srv.stop(signal.SIGINT) == 0, srv.log_path.read_text()


def test_api_key(limited):
    body = {"prompt": "def f():", "max_tokens": 2}
    assert_openai_error(httpx.post(limited.url + "/v1/completions", json=body), 401)
    assert_openai_error(httpx.post(limited.url + "/v1/completions", json=body,
                                   headers={"Authorization": "Bearer wrong"}), 401)
    assert_openai_error(httpx.get(limited.url + "/v1/models", headers={"Authorization": KEY}), 401)
    assert_openai_error(httpx.post(limited.url + "/v1/completions", content=b"{bad json"), 401)
    ok = httpx.post(limited.url + "/v1/completions", json=body,
                    headers={"Authorization": f"Bearer {KEY}"})
    assert ok.status_code == 200
    assert httpx.get(limited.url + "/health").status_code == 200
    assert httpx.get(limited.url + "/metrics").status_code == 200
    client = openai.OpenAI(base_url=limited.url + "/v1", api_key=KEY, max_retries=0)
    assert client.models.list().data[0].id == "demo_model"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=limited.url + "/v1", api_key="nope", max_retries=0).models.list()


def test_waiting_queue_bound_answers_503(limited):
    body = {"prompt": "def f(x):", "max_tokens": 400, "ignore_eos": True}

    async def fire():
        async with httpx.AsyncClient(base_url=limited.url, timeout=60,
                                     headers={"Authorization": f"Bearer {KEY}"}) as http:
            return await asyncio.gather(*(http.post("/v1/completions", json=body)
                                          for _ in range(6)))

    responses = asyncio.run(fire())
    codes = sorted(r.status_code for r in responses)
    assert set(codes) == {200, 503}, codes
    for r in responses:
        if r.status_code == 503:
            error = assert_openai_error(r, 503)
            assert "overloaded" in error["message"] and int(r.headers["retry-after"]) >= 1
        else:
            assert r.json()["usage"]["completion_tokens"] == 400
    limited.wait_idle()
    again = httpx.post(limited.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2},
                       headers={"Authorization": f"Bearer {KEY}"})
    assert again.status_code == 200


def test_sigterm_with_open_stream_exits_cleanly(tmp_path):
    srv = ServerProcess(tmp_path / "server.log", "--api-key", KEY)
    try:
        body = {"prompt": "def f(x):", "max_tokens": 1500, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=30,
                          headers={"Authorization": f"Bearer {KEY}"}) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()
            assert next(lines).startswith("data: {")
            srv.proc.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        error = json.loads(rest[-2].removeprefix("data: "))["error"]
        assert error["type"] == "service_unavailable" and "shutting down" in error["message"]
        assert srv.proc.wait(timeout=10) == 0, srv.log_path.read_text()
        assert time.monotonic() - signalled < 5
    finally:
        srv.stop()
