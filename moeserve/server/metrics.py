"""Prometheus metrics named like vLLM's, with the `moeserve:` prefix.

Colons are legal in Prometheus metric names (they are meant for exactly this kind of namespacing,
and vLLM's `vllm:` names rely on it); prometheus-client accepts them in metric names, only label
names must not contain one. Each server gets its own registry, so nothing leaks between instances.
"""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

from moeserve.server.messages import EngineStats

PREFIX = "moeserve:"
CONTENT_TYPE = CONTENT_TYPE_LATEST
FINISH_REASONS = ("stop", "length", "abort")

# Fine where CUDA graphs get captured (every 8 up to 128, every 16 up to 512), coarse beyond.
DECODE_BATCH_BUCKETS = (
    1, 2, 4, *range(8, 129, 8), *range(144, 513, 16), 640, 768, 896, 1024, 1536, 2048, 3072, 4096,
)  # fmt: skip
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
    80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
    0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
E2E_BUCKETS = (
    0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
    960.0, 1920.0, 7680.0,
)  # fmt: skip


class ServerMetrics:
    """The server's metrics; engine-side counters arrive as cumulative snapshots."""

    def __init__(self, model_name: str) -> None:
        # The *_created series only double the scrape size; this process serves one registry.
        disable_created_metrics()
        self.registry = CollectorRegistry()
        self._last = EngineStats()
        r, labels = self.registry, ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(PREFIX + name, doc, labels, registry=r).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(PREFIX + name, doc, labels, registry=r).labels(model_name)

        def histogram(name: str, doc: str, buckets: tuple) -> Histogram:
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=r).labels(model_name)

        self.num_running = gauge("num_requests_running", "Requests in the running batch.")
        self.num_waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV pages held by requests (1 = full).")
        self.prefix_hit_rate = gauge("prefix_cache_hit_rate", "Prompt tokens served from the prefix cache / prompt tokens.")
        self.retractions = counter("num_retractions", "Requests retracted (recomputed later) because KV ran out.")
        self.padded_tokens = counter("cuda_graph_padded_tokens", "Padding rows decode CUDA graphs computed.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens admitted.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        success = Counter(
            PREFIX + "request_success", "Finished requests by finish reason.", ["model_name", "finished_reason"], registry=r
        )
        self.success = {reason: success.labels(model_name, reason) for reason in FINISH_REASONS}
        self.ttft = histogram("time_to_first_token_seconds", "Time from arrival to the first token.", TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between two output tokens.", ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Time from arrival to the last token.", E2E_BUCKETS)
        self.decode_batch = histogram(
            "decode_batch_size", "Decode requests per engine step (steps without decodes are left out).", DECODE_BATCH_BUCKETS
        )

    def observe_engine(self, stats: EngineStats, decode_batch_size: int | None = None) -> None:
        """Apply an engine snapshot (and the decode batch size of the step it followed)."""
        self.num_running.set(stats.num_running)
        self.num_waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_used_pages / stats.kv_num_pages if stats.kv_num_pages else 0.0)
        if stats.prefix_queried_tokens:
            self.prefix_hit_rate.set(stats.prefix_hit_tokens / stats.prefix_queried_tokens)
        last = self._last
        self.retractions.inc(max(0, stats.num_retractions - last.num_retractions))
        self.padded_tokens.inc(max(0, stats.cuda_graph_padded_tokens - last.cuda_graph_padded_tokens))
        self.prompt_tokens.inc(max(0, stats.prompt_tokens - last.prompt_tokens))
        self.generation_tokens.inc(max(0, stats.generation_tokens - last.generation_tokens))
        self._last = stats
        # A pure-prefill step runs no decode graph; counting it as size 0 would skew the planner.
        if decode_batch_size:
            self.decode_batch.observe(decode_batch_size)

    def request_finished(self, reason: str | None, e2e_seconds: float) -> None:
        """Count a finished (child) request."""
        counter = self.success.get(reason or "abort")
        if counter is not None:
            counter.inc()
        self.e2e.observe(e2e_seconds)

    def render(self) -> bytes:
        """The Prometheus text exposition."""
        return generate_latest(self.registry)
