"""Fuzzing the real server process as its users would: request bodies built by hypothesis from the
fields of both generation routes, with values of every JSON type (arbitrary Unicode with lone
surrogates, huge and negative numbers, nesting), raw non-JSON bodies and large ones. Every answer
must be a 2xx or an OpenAI-shaped 4xx, never a 5xx, and the server must serve normally afterwards.
Bounded: a fixed number of examples, small generations, per-request timeouts."""
from __future__ import annotations

import json
from collections import Counter

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from server_process import assert_openai_error

# text with every code point class, lone surrogates included
TEXT = st.text(st.characters(codec=None, categories=None), max_size=40)
NUMBERS = st.one_of(st.integers(-2**70, 2**70), st.floats(allow_nan=False, allow_infinity=False),
                    st.sampled_from([0, 1, -1, 2**63 - 1, 2**63, 2**64, 1e-45, 1e308]))
SCALARS = st.one_of(st.none(), st.booleans(), NUMBERS, TEXT)
VALUES = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(TEXT, inner, max_size=3)),
                      max_leaves=8)


# generation lengths stay small, so each example answers quickly on a CPU
SMALL = st.integers(0, 4)
PROMPT = st.one_of(TEXT, st.lists(TEXT, min_size=1, max_size=3),
                   st.lists(st.integers(-5, 400), min_size=1, max_size=20))
SHARED = {  # values the server takes (text fields may still hold lone surrogates)
    "model": st.just("demo_model"), "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1),
    "top_k": st.integers(-1, 400), "min_p": st.floats(0, 1), "seed": st.integers(0, 2**63 - 2),
    "stop": st.one_of(TEXT, st.lists(TEXT, max_size=3)),
    "stop_token_ids": st.lists(st.integers(0, 319), max_size=3), "ignore_eos": st.booleans(),
    "n": st.integers(1, 3), "stream": st.booleans(),
    "stream_options": st.just({"include_usage": True}), "user": TEXT,
}
VALID = {
    "/v1/completions": st.fixed_dictionaries(
        {"prompt": PROMPT, "max_tokens": SMALL},
        optional=SHARED | {"logprobs": st.integers(0, 5), "echo": st.booleans()}),
    "/v1/chat/completions": st.fixed_dictionaries(
        {"messages": st.lists(st.fixed_dictionaries(
            {"role": st.sampled_from(["user", "system", "assistant"]),
             "content": st.one_of(TEXT, st.lists(st.fixed_dictionaries(
                 {"type": st.just("text"), "text": TEXT}), max_size=2))}), min_size=1, max_size=3),
         "max_tokens": st.integers(1, 4)},
        optional=SHARED | {"logprobs": st.booleans(), "top_logprobs": SMALL}),
}
FIELD_NAMES = sorted({"prompt", "messages", "max_tokens", "logprobs", "echo", "top_logprobs",
                      "presence_penalty", "logit_bias", "suffix", "best_of",
                      "max_completion_tokens"} | set(SHARED))


@st.composite
def bodies(draw, path: str) -> dict:
    """A request the server takes, with up to two fields set to anything at all (half the time
    none: every check passed, the request reaches the engine)."""
    body = draw(VALID[path])
    if draw(st.booleans()):
        body |= draw(st.dictionaries(st.sampled_from(FIELD_NAMES), VALUES, min_size=1,
                                     max_size=2))
    return body


RAW = st.one_of(st.binary(max_size=200), TEXT.map(str.encode),
                st.integers(1, 3).map(lambda mb: b'{"prompt": "' + b"x" * (mb << 20) + b'"}'))


SEEN: Counter = Counter()  # answers by status class, so the follow-up test knows what ran


def check(resp: httpx.Response) -> None:
    SEEN[resp.status_code // 100] += 1
    assert resp.status_code < 500, resp.text
    if resp.status_code >= 400:
        assert_openai_error(resp, resp.status_code)


@settings(max_examples=120, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data(), path=st.sampled_from(sorted(VALID)),
       raw=st.one_of(st.none(), st.none(), st.none(), RAW))
def test_no_request_gets_a_5xx(server, data, path, raw):
    body = data.draw(bodies(path))
    content = raw if raw is not None else json.dumps(body).encode()  # lone surrogates: \\udXXX
    with httpx.Client(base_url=server.url, timeout=60) as http:
        if isinstance(body, dict) and body.get("stream") is True and raw is None:
            with http.stream("POST", path, content=content,
                             headers={"Content-Type": "application/json"}) as resp:
                resp.read()
                check(resp)
        else:
            check(http.post(path, content=content, headers={"Content-Type": "application/json"}))


def test_the_server_serves_normally_after_the_fuzzing(server):
    # the fuzzing reached both the engine (2xx) and the checks (4xx), and nothing else
    assert SEEN[2] >= 5 and SEEN[4] >= 50 and set(SEEN) <= {2, 4}, SEEN
    assert httpx.get(server.url + "/health").status_code == 200
    resp = httpx.post(server.url + "/v1/completions", timeout=60,
                      json={"prompt": "def f():", "max_tokens": 4, "ignore_eos": True})
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 4
    server.wait_idle()
