"""Benchmark statistics with vLLM's `bench serve` definitions, plus speculation from /metrics.

Per request: TTFT = first content chunk - send; E2EL = last chunk - send; TPOT = (E2EL - TTFT) /
(output_tokens - 1) (excludes the first token; requests with one token have none); ITL = every gap
between consecutive content chunks, pooled over all requests (a chunk may carry several tokens when a
speculative step accepted a run). Goodput = requests meeting every given SLO per second.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field


@dataclass
class RequestRecord:
    ok: bool
    ttft: float = 0.0
    e2el: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0
    error: str = ""
    last_chunk: float | None = None      # perf_counter() of the latest content chunk

    def content_at(self, t0: float, now: float) -> None:
        """A chunk with content arrived at `now` (the request was sent at t0): TTFT first, ITL after."""
        if self.last_chunk is None:
            self.ttft = now - t0
        else:
            self.itl.append(now - self.last_chunk)
        self.last_chunk = now

    def close(self, t0: float, now: float) -> None:
        """The stream ended at `now`: E2EL to the last content chunk; no content at all is a failure."""
        self.e2el = (self.last_chunk or now) - t0
        self.ok = self.last_chunk is not None
        if not self.ok:
            self.error = "no content"

    @property
    def tpot(self) -> float | None:
        return (self.e2el - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": math.nan, "p50": math.nan, "p90": math.nan, "p99": math.nan}
    v = sorted(values)

    def pct(p: float) -> float:      # linear interpolation, as numpy.percentile's default
        pos = (len(v) - 1) * p / 100
        lo = math.floor(pos)
        hi = min(lo + 1, len(v) - 1)
        return v[lo] + (v[hi] - v[lo]) * (pos - lo)
    return {"mean": sum(v) / len(v), "p50": pct(50), "p90": pct(90), "p99": pct(99)}


def summarize(records: list[RequestRecord], duration: float, slos: dict[str, float]) -> dict:
    ok = [r for r in records if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)

    def good(r: RequestRecord) -> bool:
        checks = {"ttft": r.ttft, "tpot": r.tpot or 0.0, "e2el": r.e2el}
        return all(checks[k] * 1000 <= ms for k, ms in slos.items())
    return {
        "completed": len(ok), "failed": len(records) - len(ok), "duration_s": duration,
        "request_throughput": len(ok) / duration, "output_throughput": out_tokens / duration,
        "total_output_tokens": out_tokens, "total_input_tokens": sum(r.prompt_tokens for r in ok),
        "goodput": sum(good(r) for r in ok) / duration if slos else None,
        "ttft_ms": {k: x * 1000 for k, x in percentiles([r.ttft for r in ok]).items()},
        "tpot_ms": {k: x * 1000 for k, x in percentiles([r.tpot for r in ok if r.tpot is not None]).items()},
        "itl_ms": {k: x * 1000 for k, x in percentiles([g for r in ok for g in r.itl]).items()},
        "e2el_ms": {k: x * 1000 for k, x in percentiles([r.e2el for r in ok]).items()},
        "errors": sorted({r.error for r in records if not r.ok})[:5],
    }


_SAMPLE = re.compile(r'^(?P<name>[^{\s]+)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)$')


def parse_spec_counters(text: str) -> dict[str, dict[str, float]]:
    """{method: {drafts, draft_tokens, accepted}} summed over models, from a /metrics scrape."""
    names = {"spec_decode_num_drafts_total": "drafts", "spec_decode_num_draft_tokens_total": "draft_tokens",
             "spec_decode_num_accepted_tokens_total": "accepted"}
    out: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if not m:
            continue
        key = names.get(m.group("name").split(":", 1)[-1])
        if key is None:
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group("labels") or ""))
        method = labels.get("method", "?")
        out.setdefault(method, {"drafts": 0.0, "draft_tokens": 0.0, "accepted": 0.0})[key] += float(m.group("value"))
    return out


def spec_delta(before: dict, after: dict) -> dict[str, dict[str, float]]:
    """Acceptance rate and mean acceptance length per method over the run."""
    res = {}
    for method, a in after.items():
        b = before.get(method, {})
        d = {k: a[k] - b.get(k, 0.0) for k in a}
        if d["drafts"] <= 0:
            continue
        res[method] = {**d, "acceptance_rate": d["accepted"] / d["draft_tokens"],
                       "mean_acceptance_length": 1 + d["accepted"] / d["drafts"]}
    return res
