"""Typed messages between the HTTP front end and the engine (thread or process; both pickle cleanly).

Front end -> engine:  AddRequest, Abort, Stop.
Engine -> front end (engine process only, server/engine/engine_worker.py):
  Ready(info) or Failed(exception, traceback) once, at start;
  StepDone(outputs, stats, gauges)  once per step;
  Reply(request_id, item)           a refused add (the exception) or an abort's final output;
  GaugesChanged(gauges)             load changed while idle (e.g. an abort of a waiting request);
  Dead(exception)                   a step raised; the process then exits.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from specserve.sampling.params import SamplingParams
from specserve.server.engine.request_checks import RequestChecks
from specserve.speculators.base import SpecParams


@dataclass(frozen=True)
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    spec: SpecParams
    prediction_token_ids: list[int] | None = None
    prompt_logprobs: bool = False


@dataclass(frozen=True)
class Abort:
    request_id: str


@dataclass(frozen=True)
class Stop:
    pass


Command = AddRequest | Abort | Stop


@dataclass(frozen=True)
class EngineInfo:
    model_name: str
    methods: list[str]
    checks: RequestChecks
    tokenizer_dir: str


@dataclass(frozen=True)
class Gauges:
    num_running: int
    num_waiting: int
    num_free_kv_blocks: int


@dataclass(frozen=True)
class Ready:
    info: EngineInfo


@dataclass(frozen=True)
class Failed:
    error: BaseException
    traceback: str


@dataclass(frozen=True)
class StepDone:
    outputs: list[Any]            # RequestOutput per request that produced something
    stats: Any                    # StepStats
    gauges: Gauges


@dataclass(frozen=True)
class Reply:
    request_id: str
    item: Any                     # an exception (refused add) or the final RequestOutput (abort)


@dataclass(frozen=True)
class GaugesChanged:
    gauges: Gauges


@dataclass(frozen=True)
class Dead:
    error: BaseException
