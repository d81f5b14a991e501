"""A server in tiered-KV mode serves requests and exports the tiered counters on /metrics."""
import httpx

from tests.server.server_process import ServerProcess


def test_oasis_server_exports_tiered_kv_metrics(tmp_path):
    server = ServerProcess(tmp_path / "oasis.log", "--kv-mode", "oasis", "--topk-blocks", "2",
                           "--fetch-ratio", "0.5", "--host-kv-gib", "0.01")
    try:
        prompt = "def add(a, b):\n    return a + b\n\n" * 30
        resp = httpx.post(server.url + "/v1/completions", timeout=120,
                          json={"prompt": prompt, "max_tokens": 24, "temperature": 0,
                                "ignore_eos": True})
        assert resp.status_code == 200, resp.text
        assert resp.json()["usage"]["completion_tokens"] == 24
        m = server.wait_idle()
        assert m["oasiskv_kv_fetched_blocks_total"] > 0 and m["oasiskv_kv_hits_total"] > 0
        assert (m["oasiskv_kv_fetched_bytes_total"]
                == m["oasiskv_kv_fetched_blocks_total"] * 2 * 16 * 64 * 4)
        assert (0.0 <= m["oasiskv_kv_step_hit_rate"] <= 1.0
                and "oasiskv_kv_step_hbm_bytes_in_use" in m)
    finally:
        assert server.stop() == 0
