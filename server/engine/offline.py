"""Synchronous batch generation on an Engine (benchmarks and tests; no HTTP, no asyncio)."""
from __future__ import annotations

from dataclasses import dataclass, field

from specserve.sampling.outputs import TokenLogprob
from specserve.sampling.params import SamplingParams
from specserve.server.config import EngineConfig
from specserve.server.engine.engine import Engine
from specserve.speculators.base import SpecParams, SpecStats

NO_SPECULATION = SpecParams()


@dataclass
class Completion:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    spec_stats: SpecStats | None = None
    num_steps: int = 0                       # engine steps that emitted tokens for this request


class OfflineEngine:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._n = 0

    @classmethod
    def from_config(cls, cfg: EngineConfig) -> OfflineEngine:
        from specserve.server.engine.builder import build_engine
        return cls(build_engine(cfg)[0])

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                 spec: SpecParams | list[SpecParams] = NO_SPECULATION,
                 predictions: list[list[int] | None] | None = None) -> list[Completion]:
        n = len(prompts)
        params_l = params if isinstance(params, list) else [params] * n
        spec_l = spec if isinstance(spec, list) else [spec] * n
        preds = predictions or [None] * n
        ids = []
        for p, sp, sc, pr in zip(prompts, params_l, spec_l, preds):
            rid = f"offline-{self._n}"
            self._n += 1
            self.engine.add_request(rid, p, sp, sc, prediction_token_ids=pr)
            ids.append(rid)
        results = {rid: Completion() for rid in ids}
        while self.engine.has_work:
            outputs, _ = self.engine.step()
            for out in outputs:
                c = results.get(out.request_id)
                if c is None:
                    continue
                if out.token_ids:
                    c.num_steps += 1
                c.token_ids += out.token_ids
                c.text += out.text
                c.logprobs += out.logprobs or []
                if out.finished:
                    c.finish_reason = out.finish_reason
                    c.spec_stats = out.spec_stats
        return [results[r] for r in ids]
