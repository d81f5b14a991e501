"""Disaggregated serving (``oasiskv serve --role prefill|decode``), real processes: two prefill
workers and a decode worker serving the fixture target, the prompt KV moved by real NIXL agents
(UCX on loopback), the control messages over HTTP.

With K covering every block, the decode worker answers token for token as a single-node server; it
reads exactly the complete prompt blocks it did not hold (counted in bytes on /metrics, against
sizes computed here, and on its bandwidth timeline), and none of a prefix it already holds; a
killed prefill worker is marked down and its prompts go to the other one; with none left a long
prompt gets an OpenAI-shaped 503 while a prompt shorter than a block (nothing to move) is still
served, and the decode worker stays up. A
prefill worker that never answers holds up only the prompt sent to it, until its deadline: then it
is marked down, the prompt goes to the other worker, and a stream running meanwhile never stops.
A prefill worker paused with SIGSTOP (UCX on TCP only) stalls only the decode-host cache's request
whose evicted blocks it holds, which then ends with the tokens of a decode worker keeping every
block, while a stream with nothing there goes on. A prefill or memory worker killed mid-decode
ends exactly the requests of a decode-host cache whose evicted blocks it held (a 500, or an
OpenAI-shaped error event and then ``[DONE]`` on a stream); the others go on with the single-node
tokens, no block, host row or working-set slot stays held, and a memory worker found dead is not
offloaded to again."""
import json
import random
import shutil
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.server.server_process import ServerProcess

pytest.importorskip("nixl_cu13", reason="disaggregated serving needs NIXL: pip install "
                    "'oasiskv[pd]' (x86-64 Linux wheels)")

BLOCK = 16
FLAGS = ("--dtype", "float32", "--kv-mode", "oasis", "--topk-blocks", "64", "--fetch-ratio",
         "1.0", "--host-kv-gib", "0.02", "--block-size", str(BLOCK))


def complete(server: ServerProcess, ids: list[int], max_tokens: int = 16) -> httpx.Response:
    return httpx.post(server.url + "/v1/completions", timeout=120,
                      json={"prompt": ids, "max_tokens": max_tokens, "temperature": 0,
                            "ignore_eos": True, "logprobs": 1})


def answer(resp: httpx.Response) -> tuple[str, list[str]]:
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    return choice["text"], choice["logprobs"]["tokens"]


def pd_metrics(server: ServerProcess) -> dict[str, float]:
    """/metrics samples by name, the labelled ones (per prefill worker) summed."""
    totals: dict[str, float] = {}
    for line in httpx.get(server.url + "/metrics", timeout=5).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.split("{")[0].split()[0], float(line.split()[-1])
            totals[name] = totals.get(name, 0.0) + value
    return totals


def timeline(server: ServerProcess, start: float | None = None) -> dict:
    """A decode worker's bandwidth timeline (``GET /v1/kv/timeline``), from ``start`` (its clock)
    to now when given."""
    resp = httpx.get(server.url + "/v1/kv/timeline", timeout=5,
                     params={} if start is None else {"start": start})
    assert resp.status_code == 200, resp.text
    return resp.json()


def assert_timeline_holds(server: ServerProcess, start: float, nixl_bytes: float) -> None:
    """Every byte the decode worker's counters say it read over NIXL is on its timeline, in the
    bins since ``start`` (one for each ``bin_s`` up to now, idle ones included)."""
    t = timeline(server, start)
    assert t["bytes_total"] == pytest.approx(nixl_bytes) and nixl_bytes > 0
    assert t["bytes"] == pytest.approx(nixl_bytes) and sum(t["bins"]) == pytest.approx(t["bytes"])
    assert t["start"] - 1e-9 <= start < t["start"] + t["bin_s"]
    assert abs(len(t["bins"]) - (t["now"] - start) / t["bin_s"]) <= 2
    assert min(t["bins"]) == 0.0 and max(t["bins"]) > 0  # (idle between reads)


def block_bytes(fixtures_path) -> int:
    """K and V of one host block, every layer and kv head, float32."""
    cfg = json.loads((fixtures_path / "target" / "config.json").read_text())
    return 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * BLOCK * cfg["head_dim"] * 4


def test_prefill_and_decode_workers_serve_the_single_node_tokens(tmp_path, fixtures_path):
    target = str(fixtures_path / "target")
    rng = random.Random(3)
    base = [rng.randrange(5, 4000) for _ in range(150)]
    prompts = [base, base + [rng.randrange(5, 4000) for _ in range(70)],  # shares 9 blocks
               [rng.randrange(5, 4000) for _ in range(97)],
               [rng.randrange(5, 4000) for _ in range(33)]]
    servers = []
    try:
        single = ServerProcess(tmp_path / "single.log", target, *FLAGS)
        servers.append(single)
        want = [answer(complete(single, ids)) for ids in prompts]
        a = ServerProcess(tmp_path / "prefill-a.log", target, *FLAGS, "--role", "prefill")
        b = ServerProcess(tmp_path / "prefill-b.log", target, *FLAGS, "--role", "prefill")
        servers += [a, b]
        decode = ServerProcess(tmp_path / "decode.log", target, *FLAGS, "--role", "decode",
                               "--prefill-url", a.url, "--prefill-url", b.url,
                               "--local-prefill-blocks", "1")
        servers.append(decode)
        since = timeline(decode)["now"]
        got = [answer(complete(decode, ids)) for ids in prompts[:1]]  # the shared prefix first
        with ThreadPoolExecutor(3) as pool:
            got += [answer(r) for r in pool.map(lambda ids: complete(decode, ids), prompts[1:])]
        assert got == want

        # bytes read = the complete blocks before each prompt's last token, the shared 9 once
        blocks = [(len(ids) - 1) // BLOCK for ids in prompts]
        assert blocks == [9, 13, 6, 2]
        m = pd_metrics(decode)
        assert m["oasiskv_pd_blocks_reused_total"] == 9
        assert m["oasiskv_pd_blocks_imported_total"] == sum(blocks) - 9
        assert m["oasiskv_pd_admission_bytes_total"] == (sum(blocks) - 9) * block_bytes(
            fixtures_path)
        assert m["oasiskv_pd_remote_reads_total"] == 4 and (
            m["oasiskv_pd_remote_read_failures_total"] == 0)
        assert m["oasiskv_pd_remote_read_seconds_count"] == 4
        assert m["oasiskv_pd_remote_prefill_seconds_count"] == 4
        assert_timeline_holds(decode, since, m["oasiskv_pd_admission_bytes_total"])
        # the prefill workers split the prompts and released every lease
        exported = [s.metrics() for s in (a, b)]
        assert sum(e["oasiskv_pd_blocks_exported_total"] for e in exported) == sum(blocks)
        assert all(e["oasiskv_pd_leases"] == 0 for e in exported)
        assert decode.wait_idle()["oasiskv_num_requests_running"] == 0

        # at most one complete block not held here: prefilled here, no prefill worker asked. A
        # repeated prompt (all 9 held), and one that goes on past it (its 10th block is new)
        again = prompts[0] + [rng.randrange(5, 4000) for _ in range(20)]
        assert answer(complete(decode, prompts[0])) == want[0]
        assert answer(complete(decode, again)) == answer(complete(single, again))
        m = pd_metrics(decode)
        assert m["oasiskv_pd_local_prefills_total"] == 2
        assert m["oasiskv_pd_remote_prefill_seconds_count"] == 4

        # a dead prefill worker: marked down, its prompts go to the other one
        a.stop(signal.SIGKILL)
        fresh = [rng.randrange(5, 4000) for _ in range(60)]
        assert answer(complete(decode, fresh)) == answer(complete(single, fresh))
        assert answer(complete(decode, fresh[::-1]))[0] == answer(complete(single, fresh[::-1]))[0]
        text = httpx.get(decode.url + "/metrics").text
        assert f'oasiskv_pd_prefill_worker_up{{url="{a.url}"}} 0.0' in text
        assert f'oasiskv_pd_prefill_worker_up{{url="{b.url}"}} 1.0' in text

        # none left: a long prompt gets a clear 503, one shorter than a block is still served
        b.stop(signal.SIGKILL)
        resp = complete(decode, [rng.randrange(5, 4000) for _ in range(80)])
        assert resp.status_code == 503, resp.text
        error = resp.json()["error"]
        assert error["code"] == "prefill_unavailable" and "prefill worker" in error["message"]
        short = [7, 8, 9, 10, 11]
        assert answer(complete(decode, short)) == answer(complete(single, short))
        assert httpx.get(decode.url + "/health").status_code == 200
        assert decode.wait_idle()["oasiskv_kv_blocks_free"] > 0
    finally:
        for s in servers:
            s.stop()
    assert "Traceback" not in (tmp_path / "decode.log").read_text()


@pytest.fixture
def launch(tmp_path, fixtures_path):
    """``launch(name, *flags, env=None, model=None)``: a server of ``model`` (default: the
    fixture target) with FLAGS and ``flags`` (and the variables ``env`` in its environment),
    logging to ``tmp_path / name.log``; every one is stopped at the end."""
    started = []

    def start(name: str, *flags: str, env: dict | None = None, model=None) -> ServerProcess:
        started.append(ServerProcess(tmp_path / f"{name}.log",
                                     str(model or fixtures_path / "target"), *FLAGS, *flags,
                                     env=env))
        return started[-1]

    yield start
    for server in started:
        server.stop()


def cache_reads_ended(server: ServerProcess) -> bool:
    """Whether every decode-host cache read a decode worker started has landed or failed."""
    m = pd_metrics(server)
    return m["oasiskv_pd_cache_reads_total"] == (m["oasiskv_pd_cache_read_seconds_count"]
                                                 + m["oasiskv_pd_cache_read_failures_total"])


def released(server: ServerProcess, timeout: float = 10.0) -> bool:
    """Whether ``server`` (a prefill or memory worker) holds no lease within ``timeout`` (decode
    workers release in the background)."""
    deadline = time.monotonic() + timeout
    while server.metrics()["oasiskv_pd_leases"] and time.monotonic() < deadline:
        time.sleep(0.05)
    return server.metrics()["oasiskv_pd_leases"] == 0


def test_a_prefill_worker_offloads_to_a_memory_worker(launch, tmp_path, fixtures_path):
    """A prefill worker whose host store runs short (here always: --offload-below-blocks above
    its size) hands each prompt's blocks to a memory worker, which reads them over NIXL and serves
    them to the decode worker: the single-node tokens, the blocks counted on every side, every
    lease released. A prompt sharing a prefix with one offloaded before: the memory worker reads
    only the rest. Another prefill worker reads such a prefix from the memory worker instead of
    prefilling it. With the memory worker gone, the prefill worker keeps the blocks and serves
    them itself. The memory worker runs no model: given only the model's config.json, it stores
    the same layout and serves no completions."""
    rng = random.Random(5)
    base = [rng.randrange(5, 4000) for _ in range(150)]
    prompts = [base, base + [rng.randrange(5, 4000) for _ in range(70)]]  # 9 and 13 blocks
    single = launch("single")
    want = [answer(complete(single, ids)) for ids in prompts]
    shape = tmp_path / "shape"  # a memory worker reads the model's shape, never its weights
    shape.mkdir()
    shutil.copy(fixtures_path / "target" / "config.json", shape)
    memory = launch("memory", "--role", "memory", model=shape)
    assert "oasiskv_num_requests_running" not in memory.metrics()  # (no engine)
    refused = httpx.post(memory.url + "/v1/completions", json={"prompt": [5, 6], "max_tokens": 1})
    assert refused.status_code == 404 and "no route" in refused.json()["error"]["message"]
    prefill = launch("prefill", "--role", "prefill", "--memory-url", memory.url,
                     "--offload-below-blocks", "1000000")
    decode = launch("decode", "--role", "decode", "--prefill-url", prefill.url)
    assert [answer(complete(decode, ids)) for ids in prompts] == want

    assert released(memory) and released(prefill)
    m, p, d = pd_metrics(memory), pd_metrics(prefill), pd_metrics(decode)
    assert p["oasiskv_pd_blocks_offloaded_total"] == 9 + 13
    assert p["oasiskv_pd_blocks_exported_total"] == 0  # no lease of its own
    assert m["oasiskv_pd_blocks_stored_total"] == 13  # the second prompt's first 9 were kept
    assert m["oasiskv_pd_blocks_kept_total"] == 9
    # its store: every block free again, the 13 named ones (9 shared) still cached (float32)
    total = int(0.02 * 2**30) // block_bytes(fixtures_path)
    assert (m["oasiskv_pd_store_blocks_total"], m["oasiskv_pd_store_blocks_free"],
            m["oasiskv_pd_store_blocks_cached"]) == (total, total, 13)
    # (and 9 offered to the prefill worker's lookup for the second prompt: it held them already)
    assert m["oasiskv_pd_blocks_exported_total"] == 9 + 13 + 9
    assert d["oasiskv_pd_blocks_imported_total"] == 13  # (9 of the second held already)
    assert d["oasiskv_pd_blocks_reused_total"] == 9
    assert d["oasiskv_pd_admission_bytes_total"] == 13 * block_bytes(fixtures_path)
    body = httpx.get(decode.url + "/metrics").text
    assert f'oasiskv_pd_remote_reads_total{{worker="{memory.url}"}} 2.0' in body
    # bad offers: clear 400s, nothing held
    from tests.server.server_process import assert_openai_error
    ids = list(range(5, 30))  # one complete block before its last token
    source = httpx.get(prefill.url + "/v1/kv/descriptor").json()["descriptor"]
    for offer, param in [({"descriptor": "bm90IGpzb24=", "blocks": [0]}, "descriptor"),
                         ({"descriptor": source, "blocks": [0, 1]}, "blocks"),
                         ({"descriptor": source, "blocks": [-1]}, "blocks"),
                         ({"descriptor": source, "blocks": [10**9]}, "blocks")]:
        resp = httpx.post(memory.url + "/v1/kv/offload", json={**offer, "prompt_token_ids": ids})
        assert_openai_error(resp, 400, param)
    assert memory.metrics()["oasiskv_pd_leases"] == 0

    # a prefill worker with an empty prefix cache reads a prefix the memory worker holds (13
    # blocks) instead of prefilling it, and prefills only the rest; its KV gives the same tokens
    reader = launch("prefill-2", "--role", "prefill", "--memory-url", memory.url,
                    "--offload-below-blocks", "0")  # (never offloads)
    longer = prompts[1] + [rng.randrange(5, 4000) for _ in range(30)]
    held = httpx.post(reader.url + "/v1/kv/prefill", json={"prompt_token_ids": longer},
                      timeout=120).json()
    assert len(held["blocks"]) == (len(longer) - 1) // BLOCK and "worker" not in held
    httpx.post(reader.url + "/v1/kv/release", json={"lease": held["lease"]})
    r = pd_metrics(reader)
    assert r["oasiskv_pd_prefix_blocks_fetched_total"] == 13
    assert r["oasiskv_prompt_tokens_total"] == len(longer) - 13 * BLOCK
    assert answer(complete(reader, longer)) == answer(complete(single, longer))
    assert released(memory) and released(reader)

    memory.stop(signal.SIGKILL)
    fresh = [rng.randrange(5, 4000) for _ in range(60)]
    assert answer(complete(decode, fresh)) == answer(complete(single, fresh))
    assert released(prefill)
    p, d = pd_metrics(prefill), pd_metrics(decode)
    assert p["oasiskv_pd_blocks_offloaded_total"] == 9 + 13
    assert p["oasiskv_pd_blocks_exported_total"] == 59 // BLOCK
    assert d["oasiskv_pd_blocks_imported_total"] == 13 + 59 // BLOCK
    assert decode.wait_idle()["oasiskv_num_requests_running"] == 0
    for name in ("decode", "prefill"):
        assert "Traceback" not in (tmp_path / f"{name}.log").read_text()


def test_a_silent_prefill_worker_stalls_only_its_prompt(tmp_path, fixtures_path):
    target = str(fixtures_path / "target")
    silent = socket.socket()  # accepts connections (the kernel's backlog), never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    silent_url = f"http://127.0.0.1:{silent.getsockname()[1]}"
    servers = []
    try:
        real = ServerProcess(tmp_path / "prefill.log", target, *FLAGS, "--role", "prefill")
        servers.append(real)
        decode = ServerProcess(tmp_path / "decode.log", target, *FLAGS, "--role", "decode",
                               "--prefill-url", silent_url, "--prefill-url", real.url,
                               "--remote-timeout", "3")
        servers.append(decode)
        arrivals: list[float] = []
        done = threading.Event()
        # a short prompt: admitted at once, decoding until told to stop
        streaming = threading.Thread(target=stream, args=(decode, [5, 6, 7], 2000, arrivals, [],
                                                          done))
        streaming.start()
        until(lambda: len(arrivals) >= 5)
        start = time.monotonic()
        ids = random.Random(9).sample(range(5, 4000), 90)
        text, _ = answer(complete(decode, ids))  # tried on the silent worker first
        held = time.monotonic() - start
        assert held >= 3.0  # it waited for the silent worker's deadline
        done.set()
        streaming.join()
        during = [t for t in arrivals if start <= t <= start + held]
        gaps = [b - a for a, b in zip(during, during[1:])]
        assert len(during) > 20 and max(gaps) < 1.5, (len(during), max(gaps, default=None))
        m = pd_metrics(decode)  # its KV came from the real worker
        assert m["oasiskv_pd_blocks_imported_total"] == (len(ids) - 1) // BLOCK
        # its time to first token counts the wait for its KV (the stream was aborted: not counted)
        assert m["oasiskv_time_to_first_token_seconds_count"] == 1
        assert m["oasiskv_time_to_first_token_seconds_sum"] >= 3.0
        body = httpx.get(decode.url + "/metrics").text
        assert f'oasiskv_pd_prefill_worker_up{{url="{silent_url}"}} 0.0' in body

        # a prompt that extends it: the prefill worker prefills only what follows the 5 complete
        # blocks it has cached (their summaries with them), the decode worker reads only the rest
        longer = ids + random.Random(10).sample(range(5, 4000), 40)
        before = pd_metrics(real)["oasiskv_prompt_tokens_total"]
        assert answer(complete(decode, longer))[0] == answer(complete(real, longer))[0]
        after = pd_metrics(real)["oasiskv_prompt_tokens_total"]
        shared = (len(ids) - 1) // BLOCK * BLOCK
        # (its own answer above prefilled the whole prompt's last block again: cached but the last)
        assert after - before == (len(longer) - shared) + (len(longer) - (len(longer) - 1)
                                                           // BLOCK * BLOCK)
        m = pd_metrics(decode)
        assert m["oasiskv_pd_blocks_reused_total"] == (len(ids) - 1) // BLOCK
        assert text == answer(complete(real, ids))[0]  # (a prefill worker serves the API too)
    finally:
        for s in servers:
            s.stop()
        silent.close()


def test_roles_refuse_what_they_cannot_do(tmp_path, fixtures_path):
    target = str(fixtures_path / "target")
    for flags, message in [(("--role", "decode"), "needs at least one --prefill-url"),
                           (("--role", "prefill", "--kv-mode", "dense"), "kv-mode oasis"),
                           (("--role", "memory", "--kv-mode", "dense"), "kv-mode oasis"),
                           (("--prefill-url", "http://127.0.0.1:1"), "is for --role decode"),
                           (("--memory-url", "http://127.0.0.1:1"), "is for --role prefill"),
                           (("--role", "prefill", "--offload-below-blocks", "4"),
                            "needs a --memory-url"),
                           (("--kv-mode", "oasis", "--role", "decode", "--prefill-url",
                             "http://127.0.0.1:1", "--emulated-host-gib", "1"),
                            "emulates the tiered host store of one node or a prefill worker"),
                           (("--emulated-host-gib", "1"),
                            "--role both or prefill, --kv-mode oasis")]:
        with pytest.raises(RuntimeError, match=message):
            ServerProcess(tmp_path / "bad.log", target, "--dtype", "float32", *flags)


def test_a_prefill_worker_bounds_its_leases(tmp_path, fixtures_path):
    """Held prompt blocks are host memory: at most --max-waiting leases at once (an OpenAI-shaped
    503 beyond), released ones free their place; a bad prompt is a 400."""
    from tests.server.server_process import assert_openai_error
    worker = ServerProcess(tmp_path / "prefill.log", str(fixtures_path / "target"), *FLAGS,
                           "--role", "prefill", "--max-waiting", "1")
    try:
        ids = list(range(5, 60))
        first = httpx.post(worker.url + "/v1/kv/prefill", json={"prompt_token_ids": ids},
                           timeout=60)
        assert first.status_code == 200 and len(first.json()["blocks"]) == 54 // BLOCK
        second = httpx.post(worker.url + "/v1/kv/prefill", json={"prompt_token_ids": ids},
                            timeout=60)
        assert assert_openai_error(second, 503)["code"] == "overloaded"
        assert second.headers["retry-after"] == "1"
        released = httpx.post(worker.url + "/v1/kv/release", json={"lease": first.json()["lease"]})
        assert released.json() == {"released": True}
        third = httpx.post(worker.url + "/v1/kv/prefill", json={"prompt_token_ids": ids},
                           timeout=60)
        assert third.status_code == 200 and third.json()["blocks"] == first.json()["blocks"]
        assert worker.metrics()["oasiskv_pd_leases"] == 1
        bad = httpx.post(worker.url + "/v1/kv/prefill", json={"prompt_token_ids": [10**9]})
        assert_openai_error(bad, 400, "prompt")
    finally:
        worker.stop()


def test_a_busy_or_refusing_prefill_worker_is_not_marked_down(tmp_path, fixtures_path):
    """A prefill worker at its lease bound answers 503: the decode worker says overloaded (503,
    Retry-After) and keeps the worker up, and serves again once a lease is released. A worker
    that refuses the decode worker's API key is a configuration error: 502, not a down worker."""
    target = str(fixtures_path / "target")
    key = {"Authorization": "Bearer k1"}
    servers = []
    try:
        prefill = ServerProcess(tmp_path / "prefill.log", target, *FLAGS, "--role", "prefill",
                                "--max-waiting", "1", "--api-key", "k1")
        servers.append(prefill)
        decode = ServerProcess(tmp_path / "decode.log", target, *FLAGS, "--role", "decode",
                               "--prefill-url", prefill.url, "--api-key", "k1")
        wrong = ServerProcess(tmp_path / "wrong.log", target, *FLAGS, "--role", "decode",
                              "--prefill-url", prefill.url, "--api-key", "k2")
        servers += [decode, wrong]
        ids = list(range(5, 70))
        held = httpx.post(prefill.url + "/v1/kv/prefill", json={"prompt_token_ids": ids},
                          headers=key, timeout=60).json()["lease"]
        body = {"prompt": ids, "max_tokens": 4, "temperature": 0}
        busy = httpx.post(decode.url + "/v1/completions", json=body, headers=key, timeout=60)
        assert busy.status_code == 503 and busy.json()["error"]["code"] == "overloaded"
        assert busy.headers["retry-after"] == "1"
        up = f'oasiskv_pd_prefill_worker_up{{url="{prefill.url}"}} 1.0'
        assert up in httpx.get(decode.url + "/metrics").text
        httpx.post(prefill.url + "/v1/kv/release", json={"lease": held}, headers=key)
        assert httpx.post(decode.url + "/v1/completions", json=body, headers=key,
                          timeout=60).status_code == 200
        refused = httpx.post(wrong.url + "/v1/completions", json=body,
                             headers={"Authorization": "Bearer k2"}, timeout=60)
        assert refused.status_code == 502, refused.text
        assert refused.json()["error"]["code"] == "prefill_refused"
        assert "HTTP 401" in refused.json()["error"]["message"]
        assert f'oasiskv_pd_prefill_worker_up{{url="{prefill.url}"}} 1.0' in httpx.get(
            wrong.url + "/metrics").text
    finally:
        for s in servers:
            s.stop()


def streamed(server: ServerProcess, ids: list[int], max_tokens: int) -> tuple[list[str],
                                                                             dict | None]:
    """A streamed completion of ``ids``, read to its end: its tokens and its error (None when it
    finished). A stream is its chunks, an OpenAI-shaped error event after them when it failed
    (then no chunk says why it finished), and ``data: [DONE]`` last."""
    with httpx.stream("POST", server.url + "/v1/completions", timeout=120,
                      json={"prompt": ids, "max_tokens": max_tokens, "temperature": 0,
                            "ignore_eos": True, "logprobs": 1, "stream": True}) as resp:
        assert resp.status_code == 200, resp.read()
        events = [line.removeprefix("data: ") for line in resp.iter_lines() if line]
    assert events and events[-1] == "[DONE]" and "[DONE]" not in events[:-1], events[-3:]
    chunks = [json.loads(e) for e in events[:-1]]
    error = chunks.pop()["error"] if chunks and "error" in chunks[-1] else None
    assert all("error" not in c for c in chunks)
    reasons = [c["choices"][0]["finish_reason"] for c in chunks]
    if error is None:
        assert reasons[-1] == "length" and not any(reasons[:-1]), reasons
    else:
        assert set(error) == {"message", "type", "param", "code"} and not any(reasons), reasons
    return [t for c in chunks for t in c["choices"][0]["logprobs"]["tokens"]], error


def assert_kv_lost(error: dict, worker: ServerProcess) -> None:
    """``error`` (a 500's, or a stream's error event) ends a request whose KV blocks could not
    be read from ``worker`` (named in it)."""
    assert error["type"] == "server_error", error
    assert "KV blocks" in error["message"] and worker.url in error["message"], error


def assert_both_lost_kv(doomed, doomed_stream, worker: ServerProcess) -> None:
    """The futures of a plain and a streamed request whose KV ``worker`` held: a 500, and a
    stream that ended on an error event, each naming ``worker`` (``assert_kv_lost``)."""
    resp = doomed.result()
    assert resp.status_code == 500, resp.text
    assert_kv_lost(resp.json()["error"], worker)
    tokens, error = doomed_stream.result()
    assert error is not None, len(tokens)
    assert_kv_lost(error, worker)


def labelled(server: ServerProcess, name: str, worker: ServerProcess) -> float:
    """The sample of ``name`` labelled with ``worker``'s URL on ``server``'s /metrics (0 when
    there is none yet)."""
    for line in httpx.get(server.url + "/metrics", timeout=5).text.splitlines():
        if line.startswith(f'{name}{{worker="{worker.url}"}} '):
            return float(line.split()[-1])
    return 0.0


def kill_mid_decode(decode: ServerProcess, reference: ServerProcess, prefill: ServerProcess,
                    rng: random.Random) -> None:
    """Two long prompts through ``decode`` (whose blocks ``prefill`` holds), one answered whole
    and one streamed, and a short one (less than a block: nothing there) run; ``prefill`` is
    killed: the long ones end with an error naming it once they need a block only it had (a
    500; on the stream an error event, then ``[DONE]``), the short one ends as on ``reference``,
    and ``decode`` stays up with no request running, every block free and no host row given
    up."""
    fresh = [[rng.randrange(5, 4000) for _ in range(1000)] for _ in range(2)]
    short = [7, 8, 9, 10, 11]
    want_short = answer(complete(reference, short, 600))
    rows = pd_metrics(decode)["oasiskv_pd_cache_rows"]
    with ThreadPoolExecutor(3) as pool:
        doomed = pool.submit(complete, decode, fresh[0], 900)
        doomed_stream = pool.submit(streamed, decode, fresh[1], 900)
        alive = pool.submit(complete, decode, short, 600)
        until(lambda: decode.metrics()["oasiskv_num_requests_running"] == 3)
        prefill.stop(signal.SIGKILL)
        assert_both_lost_kv(doomed, doomed_stream, prefill)
        assert answer(alive.result()) == want_short
    m = pd_metrics(decode)
    assert m["oasiskv_pd_cache_read_failures_total"] > 0
    assert m["oasiskv_pd_cache_rows"] == rows
    assert decode.wait_idle()["oasiskv_num_requests_running"] == 0


def test_a_bounded_decode_host_reads_evicted_blocks_again(launch, fixtures_path):
    """--f-host 0.25: a decode worker keeps a quarter of each prompt's blocks (and what it
    generates) in host memory and reads evicted ones again from the prefill worker over NIXL when
    a selection wants them. It answers as a decode worker that keeps every block (same import, K
    = 2, so selections move); its reads, misses and evictions are on /metrics, the reads in
    units of a layer of a block, as selections want them; its leases are held while the requests
    run and released after. It never waits for a read (--remote-stall-ms 0), and none is seen
    complete sooner than 100 ms after its start (--emulated-read-latency-ms: on one host UCX
    reads the prefill worker's memory directly, mostly by the first poll): a request whose blocks
    are still being read sits out steps until they land. When the prefill worker dies
    mid-decode, the requests whose blocks it held end with an error once they need one of them
    again; a request with nothing there goes on to its last token, and the decode worker stays up
    with every block free."""
    rng = random.Random(9)
    prompts = [[rng.randrange(5, 4000) for _ in range(1000)] for _ in range(3)]
    flags = ("--topk-blocks", "2", "--draft", "ngram", "--host-kv-gib", "0.05")
    prefill = launch("prefill", *flags, "--role", "prefill")
    full = launch("decode-full", *flags, "--role", "decode", "--prefill-url", prefill.url)
    cache = launch("decode-cache", *flags, "--role", "decode", "--prefill-url", prefill.url,
                   "--f-host", "0.25", "--remote-stall-ms", "0",
                   "--emulated-read-latency-ms", "100")
    want = [answer(complete(full, ids, 48)) for ids in prompts]
    assert released(prefill)
    with ThreadPoolExecutor(3) as pool:
        got = [answer(r) for r in pool.map(lambda ids: complete(cache, ids, 48), prompts)]
    assert got == want
    # (a read whose request ended first lands while the engine idles)
    until(lambda: cache_reads_ended(cache), timeout=10.0)
    m = pd_metrics(cache)
    assert m["oasiskv_pd_cache_evictions_total"] > 0 and m["oasiskv_pd_cache_misses_total"] > 0
    assert m["oasiskv_pd_cache_hits_total"] > 0
    # (a read is polled once right after it starts, 100 ms before it may be seen complete)
    assert m["oasiskv_pd_cache_deferred_reads_total"] > 0
    # read again per (block, layer) unit a selection wanted: at most the whole blocks
    layers = json.loads((fixtures_path / "target" / "config.json").read_text())[
        "num_hidden_layers"]
    read, unit = m["oasiskv_pd_cache_read_bytes_total"], block_bytes(fixtures_path) // layers
    assert 0 < read < m["oasiskv_pd_cache_misses_total"] * block_bytes(fixtures_path)
    assert read % unit == 0
    assert m["oasiskv_pd_cache_read_seconds_count"] > 0
    assert m["oasiskv_pd_cache_read_failures_total"] == 0
    assert 0 < m["oasiskv_pd_cache_rows_in_use"] <= m["oasiskv_pd_cache_rows"]
    assert released(prefill)

    kill_mid_decode(cache, full, prefill, rng)


def until(condition, timeout: float = 60.0) -> None:
    """Poll ``condition`` until it holds; fails past ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def stream(server: ServerProcess, ids: list[int], max_tokens: int, arrivals: list[float],
           tokens: list[str], stop: threading.Event | None = None) -> None:
    """A streamed completion of ``ids``: each chunk's arrival time into ``arrivals``, its tokens
    into ``tokens``; until its last token, or the first chunk after ``stop`` is set."""
    with httpx.stream("POST", server.url + "/v1/completions", timeout=120,
                      json={"prompt": ids, "max_tokens": max_tokens, "temperature": 0,
                            "ignore_eos": True, "logprobs": 1, "stream": True}) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                arrivals.append(time.monotonic())
                tokens += json.loads(line[len("data: "):])["choices"][0]["logprobs"]["tokens"]
            if stop is not None and stop.is_set():
                break


def stopped(server: ServerProcess) -> bool:
    """Whether ``server``'s process is stopped (a SIGSTOP took effect)."""
    stat = Path(f"/proc/{server.proc.pid}/stat").read_text()
    return stat.rsplit(")", 1)[1].split()[0] == "T"  # (the state follows the command's name)


def test_a_slow_remote_stalls_only_the_requests_that_read_from_it(launch, tmp_path):
    """A prefill worker paused (SIGSTOP) for a few seconds serves no NIXL read meanwhile: UCX on
    TCP only, whose one-sided reads need the serving process's progress (a shared-memory
    transport reads a stopped process's memory without it). A decode worker with a decode-host
    cache (--f-host 0.25, --remote-stall-ms 0) reads evicted blocks of a long prompt again from
    it: that request stalls for most of the pause, then ends with the tokens of a decode worker
    that keeps every block; a stream of a prompt shorter than a block (nothing there) goes on
    through the same decode worker all along. The pause is within the reads' deadline
    (--remote-timeout 30): no read fails, the reads were deferred, nothing is left running."""
    pause = 5.0
    tcp = {"UCX_TLS": "tcp"}
    flags = ("--topk-blocks", "2", "--draft", "ngram", "--host-kv-gib", "0.05")
    prefill = launch("prefill", *flags, "--role", "prefill", env=tcp)
    full = launch("decode-full", *flags, "--role", "decode", "--prefill-url", prefill.url,
                  env=tcp)
    cache = launch("decode-cache", *flags, "--role", "decode", "--prefill-url", prefill.url,
                   "--f-host", "0.25", "--remote-stall-ms", "0", "--remote-timeout", "30",
                   env=tcp)
    rng = random.Random(13)
    ids = [rng.randrange(5, 4000) for _ in range(1000)]
    want = answer(complete(full, ids, 96))[1]
    short_at, long_at, got, done = [], [], [], threading.Event()
    short = threading.Thread(target=stream, args=(cache, [7, 8, 9, 10, 11], 2000, short_at, [],
                                                  done))
    long = threading.Thread(target=stream, args=(cache, ids, 96, long_at, got))
    short.start()
    until(lambda: len(short_at) >= 5)
    long.start()
    # decoding, its blocks read again at least once: what the pause holds up is a read, not the
    # connection
    until(lambda: len(long_at) >= 2 and pd_metrics(cache).get("oasiskv_pd_cache_reads_total"))
    prefill.proc.send_signal(signal.SIGSTOP)
    try:
        until(lambda: stopped(prefill))
        paused = time.monotonic()
        time.sleep(pause)
    finally:
        prefill.proc.send_signal(signal.SIGCONT)
    resumed = time.monotonic()
    long.join(120)
    done.set()
    short.join(120)

    gaps = [b - a for a, b in zip(long_at, long_at[1:])]
    assert max(gaps) >= 0.6 * pause, gaps  # it waited for its blocks
    during = [t for t in short_at if paused <= t <= resumed]
    short_gaps = [b - a for a, b in zip(during, during[1:])]
    assert len(during) > 20 and max(short_gaps) < 1.5, (len(during), max(short_gaps, default=0))
    assert got == want
    m = pd_metrics(cache)
    assert m["oasiskv_pd_cache_read_seconds_sum"] >= 0.6 * pause  # (the NIXL read took it)
    assert m["oasiskv_pd_cache_deferred_reads_total"] > 0
    assert m["oasiskv_pd_cache_read_failures_total"] == 0
    assert cache.wait_idle()["oasiskv_num_requests_running"] == 0
    assert released(prefill)
    for name in ("decode-cache", "prefill"):
        assert "Traceback" not in (tmp_path / f"{name}.log").read_text()


def test_a_dead_memory_worker_ends_only_the_requests_whose_kv_it_held(launch, tmp_path,
                                                                     fixtures_path):
    """A decode-host cache (--f-host 0.25, full transfer) reads evicted blocks again from the
    worker it imported them from. The prefill worker keeps the first prompt's blocks (room
    enough) and offloads the next two prompts' to a memory worker (--offload-below-blocks between
    one and two prompts' blocks free); the memory worker is killed while the three decode: the
    two whose blocks it held end with an error naming it once they need one of them (a 500; on
    the stream an error event, then ``[DONE]``), the first streams on, never stalled, reading
    from the prefill worker, with the single-node tokens. No host block, host row or working-set
    slot stays held, and the prefill worker's leases are released. The dead memory worker is
    marked down: a prompt the prefill worker would offload stays there and decodes the
    single-node tokens."""
    rng = random.Random(17)
    kept, answered, streamed_off = [[rng.randrange(5, 4000) for _ in range(1000)]
                                    for _ in range(3)]
    held = 999 // BLOCK  # complete blocks of each prompt before its last token
    total = int(0.05 * 2**30) // block_bytes(fixtures_path)  # (the prefill worker's host store)
    flags = ("--topk-blocks", "2", "--draft", "ngram", "--host-kv-gib", "0.05")
    single = launch("single", *flags)
    memory = launch("memory", *flags, "--role", "memory")
    prefill = launch("prefill", *flags, "--role", "prefill", "--memory-url", memory.url,
                     "--offload-below-blocks", str(total - held - held // 2))
    decode = launch("decode", *flags, "--role", "decode", "--prefill-url", prefill.url,
                    "--f-host", "0.25", "--remote-stall-ms", "0")
    short = [7, 8, 9, 10, 11]

    def slots_in_use() -> float:  # (HBM of the last step of a short request: its working set)
        answer(complete(decode, short, 2))
        return decode.metrics()["oasiskv_kv_step_hbm_bytes_in_use"]
    hbm, rows = slots_in_use(), pd_metrics(decode)["oasiskv_pd_cache_rows"]

    arrivals, got, done = [], [], threading.Event()
    survivor = threading.Thread(target=stream, args=(decode, kept, 1000, arrivals, got, done))
    survivor.start()
    until(lambda: len(arrivals) >= 1)  # (admitted: its blocks held on the prefill worker)
    with ThreadPoolExecutor(2) as pool:
        doomed = pool.submit(complete, decode, answered, 900)
        doomed_stream = pool.submit(streamed, decode, streamed_off, 900)
        until(lambda: decode.metrics()["oasiskv_num_requests_running"] == 3
              and labelled(decode, "oasiskv_pd_cache_reads_total", memory) > 0)
        p = pd_metrics(prefill)
        assert p["oasiskv_pd_blocks_exported_total"] == held
        assert p["oasiskv_pd_blocks_offloaded_total"] == 2 * held
        reads = labelled(decode, "oasiskv_pd_cache_reads_total", prefill)
        memory.stop(signal.SIGKILL)
        killed = time.monotonic()
        assert_both_lost_kv(doomed, doomed_stream, memory)
    # the survivor goes on reading from the prefill worker
    until(lambda: labelled(decode, "oasiskv_pd_cache_reads_total", prefill) > reads
          and len([t for t in arrivals if t > killed]) >= 20)
    assert survivor.is_alive()  # (not finished yet: it ran through the whole fault)
    done.set()
    survivor.join(120)
    after = [t for t in arrivals if t >= killed]
    gaps = [b - a for a, b in zip(after, after[1:])]
    assert max(gaps) < 1.5, gaps
    assert got == answer(complete(single, kept, len(got)))[1]
    assert labelled(decode, "oasiskv_pd_cache_read_failures_total", memory) > 0
    assert labelled(decode, "oasiskv_pd_cache_read_failures_total", prefill) == 0
    assert decode.wait_idle()["oasiskv_num_requests_running"] == 0
    assert pd_metrics(decode)["oasiskv_pd_cache_rows"] == rows  # (no row given up)
    assert slots_in_use() == hbm
    assert released(prefill)

    # the prefill worker short of room again (a lease held here): it finds the memory worker
    # down and keeps the new prompt's blocks, which the decode worker reads from it
    lease = httpx.post(prefill.url + "/v1/kv/prefill", json={"prompt_token_ids": kept},
                       timeout=60).json()
    assert len(lease["blocks"]) == held and "worker" not in lease
    fresh = [rng.randrange(5, 4000) for _ in range(800)]
    imported = labelled(decode, "oasiskv_pd_blocks_imported_total", prefill)
    assert answer(complete(decode, fresh, 8)) == answer(complete(single, fresh, 8))
    assert labelled(decode, "oasiskv_pd_blocks_imported_total", prefill) == imported + 799 // BLOCK
    assert pd_metrics(prefill)["oasiskv_pd_blocks_offloaded_total"] == 2 * held
    assert f"memory worker {memory.url} failed" in prefill.log_path.read_text()
    httpx.post(prefill.url + "/v1/kv/release", json={"lease": lease["lease"]})
    assert released(prefill)
    assert decode.wait_idle()["oasiskv_num_requests_running"] == 0
    for name in ("decode", "prefill"):
        assert "Traceback" not in (tmp_path / f"{name}.log").read_text()


def test_a_handed_off_prompt_decodes_the_single_node_tokens(launch, fixtures_path):
    """--pd-transfer partial: the prefill worker runs the whole prompt and hands it off; the
    decode worker reads only the last token's block and the summaries (NIXL) and takes the last
    hidden state and the queries (counted in bytes on /metrics, against sizes computed here), seeds
    each head's working set from the queries (reading the (block, layer) units it selects) and
    samples the first token itself. At K = 2, so that selections move, it answers token for token
    as a single node, a prompt of whole blocks too; later selections read the blocks they want,
    and every lease is released once the requests end. When the prefill worker dies mid-decode,
    the handed-off requests end with an error once they need a block only it had; a request with
    nothing there goes on, and the decode worker stays up. Its bandwidth timeline holds every byte
    read over NIXL, at admission and during decode."""
    rng = random.Random(11)
    prompts = [[rng.randrange(5, 4000) for _ in range(n)] for n in (1000, 992, 700)]
    flags = ("--topk-blocks", "2", "--draft", "ngram", "--host-kv-gib", "0.05")
    single = launch("single", *flags)
    prefill = launch("prefill", *flags, "--role", "prefill")
    decode = launch("decode-partial", *flags, "--role", "decode", "--prefill-url", prefill.url,
                    "--f-host", "0.25", "--pd-transfer", "partial")
    want = [answer(complete(single, ids, 48)) for ids in prompts]
    since = timeline(decode)["now"]
    with ThreadPoolExecutor(3) as pool:
        got = [answer(r) for r in pool.map(lambda ids: complete(decode, ids, 48), prompts)]
    assert got == want
    cfg = json.loads((fixtures_path / "target" / "config.json").read_text())
    layers, heads, kv_heads, dim = (cfg["num_hidden_layers"], cfg["num_attention_heads"],
                                    cfg["num_key_value_heads"], cfg["head_dim"])
    summaries = sum(len(ids) // BLOCK for ids in prompts) * layers * kv_heads * 2 * dim * 4
    handoff = len(prompts) * (cfg["hidden_size"] + layers * heads * dim) * 4
    m = pd_metrics(decode)
    assert m["oasiskv_pd_handoff_bytes_total"] == handoff  # (the summaries move over NIXL)
    assert m["oasiskv_pd_admission_bytes_total"] == (
        len(prompts) * block_bytes(fixtures_path) + summaries + handoff)
    full = sum((len(ids) - 1) // BLOCK for ids in prompts) * block_bytes(fixtures_path)
    assert m["oasiskv_pd_admission_bytes_total"] < full / 4
    assert m["oasiskv_pd_cache_misses_total"] > 0 and m["oasiskv_pd_cache_read_bytes_total"] > 0
    assert m["oasiskv_pd_cache_read_failures_total"] == 0
    # on the timeline: the reads at admission (the last blocks, the summaries) and during decode
    assert_timeline_holds(decode, since, m["oasiskv_pd_admission_bytes_total"] - handoff
                          + m["oasiskv_pd_cache_read_bytes_total"])
    resp = httpx.get(decode.url + "/v1/kv/timeline", params={"start": since, "end": since + 3600})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "start"
    assert released(prefill)

    kill_mid_decode(decode, single, prefill, rng)


def test_an_emulated_prefill_store_serves_rows_not_block_ids(launch, fixtures_path):
    """A prefill worker with ``--emulated-host-gib`` (benchmark only) answers for more block ids
    than its host store has rows (id b in row b mod rows): its leases name the rows a reader
    reads, so the block ids past the last row that later prompts get (the free list hands out
    every id before reusing one) still read their own KV, and prompts one at a time, sharing no
    row while they run, decode the single-node tokens through partial admission."""
    rng = random.Random(5)
    prompts = [[rng.randrange(5, 4000) for _ in range(1000)] for _ in range(5)]
    flags = ("--topk-blocks", "2", "--draft", "ngram", "--host-kv-gib", "0.05")
    rows = int(0.02 * 2**30) // block_bytes(fixtures_path)
    single = launch("single", *flags)
    prefill = launch("prefill-emulated", *flags, "--role", "prefill", "--host-kv-gib", "0.02",
                     "--emulated-host-gib", "0.2")
    decode = launch("decode-partial", *flags, "--role", "decode", "--prefill-url", prefill.url,
                    "--f-host", "0.25", "--pd-transfer", "partial")
    for ids in prompts:
        assert answer(complete(decode, ids, 24)) == answer(complete(single, ids, 24))
    assert released(prefill)
    # (every prompt's blocks are fresh ids: past the store's rows by the fourth prompt)
    assert prefill.metrics()["oasiskv_pd_blocks_exported_total"] > rows
    assert "EMULATED host capacity" in prefill.log_path.read_text()
