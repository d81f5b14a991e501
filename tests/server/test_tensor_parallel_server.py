"""``oasiskv serve --tensor-parallel-size 2`` (demo model, CPU): a real server process whose engine
drives a second rank's process; it answers as the one-rank server does and stops cleanly."""
import signal

import httpx

from tests.server.server_process import ServerProcess

PROMPT = "def fib(n):\n    if n < 2:\n        return n\n"


def _complete(server: ServerProcess) -> dict:
    resp = httpx.post(server.url + "/v1/completions", timeout=120,
                      json={"prompt": PROMPT, "max_tokens": 20, "temperature": 0,
                            "ignore_eos": True, "logprobs": 2})
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]


def test_two_rank_server_answers_as_one_rank(server, tmp_path):
    want = _complete(server)
    two = ServerProcess(tmp_path / "tp2.log", "--device", "cpu", "--tensor-parallel-size", "2")
    try:
        got = _complete(two)
        assert got["text"] == want["text"]
        assert got["logprobs"]["tokens"] == want["logprobs"]["tokens"]
        assert two.wait_idle()["oasiskv_num_requests_running"] == 0
    finally:
        assert two.stop(signal.SIGINT) == 0, (tmp_path / "tp2.log").read_text()
    assert "oasiskv-tp1" not in (tmp_path / "tp2.log").read_text()  # no worker traceback
