"""Prometheus sinks for the engine's StepStats, per-request timings and HTTP routes (prefix `specserve:`).

Speculation counters follow the schema vLLM and llama.cpp share, with a `method` label added, so
existing dashboards work: acceptance rate = accepted / draft_tokens, mean acceptance length =
1 + accepted / drafts (ratios are computed in PromQL, never exported as gauges). Every series carries
`model_name`; speculation series and the per-request latency histograms also carry `method`.

`on_step` is called from the engine thread once per step: it only increments counters (the
prometheus_client types are thread-safe) and must stay cheap, so the labelled children are looked up
once per (model, method) and cached. Each app owns a CollectorRegistry, so several apps can live in
one process (tests).

Series are created at 0 when the model becomes ready (`set_model_name(name, methods)`), not on first
use: a counter born at 0 makes PromQL's `rate()` extrapolate every series of a ratio the same way
(the acceptance rate from `rate(accepted) / rate(draft_tokens)` is then exact), and Grafana shows 0
rather than "No data" before traffic arrives.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.metrics_core import Metric
from prometheus_client.samples import Sample

from specserve.server.config import METRICS_COMPAT
from specserve.server.engine.stats import RequestTimings, SpecStepStats, StepStats

PREFIX = "specserve:"
VLLM_PREFIX = "vllm:"
# `--metrics-compat vllm`: our series again under the name vLLM gives the same quantity, for routers and
# autoscalers configured for vLLM (the inference gateway's endpoint picker reads vllm:num_requests_waiting
# and vllm:kv_cache_usage_perc by default). Same types, buckets and labels (`method` is extra; vLLM has none).
VLLM_NAMES = {
    "num_requests_running": "num_requests_running",
    "num_requests_waiting": "num_requests_waiting",
    "kv_cache_usage_perc": "kv_cache_usage_perc",
    "num_preemptions": "num_preemptions",
    "prompt_tokens": "prompt_tokens",
    "generation_tokens": "generation_tokens",
    "request_success": "request_success",
    "spec_decode_num_drafts": "spec_decode_num_drafts",
    "spec_decode_num_draft_tokens": "spec_decode_num_draft_tokens",
    "spec_decode_num_accepted_tokens": "spec_decode_num_accepted_tokens",
    "spec_decode_num_accepted_tokens_per_pos": "spec_decode_num_accepted_tokens_per_pos",
    "time_to_first_token_seconds": "time_to_first_token_seconds",
    "inter_token_latency_seconds": "inter_token_latency_seconds",
    "time_per_output_token_seconds": "request_time_per_output_token_seconds",
    "e2e_request_latency_seconds": "e2e_request_latency_seconds",
    "request_queue_time_seconds": "request_queue_time_seconds",
}
METRICS_PATH = "/metrics"
CONTENT_TYPE = CONTENT_TYPE_LATEST

# The `_created` series double the output and no dashboard reads them (vLLM drops them too).
disable_created_metrics()

# Seconds; from sub-millisecond steps on a GPU to minutes-long requests on a CPU.
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                   2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05,
                         0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
TOKENS_PER_STEP_BUCKETS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 16, 24, 32, 48, 65)
ACCEPTED_DEPTH_BUCKETS = (0, 1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 24, 32, 48, 64)
DRAFT_SHAPES = ("chain", "tree")     # the `draft` label of spec_decode_accepted_depth
HTTP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
# Finish reasons the engine reports (server/engine/scheduler.py, engine.py); pre-created at 0.
FINISH_REASONS = ("stop", "length", "abort")


class _SpecChildren:
    """The labelled children of one (model, method): resolved once, reused every step."""
    __slots__ = ("_labels", "_per_pos_metric", "accepted", "depth", "draft_tokens", "drafts", "grammar_rejected",
                 "per_pos", "tokens_per_step", "tree_nodes")

    def __init__(self, m: Metrics, model_name: str, method: str) -> None:
        self._labels = (model_name, method)
        self.drafts = m.spec_drafts.labels(model_name, method)
        self.draft_tokens = m.spec_draft_tokens.labels(model_name, method)
        self.accepted = m.spec_accepted.labels(model_name, method)
        self.tokens_per_step = m.spec_tokens_per_step.labels(model_name, method)
        self.grammar_rejected = m.spec_grammar_rejected.labels(model_name, method)
        self.depth = {shape: m.spec_accepted_depth.labels(model_name, method, shape) for shape in DRAFT_SHAPES}
        self.tree_nodes = m.spec_tree_nodes.labels(model_name, method)
        self._per_pos_metric = m.spec_accepted_per_pos
        self.per_pos: list[Any] = []

    def position(self, pos: int) -> Any:
        while len(self.per_pos) <= pos:
            self.per_pos.append(self._per_pos_metric.labels(*self._labels, str(len(self.per_pos))))
        return self.per_pos[pos]


class _RequestChildren:
    """Per-request latency histograms of one (model, method)."""
    __slots__ = ("e2e", "itl", "queue_time", "tpot", "ttft")

    def __init__(self, m: Metrics, model_name: str, method: str) -> None:
        self.ttft = m.ttft.labels(model_name, method)
        self.itl = m.itl.labels(model_name, method)
        self.tpot = m.tpot.labels(model_name, method)
        self.e2e = m.e2e.labels(model_name, method)
        self.queue_time = m.queue_time.labels(model_name, method)


class _ModelChildren:
    """Every labelled child of one model name; `spec` and `request` fill per method on first use."""

    def __init__(self, m: Metrics, name: str) -> None:
        self.name = name
        self.running = m.num_requests_running.labels(name)
        self.waiting = m.num_requests_waiting.labels(name)
        self.kv = m.kv_cache_usage.labels(name)
        self.preemptions = m.num_preemptions.labels(name)
        self.prompt = m.prompt_tokens.labels(name)
        self.generation = m.generation_tokens.labels(name)
        self.spec: dict[str, _SpecChildren] = {}
        self.request: dict[str, _RequestChildren] = {}


class _VllmCompat:
    """A collector that re-reads our own families at scrape time and yields them under vLLM's names.

    Nothing is recorded twice: the values are those of the `specserve:` series at the same instant.
    """

    def __init__(self, families: list[Any]) -> None:
        self._families = families

    def collect(self) -> Iterable[Metric]:
        for family in self._families:
            for metric in family.collect():
                ours = metric.name[len(PREFIX):]
                theirs = VLLM_PREFIX + VLLM_NAMES[ours]
                out = Metric(theirs, metric.documentation, metric.type)
                out.samples = [Sample(theirs + s.name[len(metric.name):], s.labels, s.value, s.timestamp,
                                      s.exemplar) for s in metric.samples]
                yield out


class Metrics:
    def __init__(self, model_name: str = "unknown", registry: CollectorRegistry | None = None,
                 compat: str = "none") -> None:
        if compat not in METRICS_COMPAT:
            raise ValueError(f"metrics compat must be one of {METRICS_COMPAT}, got {compat!r}")
        self.registry = registry if registry is not None else CollectorRegistry()
        self._define_serving()
        self._define_speculation()
        self._define_latency()
        self._define_http()
        self.model_name = model_name
        self._bound: _ModelChildren | None = None
        if compat == "vllm":
            ours = [m for m in vars(self).values() if isinstance(m, (Counter, Gauge, Histogram))]
            self.registry.register(_VllmCompat([m for m in ours
                                                if m.describe()[0].name[len(PREFIX):] in VLLM_NAMES]))

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
        self.spec_accepted_depth = self._histogram(
            "spec_decode_accepted_depth",
            "Drafts accepted per verification step: the accepted path's depth, by draft shape (chain or tree).",
            ACCEPTED_DEPTH_BUCKETS, ("method", "draft"))
        self.spec_tree_nodes = self._counter("spec_decode_num_tree_nodes", "Draft-tree nodes verified.", m)
        self.spec_grammar_rejected = self._counter(
            "spec_decode_grammar_rejected",
            "Verification steps where a structured-output grammar forbade a draft (rejected at that position).", m)
        self.spec_refused = self._counter("spec_decode_refused",
                                          "Requests whose speculation was refused or reduced, by reason.",
                                          ("reason",))
        self.spec_collapsed = self._counter(
            "spec_decode_acceptance_collapse",
            "Times a method's recent acceptance fell far below its longer history (auto stops choosing it "
            "for a while).", m)

    def _define_latency(self) -> None:
        m = ("method",)
        self.ttft = self._histogram("time_to_first_token_seconds", "Arrival to first token.",
                                    LATENCY_BUCKETS, m)
        self.itl = self._histogram("inter_token_latency_seconds", "Gap between output events of a request.",
                                   TOKEN_LATENCY_BUCKETS, m)
        self.tpot = self._histogram("time_per_output_token_seconds",
                                    "(e2e - ttft) / (output tokens - 1), per request.", TOKEN_LATENCY_BUCKETS, m)
        self.e2e = self._histogram("e2e_request_latency_seconds", "Arrival to finish.", LATENCY_BUCKETS, m)
        self.queue_time = self._histogram("request_queue_time_seconds", "Arrival to first scheduled.",
                                          LATENCY_BUCKETS, m)

    def _define_http(self) -> None:
        self.http_requests = self._counter("http_requests", "HTTP requests by route template and status.",
                                           ("handler", "status"))
        self.http_duration = self._histogram("http_request_duration_seconds",
                                             "HTTP request duration including streaming, by route template.",
                                             HTTP_BUCKETS, ("handler",))

    # ---- series ----------------------------------------------------------------------------------

    def set_model_name(self, name: str, methods: Iterable[str] | dict[str, int] | None = None) -> None:
        """Label everything from now on with `name` and create the model's series at 0.

        `methods`: the speculation methods the engine offers, as names or as AsyncEngine.speculators()
        (method -> max k; the per-position series of positions 0..k-1 are created too).
        """
        self.model_name = name
        c = self._bound = _ModelChildren(self, name)
        for reason in FINISH_REASONS:
            self.request_success.labels(name, reason)
        max_k = methods if isinstance(methods, dict) else dict.fromkeys(methods or (), 0)
        for method, k in max_k.items():
            self._request_children(c, method)
            if method != "none":
                spec = self._spec_children(c, method)
                if k:
                    spec.position(k - 1)

    def _children(self) -> _ModelChildren:
        c = self._bound
        if c is None or c.name != self.model_name:      # never named: bind lazily, create nothing early
            c = self._bound = _ModelChildren(self, self.model_name)
        return c

    def _spec_children(self, c: _ModelChildren, method: str) -> _SpecChildren:
        children = c.spec.get(method)
        if children is None:
            children = c.spec[method] = _SpecChildren(self, c.name, method)
        return children

    def _request_children(self, c: _ModelChildren, method: str) -> _RequestChildren:
        children = c.request.get(method)
        if children is None:
            children = c.request[method] = _RequestChildren(self, c.name, method)
        return children

    # ---- sinks -----------------------------------------------------------------------------------

    def set_queue_sizes(self, running: int, waiting: int) -> None:
        c = self._children()
        c.running.set(running)
        c.waiting.set(waiting)

    def on_spec_refused(self, reason: str) -> None:
        """A request's speculation was refused at the HTTP edge (e.g. a prediction it cannot use)."""
        self.spec_refused.labels(self._children().name, reason).inc()

    def on_step(self, stats: StepStats) -> None:
        """Record one engine step. Called from the engine thread; cheap and thread-safe."""
        c = self._children()
        c.running.set(stats.num_running)
        c.waiting.set(stats.num_waiting)
        c.kv.set(stats.kv_cache_usage)
        if stats.num_preemptions:
            c.preemptions.inc(stats.num_preemptions)
        if stats.num_prompt_tokens:
            c.prompt.inc(stats.num_prompt_tokens)
        if stats.num_generation_tokens:
            c.generation.inc(stats.num_generation_tokens)
        for method, spec in stats.spec.items():
            self._on_spec(self._spec_children(c, method), spec)
        for reason, count in stats.spec_refused.items():
            self.spec_refused.labels(c.name, reason).inc(count)
        for method, count in stats.spec_collapsed.items():
            self.spec_collapsed.labels(c.name, method).inc(count)
        for timings in stats.finished:
            self._on_finished(c, timings)

    @staticmethod
    def _on_spec(c: _SpecChildren, spec: SpecStepStats) -> None:
        # All of a method's counters move together (inc(0) included), so their series exist together.
        c.drafts.inc(spec.num_drafts)
        c.draft_tokens.inc(spec.num_draft_tokens)
        c.accepted.inc(spec.num_accepted_tokens)
        c.grammar_rejected.inc(spec.num_grammar_rejected)
        for pos, count in enumerate(spec.accepted_per_pos):
            c.position(pos).inc(count)
        for tokens in spec.tokens_per_step:
            c.tokens_per_step.observe(tokens)
        for shape, depth in spec.accepted_depths:
            c.depth[shape].observe(depth)
        c.tree_nodes.inc(spec.num_tree_nodes)

    def on_finished(self, t: RequestTimings) -> None:
        self._on_finished(self._children(), t)

    def _on_finished(self, c: _ModelChildren, t: RequestTimings) -> None:
        self.request_success.labels(c.name, t.finish_reason).inc()
        h = self._request_children(c, t.method)
        h.e2e.observe(t.e2e_latency)
        h.queue_time.observe(t.queue_time)
        if t.ttft is not None:
            h.ttft.observe(t.ttft)
            if t.num_output_tokens > 1:
                h.tpot.observe((t.e2e_latency - t.ttft) / (t.num_output_tokens - 1))
        for gap in t.inter_token_latencies:
            h.itl.observe(gap)

    def on_http(self, info: Any) -> None:
        """prometheus-fastapi-instrumentator callback (its metrics.Info): one finished HTTP request.

        `handler` is the route template (`/v1/models/{model_id:path}`), or `none` for paths no route
        matches, so the label set stays bounded whatever clients send.
        """
        handler = info.modified_handler
        self.http_requests.labels(self.model_name, handler, info.modified_status).inc()
        self.http_duration.labels(self.model_name, handler).observe(info.modified_duration)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def instrument_app(app: Any, metrics: Metrics) -> None:
    """Count every HTTP request of `app` by route and status into `metrics` (the app's own registry).

    The instrumentator's middleware resolves route templates and statuses (streaming included); its
    default metrics and its /metrics endpoint are not used: the app serves `metrics.render()`. Scrapes
    are not counted (Prometheus records its own `up` and `scrape_duration_seconds`), so two reads of
    /metrics with no traffic between them are identical.
    """
    from prometheus_fastapi_instrumentator import Instrumentator

    Instrumentator(should_group_status_codes=False, should_group_untemplated=True,
                   excluded_handlers=[f"^{METRICS_PATH}$"],
                   registry=metrics.registry).add(metrics.on_http).instrument(app)
