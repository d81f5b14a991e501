"""A server in tiered-KV mode serves requests and exports the tiered counters on /metrics, every
metric the Grafana dashboard in docs/ plots among them."""
import json
import re
from pathlib import Path

import httpx

from tests.server.server_process import ServerProcess


def test_oasis_server_exports_tiered_kv_metrics(tmp_path):
    server = ServerProcess(tmp_path / "oasis.log", "--kv-mode", "oasis", "--topk-blocks", "2",
                           "--fetch-ratio", "0.5", "--host-kv-gib", "0.01", "--draft", "ngram",
                           "--guardrail-rate", "0.5")
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
        # how full the fetch cap ran (all steps), and admitted blocks by layer
        assert 0 < m["oasiskv_kv_fetched_blocks_total"] <= m["oasiskv_kv_cap_slots_total"]
        text = httpx.get(server.url + "/metrics").text
        layers = [float(line.split()[-1]) for line in text.splitlines()
                  if line.startswith("oasiskv_kv_layer_fetched_blocks_total{layer=")]
        assert len(layers) == 2 and sum(layers) == m["oasiskv_kv_fetched_blocks_total"]
        assert "oasiskv_kv_admissions_refused_host_blocks_total" in m
        assert m["oasiskv_kv_draft_guesses_total"] > 0
        # the foreground stall, per decode step, from the tier's clock marks
        assert m["oasiskv_kv_stall_seconds_count"] >= 23 and m["oasiskv_kv_stall_seconds_sum"] >= 0
        # the guardrail: about half the decode rows measured, recall a share, error positive
        count = m["oasiskv_guardrail_attention_recall_count"]
        assert 4 <= count <= 20 and m["oasiskv_guardrail_output_rel_error_count"] == count
        assert 0 < m["oasiskv_guardrail_attention_recall_sum"] <= count
        assert 0 < m["oasiskv_guardrail_topk_agreement_count"] <= count
        # a request its client leaves is counted too
        with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                          json={"prompt": prompt, "max_tokens": 200, "stream": True}) as r:
            next(r.iter_lines())
        server.wait_idle()
        text = httpx.get(server.url + "/metrics").text
        dashboard = (Path(__file__).resolve().parents[2] / "docs" / "grafana-oasiskv.json")
        exprs = [t["expr"] for p in json.loads(dashboard.read_text())["panels"]
                 for t in p["targets"]]
        names = {n for e in exprs for n in re.findall(r"oasiskv_[a-z_]+", e)}
        assert len(names) >= 15
        missing = [n for n in sorted(names) if re.search(rf"^{n}[{{ ]", text, re.M) is None]
        assert not missing, missing
    finally:
        assert server.stop() == 0
