"""The OpenAI surface through the official ``openai`` client against a real server: completions,
chat, streaming, n, batches, token-id prompts, logprobs, echo (lm-eval loglikelihood), greedy parity
with the offline ``LLM``, models / health / metrics."""
from __future__ import annotations

import functools
import math

import httpx
import openai
import pytest

from oasiskv import LLM, SamplingParams

from server_process import MAX_MODEL_LEN, NUM_KV_BLOCKS

PROMPT = "def fibonacci(n):"


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def complete(client, model_name):
    return functools.partial(client.completions.create, model=model_name)


@pytest.fixture(scope="module")
def chat(client, model_name):
    return functools.partial(client.chat.completions.create, model=model_name)


@pytest.fixture(scope="module")
def llm():
    return LLM(max_model_len=MAX_MODEL_LEN, num_kv_blocks=NUM_KV_BLOCKS)


def test_models_health_metrics(server, client, model_name):
    assert [m.id for m in client.models.list().data] == [model_name] == ["demo_model"]
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    m = server.metrics()
    for name in ("oasiskv_num_requests_running", "oasiskv_num_requests_waiting",
                 "oasiskv_kv_blocks_used", "oasiskv_kv_blocks_free", "oasiskv_prompt_tokens_total",
                 "oasiskv_generation_tokens_total", "oasiskv_time_to_first_token_seconds_count",
                 "oasiskv_time_per_output_token_seconds_count",
                 "oasiskv_e2e_request_latency_seconds_count", "oasiskv_num_steps_ahead_total"):
        assert name in m
    assert m["oasiskv_kv_blocks_total"] == NUM_KV_BLOCKS


def test_greedy_completion_matches_offline_llm(complete, llm):
    prompts = [PROMPT, "import numpy as np\n", "class Stack:\n    def push(self, x):"]
    expected = llm.generate(prompts, SamplingParams(max_tokens=32, temperature=0))
    for prompt, exp in zip(prompts, expected):
        got = complete(prompt=prompt, max_tokens=32, temperature=0)
        assert got.choices[0].text == exp.text
        assert got.choices[0].finish_reason == exp.finish_reason
        assert got.usage.prompt_tokens == len(exp.prompt_token_ids)
        assert got.usage.completion_tokens == len(exp.token_ids)


def test_completion_defaults_stop_and_metrics(server, complete):
    before = server.metrics()
    out = complete(prompt=PROMPT, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 16 and out.choices[0].finish_reason == "length"
    assert out.object == "text_completion" and out.id.startswith("cmpl-")
    full = complete(prompt=PROMPT, max_tokens=24, temperature=0).choices[0].text
    stop = full.strip()[:2]
    cut = complete(prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == full[:full.index(stop)]
    after = server.metrics()
    assert (after["oasiskv_generation_tokens_total"]
            >= before["oasiskv_generation_tokens_total"] + 16 + 24)
    assert (after["oasiskv_e2e_request_latency_seconds_count"]
            == before["oasiskv_e2e_request_latency_seconds_count"] + 3)


def test_batch_prompts_token_ids_and_n(complete, llm):
    ids = llm.tokenizer.encode(PROMPT)
    out = complete(prompt=[PROMPT, "x = 1"], max_tokens=5, temperature=0)
    assert [c.index for c in out.choices] == [0, 1]
    by_ids = complete(prompt=ids, max_tokens=5, temperature=0)
    assert by_ids.choices[0].text == out.choices[0].text
    batch_ids = complete(prompt=[ids, ids], max_tokens=5, temperature=0)
    assert {c.text for c in batch_ids.choices} == {out.choices[0].text}
    sampled = complete(prompt=[PROMPT, "x = 1"], n=3, max_tokens=8, temperature=1.0, seed=7,
                                        extra_body={"ignore_eos": True})
    assert [c.index for c in sampled.choices] == list(range(6))
    assert sampled.usage.completion_tokens == 6 * 8
    assert sampled.usage.prompt_tokens == len(ids) + len(llm.tokenizer.encode("x = 1"))
    again = complete(prompt=[PROMPT, "x = 1"], n=3, max_tokens=8, temperature=1.0, seed=7,
                                      extra_body={"ignore_eos": True})
    # seeded: reproducible
    assert [c.text for c in again.choices] == [c.text for c in sampled.choices]
    assert len({c.text for c in sampled.choices[:3]}) > 1  # choice j samples with seed + j


def test_completion_logprobs(complete):
    out = complete(prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3)
    lp = out.choices[0].logprobs
    assert (len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs)
            == len(lp.text_offset) == 6)
    assert "".join(lp.tokens) == out.choices[0].text
    assert lp.text_offset[0] == 0
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0 and 3 <= len(top) <= 4 and top[token] == logprob
        assert max(top.values()) == logprob  # greedy picks the top token


def test_echo_logprobs_for_loglikelihood(complete, llm):
    """lm-evaluation-harness local-completions: token-id prompts, echo, logprobs=1,
    max_tokens 0 or 1."""
    ids = llm.tokenizer.encode(PROMPT)
    ref = llm.generate(ids, SamplingParams(max_tokens=1, temperature=0,
                                           prompt_logprobs=1))[0].prompt_logprobs
    for max_tokens in (0, 1):
        out = complete(prompt=[ids], max_tokens=max_tokens, temperature=0, echo=True, logprobs=1)
        choice = out.choices[0]
        lp = choice.logprobs
        assert len(lp.tokens) == len(ids) + max_tokens
        assert choice.text.startswith(PROMPT) and (max_tokens or choice.text == PROMPT)
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        for got, exp in zip(lp.token_logprobs[1:len(ids)], ref):
            assert math.isclose(got, exp.logprob, rel_tol=1e-4, abs_tol=1e-5)
        assert "".join(lp.tokens[:len(ids)]) == PROMPT
        assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == max_tokens
    text_echo = complete(prompt=PROMPT, max_tokens=3, temperature=0, echo=True)
    plain = complete(prompt=PROMPT, max_tokens=3, temperature=0)
    assert (text_echo.choices[0].text == PROMPT + plain.choices[0].text
            and text_echo.choices[0].logprobs is None)


def test_streaming_completion(complete):
    plain = complete(prompt=PROMPT, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    chunks = list(complete(prompt=PROMPT, max_tokens=12, temperature=0, stream=True, logprobs=2,
                           stream_options={"include_usage": True},
                           extra_body={"ignore_eos": True}))
    text_chunks, usage_chunk = chunks[:-1], chunks[-1]
    assert len(text_chunks) == 12  # one chunk per generated token
    assert "".join(c.choices[0].text for c in text_chunks) == plain.choices[0].text
    assert [c.choices[0].finish_reason for c in text_chunks] == [None] * 11 + ["length"]
    assert all(len(c.choices[0].logprobs.tokens) == 1 for c in text_chunks)
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == 12
    echoed = list(complete(prompt=PROMPT, max_tokens=0, echo=True, logprobs=1, stream=True))
    assert (echoed[0].choices[0].text == PROMPT
            and echoed[0].choices[0].logprobs.token_logprobs[0] is None)
    assert echoed[-1].choices[0].finish_reason == "length" and len(echoed) == 2


def test_chat(chat):
    messages = [{"role": "system", "content": "You write Python."},
                {"role": "user", "content": "sort a list"}]
    out = chat(messages=messages, max_tokens=10, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert out.object == "chat.completion" and out.choices[0].message.role == "assistant"
    assert out.usage.completion_tokens == 10 and out.choices[0].finish_reason == "length"
    same = chat(messages=messages, max_completion_tokens=10, temperature=0,
                                          extra_body={"ignore_eos": True})
    assert same.choices[0].message.content == out.choices[0].message.content
    parts = chat(
        messages=[messages[0], {"role": "user", "content": [{"type": "text", "text": "sort "},
                                                            {"type": "text", "text": "a list"}]}],
        max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    assert parts.choices[0].message.content == out.choices[0].message.content


def test_chat_logprobs_and_stream(chat):
    messages = [{"role": "user", "content": "def add(a, b):"}]
    out = chat(messages=messages, max_tokens=5, temperature=0, logprobs=True,
                                         top_logprobs=3, extra_body={"ignore_eos": True})
    content = out.choices[0].logprobs.content
    assert len(content) == 5 and "".join(t.token for t in content) == out.choices[0].message.content
    for t in content:
        assert len(t.top_logprobs) == 3 and t.top_logprobs[0].logprob == t.logprob
        assert bytes(t.bytes).decode() == t.token
    chunks = list(chat(messages=messages, max_tokens=5, temperature=0, stream=True, n=2,
                                                 stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    roles = [c for c in chunks if c.choices and c.choices[0].delta.role == "assistant"]
    assert len(roles) == 2
    for index in (0, 1):
        text = "".join(c.choices[0].delta.content or "" for c in chunks
                       if c.choices and c.choices[0].index == index)
        assert text == out.choices[0].message.content
    assert (chunks[-1].usage.completion_tokens == 10
            and chunks[-1].usage.total_tokens == 10 + out.usage.prompt_tokens)
