"""`specserve.LLM`: generation in this process, without HTTP (benchmarks, notebooks, batch jobs).

    from specserve import LLM, SamplingParams
    llm = LLM()                                   # the embedded model family; LLM(model="path/to/hf-dir")
    out = llm.generate(["def add(a, b):"], SamplingParams(max_tokens=32),
                       speculation={"method": "ngram", "num_speculative_tokens": 4})
    print(out[0].text, out[0].spec_stats)

Engine options are EngineConfig's fields (the server's flags, `--kv-cache-memory-gb` -> kv_cache_memory_gb).
`speculation` takes what a request's `speculation` field takes (a dict, JSON text or SpecParams); without it
the engine's default applies: `speculation=` given to the constructor (as the server's `--speculation`), else
the best method loaded, as the server chooses it (speculators/registry.py `default_speculation`).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from specserve.sampling.params import SamplingParams
from specserve.server.config import EngineConfig, parse_speculation
from specserve.server.engine.builder import build_engine
from specserve.server.engine.engine import Engine
from specserve.server.engine.offline import Completion, OfflineEngine
from specserve.speculators.base import SpecParams

SpecLike = SpecParams | dict | str | None


def as_spec_params(value: SpecLike, default: SpecParams) -> SpecParams:
    if value is None:
        return default
    return value if isinstance(value, SpecParams) else parse_speculation(value)


class LLM:
    def __init__(self, model: str | None = None, *, speculation: SpecLike = None,
                 config: EngineConfig | None = None, **options: Any) -> None:
        cfg = config if config is not None else EngineConfig(model=model, **options)
        if speculation is not None:
            cfg.speculation = as_spec_params(speculation, SpecParams())
        engine, self.model_name = build_engine(cfg)
        self._attach(engine, cfg.default_speculation(list(engine.spec.methods)))

    @classmethod
    def from_engine(cls, engine: Engine, speculation: SpecLike = None, model_name: str = "engine") -> LLM:
        """Wrap an engine built elsewhere (e.g. one instrumented by a benchmark)."""
        llm = cls.__new__(cls)
        llm.model_name = model_name
        llm._attach(engine, as_spec_params(speculation, SpecParams()))
        return llm

    def _attach(self, engine: Engine, default: SpecParams) -> None:
        self.engine = engine                 # the Engine itself: for profilers and benchmark timers
        self.default_speculation = default
        self._offline = OfflineEngine(engine)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def methods(self) -> list[str]:
        """The speculation methods this engine has loaded ('none' first)."""
        return list(self.engine.spec.methods)

    def generate(self, prompts: str | Sequence[str] | Sequence[Sequence[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 speculation: SpecLike | Sequence[SpecLike] = None,
                 predictions: Sequence[list[int] | None] | None = None) -> list[Completion]:
        """One Completion per prompt, in order; prompts are text or token ids. Lists of sampling params
        or speculation choices give one per prompt; `predictions` are Predicted Outputs as token ids."""
        if isinstance(prompts, str):
            prompts = [prompts]
        ids = [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
        params = sampling_params if sampling_params is not None else SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(ids)
        specs = (speculation if isinstance(speculation, (list, tuple)) else [speculation] * len(ids))
        specs = [as_spec_params(s, self.default_speculation) for s in specs]
        for s in specs:
            if s.method not in self.methods:
                raise ValueError(f"speculation method {s.method!r} is not loaded here; loaded: {self.methods}")
            self.engine.spec.validate(s)
        return self._offline.generate(ids, list(params), specs, list(predictions) if predictions else None)
