"""Prometheus sinks for the engine's StepStats and per-request timings (prefix `specserve:`).

Speculation counters follow the schema vLLM and llama.cpp share, with a `method` label added, so
existing dashboards work: acceptance rate = accepted / draft_tokens, mean acceptance length =
1 + accepted / drafts (ratios are computed in PromQL, never exported as gauges).

`on_step` is called from the engine thread once per step: it only increments counters (the
prometheus_client types are thread-safe) and must stay cheap. Each app owns a CollectorRegistry, so
several apps can live in one process (tests).
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

from server.engine.stats import RequestTimings, StepStats

PREFIX = "specserve:"
CONTENT_TYPE = CONTENT_TYPE_LATEST

# The `_created` series double the output and no dashboard reads them (vLLM drops them too).
disable_created_metrics()

# Seconds; from sub-millisecond steps on a GPU to minutes-long requests on a CPU.
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                   2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05,
                         0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
TOKENS_PER_STEP_BUCKETS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 16, 24, 32, 48, 65)


class Metrics:
    def __init__(self, model_name: str = "unknown", registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.model_name = model_name
        self._define_serving()
        self._define_speculation()
        self._define_latency()

    def _counter(self, name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
        return Counter(PREFIX + name, doc, ("model_name", *labels), registry=self.registry)

    def _gauge(self, name: str, doc: str) -> Gauge:
        return Gauge(PREFIX + name, doc, ("model_name",), registry=self.registry)

    def _histogram(self, name: str, doc: str, buckets: tuple[float, ...],
                   labels: tuple[str, ...] = ()) -> Histogram:
        return Histogram(PREFIX + name, doc, ("model_name", *labels), buckets=buckets,
                         registry=self.registry)

    def _define_serving(self) -> None:
        self.num_requests_running = self._gauge("num_requests_running", "Requests in the running batch.")
        self.num_requests_waiting = self._gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_cache_usage = self._gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1).")
        self.num_preemptions = self._counter("num_preemptions", "Requests preempted (recomputed later).")
        self.prompt_tokens = self._counter("prompt_tokens",
                                           "Prompt tokens computed (prefix-cache hits excluded).")
        self.generation_tokens = self._counter("generation_tokens", "Tokens generated.")
        self.request_success = self._counter("request_success", "Finished requests by finish reason.",
                                             ("finished_reason",))

    def _define_speculation(self) -> None:
        m = ("method",)
        self.spec_drafts = self._counter("spec_decode_num_drafts",
                                         "Verification steps of a request that carried >= 1 draft token.", m)
        self.spec_draft_tokens = self._counter("spec_decode_num_draft_tokens", "Draft tokens proposed.", m)
        self.spec_accepted = self._counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.", m)
        self.spec_accepted_per_pos = self._counter(
            "spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted at each draft position.",
            ("method", "position"))
        self.spec_tokens_per_step = self._histogram(
            "spec_decode_tokens_per_step", "Tokens emitted per verification step (accepted + 1).",
            TOKENS_PER_STEP_BUCKETS, m)
        self.spec_refused = self._counter("spec_decode_refused",
                                          "Requests whose speculation was refused or reduced.", ("reason",))

    def _define_latency(self) -> None:
        self.ttft = self._histogram("time_to_first_token_seconds", "Arrival to first token.", LATENCY_BUCKETS)
        self.itl = self._histogram("inter_token_latency_seconds", "Gap between output events of a request.",
                                   TOKEN_LATENCY_BUCKETS)
        self.tpot = self._histogram("time_per_output_token_seconds",
                                    "(e2e - ttft) / (output tokens - 1), per request.", TOKEN_LATENCY_BUCKETS)
        self.e2e = self._histogram("e2e_request_latency_seconds", "Arrival to finish.", LATENCY_BUCKETS)
        self.queue_time = self._histogram("request_queue_time_seconds", "Arrival to first scheduled.",
                                          LATENCY_BUCKETS)

    # ---- sinks ---------------------------------------------------------------------------------

    def set_model_name(self, name: str) -> None:
        self.model_name = name

    def set_queue_sizes(self, running: int, waiting: int) -> None:
        self.num_requests_running.labels(self.model_name).set(running)
        self.num_requests_waiting.labels(self.model_name).set(waiting)

    def on_step(self, stats: StepStats) -> None:
        """Record one engine step. Called from the engine thread; cheap and thread-safe."""
        name = self.model_name
        self.set_queue_sizes(stats.num_running, stats.num_waiting)
        self.kv_cache_usage.labels(name).set(stats.kv_cache_usage)
        if stats.num_preemptions:
            self.num_preemptions.labels(name).inc(stats.num_preemptions)
        if stats.num_prompt_tokens:
            self.prompt_tokens.labels(name).inc(stats.num_prompt_tokens)
        if stats.num_generation_tokens:
            self.generation_tokens.labels(name).inc(stats.num_generation_tokens)
        for method, spec in stats.spec.items():
            self._on_spec(method, spec)
        for reason, count in stats.spec_refused.items():
            self.spec_refused.labels(name, reason).inc(count)
        for timings in stats.finished:
            self.on_finished(timings)

    def _on_spec(self, method: str, spec) -> None:  # spec: SpecStepStats
        name = self.model_name
        if spec.num_drafts:
            self.spec_drafts.labels(name, method).inc(spec.num_drafts)
        if spec.num_draft_tokens:
            self.spec_draft_tokens.labels(name, method).inc(spec.num_draft_tokens)
        if spec.num_accepted_tokens:
            self.spec_accepted.labels(name, method).inc(spec.num_accepted_tokens)
        for pos, count in enumerate(spec.accepted_per_pos):
            self.spec_accepted_per_pos.labels(name, method, str(pos)).inc(count)
        histogram = self.spec_tokens_per_step.labels(name, method)
        for tokens in spec.tokens_per_step:
            histogram.observe(tokens)

    def on_finished(self, t: RequestTimings) -> None:
        name = self.model_name
        self.request_success.labels(name, t.finish_reason).inc()
        self.e2e.labels(name).observe(t.e2e_latency)
        self.queue_time.labels(name).observe(t.queue_time)
        if t.ttft is not None:
            self.ttft.labels(name).observe(t.ttft)
            if t.num_output_tokens > 1:
                self.tpot.labels(name).observe((t.e2e_latency - t.ttft) / (t.num_output_tokens - 1))
        itl = self.itl.labels(name)
        for gap in t.inter_token_latencies:
            itl.observe(gap)

    def render(self) -> bytes:
        return generate_latest(self.registry)
