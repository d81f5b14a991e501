"""Bad input over raw HTTP: every case is a 4xx in OpenAI's error shape, never a 500, and the server
keeps serving afterwards."""
from __future__ import annotations

import httpx
import pytest

from server_process import MAX_MODEL_LEN, assert_openai_error

LONG_PROMPT = " x" * (MAX_MODEL_LEN + 10)

COMPLETION_CASES = [
    # (body, status, param)
    ({"prompt": "hi", "temperature": "hot"}, 422, "temperature"),
    ({"prompt": "hi", "max_tokens": "16"}, 422, "max_tokens"),
    ({"prompt": "hi", "n": True}, 422, "n"),
    ({"prompt": 3}, 422, "prompt"),
    ({"max_tokens": 4}, 422, "prompt"),
    ({"prompt": "hi", "stream_options": {"include_usage": "yes"}}, 422,
     "stream_options.include_usage"),
    ({"prompt": "hi", "model": "gpt-4"}, 404, "model"),
    ({"prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
    ({"prompt": "hi", "max_tokens": MAX_MODEL_LEN}, 400, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 10**15}, 400, "max_tokens"),
    ({"prompt": "hi", "temperature": -0.5}, 400, "temperature"),
    ({"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ({"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ({"prompt": "hi", "top_k": -2}, 400, "top_k"),
    ({"prompt": "hi", "min_p": 2.0}, 400, "min_p"),
    ({"prompt": "hi", "seed": -1}, 400, "seed"),
    ({"prompt": "hi", "seed": 2**64, "temperature": 1.0}, 400, "seed"),
    ({"prompt": "hi", "stop": ""}, 400, "stop"),
    ({"prompt": "hi", "n": 0}, 400, "n"),
    ({"prompt": "hi", "n": -3}, 400, "n"),
    ({"prompt": "hi", "n": 10**6}, 400, "n"),
    ({"prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    ({"prompt": "hi", "logprobs": -1}, 400, "logprobs"),
    ({"prompt": "hi", "stop_token_ids": [10**6]}, 400, "stop_token_ids"),
    ({"prompt": "hi", "presence_penalty": 1.0}, 400, "presence_penalty"),
    ({"prompt": "hi", "suffix": "end"}, 400, "suffix"),
    ({"prompt": LONG_PROMPT}, 400, "prompt"),
    ({"prompt": ""}, 400, "prompt"),
    ({"prompt": []}, 400, "prompt"),
    ({"prompt": [1, 2, 999999]}, 400, "prompt"),
    ({"prompt": [[1, 2], []]}, 400, "prompt"),
    ({"prompt": ["ok", LONG_PROMPT]}, 400, "prompt"),
]

CHAT_CASES = [
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages"),
    ({"messages": [{"role": "user"}]}, 400, "messages"),
    ({"messages": [{"content": "hi"}]}, 422, "messages.0.role"),
    ({"messages": "hi"}, 422, "messages"),
    ({"messages": [{"role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     422, None),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, 400, "max_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 10**9},
     400, "max_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 3}, 400, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21},
     400, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "logprobs": 1}, 422, "logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": -1}, 400, "temperature"),
    ({"messages": [{"role": "user", "content": "hi"}], "model": "nope"}, 404, "model"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]},
     400, "tools"),
    ({"messages": [{"role": "user", "content": LONG_PROMPT}]}, 400, "prompt"),
]


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=30) as client:
        yield client


@pytest.mark.parametrize("body,status,param", COMPLETION_CASES)
def test_bad_completion_requests(http, body, status, param):
    error = assert_openai_error(http.post("/v1/completions", json=body), status, param)
    assert error["type"] == ("not_found_error" if status == 404 else "invalid_request_error")


@pytest.mark.parametrize("body,status,param", CHAT_CASES)
def test_bad_chat_requests(http, body, status, param):
    assert_openai_error(http.post("/v1/chat/completions", json=body), status, param)


def test_bad_streaming_request_fails_before_the_stream(http):
    resp = http.post("/v1/completions",
                     json={"prompt": "hi", "max_tokens": MAX_MODEL_LEN, "stream": True})
    assert_openai_error(resp, 400, "max_tokens")


def test_malformed_bodies(http):
    headers = {"content-type": "application/json"}
    for raw in (b"{not json", b'{"prompt": "hi",', b"\xff\xfe"):
        assert_openai_error(http.post("/v1/completions", content=raw, headers=headers), 400)
    assert_openai_error(http.post("/v1/completions", content=b"[1, 2]", headers=headers), 422)
    for number in (b"NaN", b"Infinity", b"-Infinity"):
        body = b'{"prompt": "hi", "temperature": ' + number + b"}"
        assert_openai_error(http.post("/v1/completions", content=body, headers=headers), 422,
                            "temperature")
    assert_openai_error(http.post("/v1/completions", content=b"", headers=headers), 422)


def test_unknown_routes_and_methods(http):
    assert_openai_error(http.get("/v1/nothing"), 404)
    assert_openai_error(http.post("/v2/completions", json={}), 404)
    assert_openai_error(http.get("/v1/completions"), 405)


def test_context_boundary_and_recovery(http, server):
    ids = [5] * (MAX_MODEL_LEN - 4)
    ok = http.post("/v1/completions",
                   json={"prompt": ids, "max_tokens": 4, "ignore_eos": True, "temperature": 0})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
    assert_openai_error(http.post("/v1/completions", json={"prompt": ids, "max_tokens": 5}), 400,
                        "max_tokens")
    assert_openai_error(http.post("/v1/completions",
                                  json={"prompt": [5] * MAX_MODEL_LEN, "max_tokens": 0}), 400)
    # model omitted is fine; the server still serves normally after all the errors above
    resp = http.post("/v1/completions", json={"prompt": "def f():", "max_tokens": 3})
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] >= 1
    server.wait_idle()


def test_extreme_values_are_not_server_errors(http):
    """Values the engine would overflow on mid-step (failing the whole batch) are handled up
    front."""
    huge_top_k = http.post("/v1/completions",
                           json={"prompt": "hi", "max_tokens": 2, "top_k": 10**30, "seed": 1})
    assert huge_top_k.status_code == 200, huge_top_k.text
    for seed in (2**63, 2**70):
        assert_openai_error(http.post("/v1/completions", json={"prompt": "hi", "seed": seed}), 400,
                            "seed")
