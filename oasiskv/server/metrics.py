"""Prometheus metrics of one server, in their own registry (``GET /metrics`` renders it).

Gauges and token counters are read at scrape time from the latest ``EngineStats`` snapshot; latency
histograms and the finished-request counter are fed by ``observe`` when a request finishes. Token
counters count what the engine computed: prompt tokens prefilled (prefix-cache hits excluded,
recomputation after preemption included) and tokens generated.
"""
from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from oasiskv.engine.llm_engine import EngineStats, RequestOutput

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                    120.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)
_SHARE_BUCKETS = (0.5, 0.8, 0.9, 0.95, 0.98, 0.99, 0.995, 0.999, 1.0)
#: per-step observations of the tiered KV (``StepStats.samples``): histogram name, help, buckets
_SAMPLE_HISTOGRAMS = {
    "stall_seconds": ("oasiskv_kv_stall_seconds",
                      "Tiered KV: per decode step, the foreground's device-clock time waiting for "
                      "(or running in line) selection and fetch",
                      (0.0, 0.0001, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25)),
    "guardrail_recall": ("oasiskv_guardrail_attention_recall",
                         "Guardrail (--guardrail-rate): per sampled (request, layer, step), the "
                         "share of exact attention mass on the tokens the working set held",
                         _SHARE_BUCKETS),
    "guardrail_rel_error": ("oasiskv_guardrail_output_rel_error",
                            "Guardrail: per sampled (request, layer, step), the relative error of "
                            "the attention output over the working set against exact attention",
                            (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)),
    "guardrail_topk_agreement": ("oasiskv_guardrail_topk_agreement",
                                 "Guardrail: per sampled (request, layer, step), the share of the "
                                 "blocks the real query would pick (its own top-K by summary "
                                 "score) that the working set held", _SHARE_BUCKETS),
}


class _EngineCollector:
    def __init__(self, stats: Callable[[], EngineStats]):
        self.stats = stats

    def collect(self):
        s = self.stats()
        gauges = [
            ("oasiskv_num_requests_running", "Sequences in the running batch", s.num_running),
            ("oasiskv_num_requests_waiting", "Sequences waiting to be scheduled", s.num_waiting),
            ("oasiskv_kv_blocks_total", "KV cache blocks in the pool", s.kv_blocks_total),
            ("oasiskv_kv_blocks_free", "KV cache blocks free", s.kv_blocks_free),
            ("oasiskv_kv_blocks_used", "KV cache blocks held by sequences",
             s.kv_blocks_total - s.kv_blocks_free),
        ]
        for name, doc, value in gauges:
            yield GaugeMetricFamily(name, doc, value=value)
        counters = [
            ("oasiskv_prompt_tokens", "Prompt tokens prefilled", s.prompt_tokens_total),
            ("oasiskv_generation_tokens", "Tokens generated", s.generation_tokens_total),
            ("oasiskv_num_preemptions", "Sequences preempted for lack of KV blocks",
             s.num_preemptions),
            ("oasiskv_num_steps_ahead", "Decode steps launched before the previous step's tokens "
             "were read (async scheduling)", s.num_steps_ahead),
        ]
        for name, doc, value in counters:
            yield CounterMetricFamily(name, doc, value=value)
        # tiered KV (kv_mode=oasis): the last step's gauges and running totals of its counters
        for key, value in s.kv.items():
            yield GaugeMetricFamily(f"oasiskv_kv_step_{key}", f"Tiered KV, last decode step: {key}",
                                    value=value)
        for key, value in s.kv_totals.items():
            yield CounterMetricFamily(f"oasiskv_kv_{key}", f"Tiered KV, all steps: {key}",
                                      value=value)
        for key, values in s.kv_per_layer_totals.items():
            family = CounterMetricFamily(f"oasiskv_kv_layer_{key}",
                                         f"Tiered KV, all steps, by layer: {key}", labels=["layer"])
            for layer, value in enumerate(values):
                family.add_metric([str(layer)], value)
            yield family


class Metrics:
    def __init__(self, stats: Callable[[], EngineStats]):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(stats))
        self.ttft = Histogram("oasiskv_time_to_first_token_seconds",
                              "Arrival to first generated token",
                              buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.tpot = Histogram("oasiskv_time_per_output_token_seconds",
                              "Mean time between generated tokens of a request",
                              buckets=_TPOT_BUCKETS, registry=self.registry)
        self.e2e = Histogram("oasiskv_e2e_request_latency_seconds", "Arrival to last token",
                             buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.finished = Counter("oasiskv_requests_finished",
                                "Engine requests finished, by finish reason",
                                ["finish_reason"], registry=self.registry)
        self.unfinished = Counter("oasiskv_requests_unfinished",
                                  "Engine requests that ended without finishing: aborted (the "
                                  "client went away) or error", ["reason"], registry=self.registry)
        self.samples = {key: Histogram(name, doc, buckets=buckets, registry=self.registry)
                        for key, (name, doc, buckets) in _SAMPLE_HISTOGRAMS.items()}

    def observe_step(self, stats: EngineStats) -> None:
        """Record the observations of the step just run (``EngineStats.kv_samples``)."""
        for key, values in stats.kv_samples.items():
            histogram = self.samples.get(key)
            for value in values if histogram is not None else ():
                histogram.observe(value)

    def observe_unfinished(self, why: str, count: int) -> None:
        """Engine requests that ended without finishing: ``aborted`` (the client went away) or
        ``error`` (failed inside the engine)."""
        self.unfinished.labels(why).inc(count)

    def observe(self, out: RequestOutput) -> None:
        """Record a finished request (times are the engine's monotonic clock)."""
        self.finished.labels(out.finish_reason or "unknown").inc()
        if out.first_token_time is None or out.finish_time is None:
            return
        self.ttft.observe(out.first_token_time - out.arrival_time)
        self.e2e.observe(out.finish_time - out.arrival_time)
        if len(out.token_ids) > 1:
            self.tpot.observe((out.finish_time - out.first_token_time) / (len(out.token_ids) - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)
