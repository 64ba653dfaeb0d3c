"""Prometheus metrics of one OpenAIIngress replica (GET /metrics), in a registry of its own.

Request metrics are counted where requests pass, in this ingress replica: requests by endpoint
and status, time to first token, time per output token, prompt / generated / cached tokens.
Engine metrics are every live LLMServer replica's latest stats, read from the application's
index actor when /metrics is scraped (each replica reports there once per routing-stats period,
default 1 s), labelled by `replica_id`. A replica that is gone leaves the series once the index
drops it (at once when it dies; after 10 s of silence otherwise).
"""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

disable_created_metrics()  # no *_created series: they double the output and nobody reads them here

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)

# (metric name, help, stats key, kind)
_ENGINE_SERIES = (
    ("llm_engine_running_requests", "Requests the engine is running.", "num_running", "gauge"),
    ("llm_engine_waiting_requests", "Requests waiting for their first step (or preempted).", "num_waiting",
     "gauge"),
    ("llm_engine_kv_blocks_total", "KV cache blocks of the engine.", "num_kv_blocks", "gauge"),
    ("llm_engine_kv_blocks_used", "KV cache blocks in use (total minus free).", None, "gauge"),
    ("llm_engine_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache since start.",
     "num_prefix_hit_tokens_total", "counter"),
    ("llm_engine_preemptions", "Requests preempted (KV blocks ran out) since start.", "num_preemptions_total",
     "counter"),
    ("llm_engine_first_tokens", "Requests (choices) that got their first token since start.",
     "num_first_tokens_total", "counter"),
    ("llm_engine_time_to_first_token_seconds", "Sum over llm_engine_first_tokens of the time from a request's "
     "arrival in the engine to its first token (its mean: the two counters' ratio; the ingress's "
     "llm_time_to_first_token_seconds less this is the serving path's part).", "time_to_first_token_s_total",
     "counter"),
    ("llm_engine_kernel_compiles", "Triton kernel compiles (or loads from Triton's disk cache) in the replica's "
     "process since start (CUDA engines; 0 elsewhere).", "kernel_compiles_total", "counter"),
    ("llm_engine_kernel_compile_seconds", "Seconds those compiles took.", "kernel_compile_s_total", "counter"),
    ("llm_engine_kernel_compiles_serving", "Of llm_engine_kernel_compiles, those after the engine was ready: each "
     "stalled a step (the replica logs each, with the kernel's specialization).", "kernel_compiles_serving_total",
     "counter"),
)


class EngineStatsCollector(Collector):
    """The latest stats of each LLMServer replica, as series labelled by replica_id."""

    def __init__(self) -> None:
        self._latest: dict[str, dict] = {}
        self._lock = threading.Lock()

    def replace(self, stats_by_replica: dict[str, dict]) -> None:
        with self._lock:
            self._latest = {str(r): dict(s) for r, s in stats_by_replica.items()}

    def collect(self):
        with self._lock:
            latest = dict(self._latest)
        for name, help_text, key, kind in _ENGINE_SERIES:
            family_cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            family = family_cls(name, help_text, labels=["replica_id"])
            for replica_id, stats in sorted(latest.items()):
                if key is None:
                    value = stats.get("num_kv_blocks", 0) - stats.get("num_free_kv_blocks", 0)
                else:
                    value = stats.get(key, 0)
                family.add_metric([replica_id], float(value))
            yield family


class IngressMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("llm_requests", "Requests by endpoint and HTTP status (499: the caller went "
                                "away).", ["endpoint", "status"], registry=r)
        self.time_to_first_token = Histogram(
            "llm_time_to_first_token_seconds", "From the ingress handing the request to a replica (parsed, "
            "tokenized, hashed; the replica still to pick) to its first token.",
            ["endpoint"], buckets=_TTFT_BUCKETS, registry=r)
        self.time_per_output_token = Histogram(
            "llm_time_per_output_token_seconds", "Mean time between output tokens after the first, per request.",
            ["endpoint"], buckets=_TPOT_BUCKETS, registry=r)
        self.prompt_tokens = Counter("llm_prompt_tokens", "Prompt tokens of requests that produced output.", registry=r)
        self.generation_tokens = Counter("llm_generation_tokens", "Tokens generated.", registry=r)
        self.cached_tokens = Counter("llm_cached_prompt_tokens", "Prompt tokens served from the prefix cache.",
                                     registry=r)
        self.engine = EngineStatsCollector()
        r.register(self.engine)

    def count_request(self, endpoint: str, status: int | str) -> None:
        self.requests.labels(endpoint, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
