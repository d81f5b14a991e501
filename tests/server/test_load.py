"""Concurrency against the shared server: 64 simultaneous streaming clients, and clients that leave
mid-request (streaming or not) get their engine requests aborted and their KV blocks freed."""
from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from server_process import MAX_MODEL_LEN

NUM_CLIENTS = 64
MAX_TOKENS = 16
LONG = MAX_MODEL_LEN - 100  # far more tokens than a test ever waits for


def test_64_concurrent_streaming_clients(server, model_name):
    before = server.metrics()

    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[int, int, str]:
        kwargs = dict(model=model_name, max_tokens=MAX_TOKENS, temperature=0.0 if i % 2 else 0.8,
                      seed=i, stream=True, stream_options={"include_usage": True},
                      extra_body={"ignore_eos": True})
        if i % 4 == 3:
            stream = await client.chat.completions.create(
                messages=[{"role": "user", "content": f"task {i}"}], **kwargs)
            chunks = [c async for c in stream]
            content = [c for c in chunks if c.choices and c.choices[0].delta.role is None]
            finish = content[-1].choices[0].finish_reason
        else:
            stream = await client.completions.create(prompt=f"def task_{i}(x):", **kwargs)
            chunks = [c async for c in stream]
            content = [c for c in chunks if c.choices]
            finish = content[-1].choices[0].finish_reason
        assert finish == "length"
        return len(content), chunks[-1].usage.completion_tokens, finish

    async def run_all():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0,
                                      timeout=120) as client:
            return await asyncio.gather(*(one(client, i) for i in range(NUM_CLIENTS)),
                                        return_exceptions=True)

    start = time.perf_counter()
    results = asyncio.run(run_all())
    wall = time.perf_counter() - start
    errors = [r for r in results if isinstance(r, BaseException)]
    print(f"\nload: {NUM_CLIENTS} streaming requests, concurrency {NUM_CLIENTS}, "
          f"{len(errors)} errors, {wall:.2f}s wall, "
          f"{NUM_CLIENTS * MAX_TOKENS / wall:.0f} generated tok/s")
    assert not errors, errors[:3]
    assert all(r == (MAX_TOKENS, MAX_TOKENS, "length") for r in results), results
    after = server.wait_idle()
    assert (after["oasiskv_generation_tokens_total"] - before["oasiskv_generation_tokens_total"]
            == NUM_CLIENTS * MAX_TOKENS)
    assert (after["oasiskv_e2e_request_latency_seconds_count"]
            - before["oasiskv_e2e_request_latency_seconds_count"] == NUM_CLIENTS)


def _generated(server) -> float:
    return server.metrics()["oasiskv_generation_tokens_total"]


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_client_killed_mid_stream_frees_its_blocks(server, endpoint):
    server.wait_idle()
    body = {"max_tokens": LONG, "ignore_eos": True, "stream": True}
    body.update({"prompt": "def f(x):"} if endpoint == "/v1/completions" else
                {"messages": [{"role": "user", "content": "go"}]})
    start = _generated(server)
    with httpx.Client(base_url=server.url, timeout=30) as http:
        with http.stream("POST", endpoint, json=body) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()
            for _ in range(10):
                assert next(lines).startswith("data: ")
                next(lines)  # blank separator
            m = server.metrics()
            assert m["oasiskv_num_requests_running"] == 1 and m["oasiskv_kv_blocks_used"] > 0
    # the connection is closed: the request must be aborted long before it could finish
    server.wait_idle(timeout=10)
    assert _generated(server) - start < LONG / 2


def test_client_gone_before_non_streaming_answer_frees_its_blocks(server):
    server.wait_idle()
    start = _generated(server)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", timeout=httpx.Timeout(30, read=0.5),
                   json={"prompt": "def g(y):", "max_tokens": LONG, "ignore_eos": True})
    server.wait_idle(timeout=10)
    assert _generated(server) - start < LONG / 2
