"""Inputs found by fuzzing and load-testing, each reproduced against a real server process: lone
UTF-16 surrogates, tiny and large temperatures, huge prompts and bodies, seeds near 2**63, HTTP
details (Allow, Retry-After in test_limits, the Bearer scheme's case), metrics of requests that end
without finishing, and the OpenAPI schema."""
from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest

from server_process import ServerProcess, assert_openai_error

SURROGATE = "\\ud800"  # as JSON text: a lone high surrogate


def post_raw(server, path: str, body: str) -> httpx.Response:
    return httpx.post(server.url + path, content=body.encode(), timeout=60,
                      headers={"Content-Type": "application/json"})


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", f'{{"prompt": "a{SURROGATE}b", "max_tokens": 2}}', "prompt"),
    ("/v1/completions", f'{{"prompt": ["ok", "{SURROGATE}"], "max_tokens": 2}}', "prompt"),
    ("/v1/completions", f'{{"prompt": "x", "model": "{SURROGATE}"}}', "model"),
    ("/v1/completions", f'{{"prompt": "x", "stop": ["{SURROGATE}"]}}', "stop"),
    ("/v1/chat/completions",
     f'{{"messages": [{{"role": "user", "content": "{SURROGATE}"}}], "max_tokens": 2}}',
     "messages.0.content"),
    ("/v1/chat/completions",
     '{"messages": [{"role": "user", "content": [{"type": "text", "text": "%s"}]}]}' % SURROGATE,
     "messages.0.content.0.text"),
])
def test_lone_surrogates_are_a_400_not_a_500(server, path, body, param):
    error = assert_openai_error(post_raw(server, path, body), 400, param=param)
    assert error["code"] == "lone_surrogate"
    assert httpx.get(server.url + "/health").status_code == 200


def test_temperatures_below_float32_range_sample_greedily_and_above_2_are_refused(server):
    base = {"prompt": "def add(a, b):", "max_tokens": 8, "ignore_eos": True}
    greedy = httpx.post(server.url + "/v1/completions", json=base | {"temperature": 0},
                        timeout=60).json()["choices"][0]["text"]
    for tiny in (1e-40, 1e-30, 5e-6):
        out = httpx.post(server.url + "/v1/completions", json=base | {"temperature": tiny},
                         timeout=60)
        assert out.status_code == 200 and out.json()["choices"][0]["text"] == greedy
    resp = httpx.post(server.url + "/v1/completions", json=base | {"temperature": 2.5})
    assert_openai_error(resp, 400, param="temperature")
    assert httpx.post(server.url + "/v1/completions", json=base | {"temperature": 2.0},
                      timeout=60).status_code == 200


def test_seed_near_2_63_with_n_blames_the_seed(server):
    body = {"prompt": "x", "max_tokens": 1, "n": 2, "seed": 2**63 - 1, "temperature": 1.0}
    assert_openai_error(httpx.post(server.url + "/v1/completions", json=body), 400, param="seed")
    body["seed"] = 2**63 - 2
    assert httpx.post(server.url + "/v1/completions", json=body, timeout=60).status_code == 200


def test_405_names_the_allowed_methods(server):
    resp = httpx.get(server.url + "/v1/completions")
    assert_openai_error(resp, 405)
    assert resp.headers["allow"] == "POST"


def test_openapi_schema_is_served(server):
    schema = httpx.get(server.url + "/openapi.json").json()
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models"} <= set(schema["paths"])


def test_a_huge_prompt_is_refused_off_the_engine_thread(server):
    """Tokenising ~8 MB of text takes seconds; it happens on the server's tokenizer thread, so a
    stream running meanwhile keeps its pace, and the huge prompt gets its 400."""
    gaps, stop = [], threading.Event()

    def stream():
        body = {"prompt": "def f(x):", "max_tokens": 1500, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as r:
            last = time.monotonic()
            for line in r.iter_lines():
                now = time.monotonic()
                gaps.append(now - last)
                last = now
                if stop.is_set():
                    break

    streamer = threading.Thread(target=stream)
    streamer.start()
    time.sleep(1.0)  # the stream is running
    start = time.monotonic()
    big = httpx.post(server.url + "/v1/completions", timeout=120,
                     json={"prompt": "def g(y):\n    return y * 2\n" * 300_000, "max_tokens": 1})
    refused_after = time.monotonic() - start
    stop.set()
    streamer.join(timeout=120)
    assert_openai_error(big, 400, param="prompt")
    assert refused_after > 1.0, "the prompt must take a while to tokenize for this test to mean it"
    assert max(gaps[5:]) < refused_after / 2, (max(gaps[5:]), refused_after)


@pytest.fixture(scope="module")
def small_bodies(tmp_path_factory):
    srv = ServerProcess(tmp_path_factory.mktemp("small") / "server.log",
                        "--max-request-bytes", "2000", "--api-key", "k")
    yield srv
    assert srv.stop(signal.SIGINT) == 0, srv.log_path.read_text()


def test_bodies_over_the_limit_get_413_with_or_without_a_length(small_bodies):
    auth = {"Authorization": "bearer k"}  # the scheme in any case
    ok = httpx.post(small_bodies.url + "/v1/completions", headers=auth, timeout=60,
                    json={"prompt": "x" * 1000, "max_tokens": 1})
    assert ok.status_code == 200
    big = json.dumps({"prompt": "x" * 3000, "max_tokens": 1}).encode()
    assert_openai_error(httpx.post(small_bodies.url + "/v1/completions", content=big,
                                   headers=auth), 413)

    def chunks():  # no Content-Length: chunked transfer encoding
        for i in range(0, len(big), 500):
            yield big[i:i + 500]
    assert_openai_error(httpx.post(small_bodies.url + "/v1/completions", content=chunks(),
                                   headers=auth), 413)
    small = json.dumps({"prompt": "y" * 500, "max_tokens": 1}).encode()
    resp = httpx.post(small_bodies.url + "/v1/completions", timeout=60,
                      headers=auth | {"Content-Type": "application/json"},
                      content=(small[i:i + 100] for i in range(0, len(small), 100)))
    assert resp.status_code == 200, resp.text
    assert_openai_error(httpx.post(small_bodies.url + "/v1/completions", content=big), 401)


def unfinished(server, reason: str) -> float:
    text = httpx.get(server.url + "/metrics").text
    key = f'oasiskv_requests_unfinished_total{{reason="{reason}"}}'
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(key))


def test_aborted_requests_are_counted(server):
    before = unfinished(server, "aborted")
    body = {"prompt": "def f(x):", "max_tokens": 500, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as resp:
        lines = resp.iter_lines()
        assert next(lines).startswith("data: ")
    deadline = time.monotonic() + 10
    while unfinished(server, "aborted") < before + 1:
        assert time.monotonic() < deadline, "the abort was not counted"
        time.sleep(0.05)
    server.wait_idle()
