"""AsyncEngine: the asyncio facade with the engine stepping on a thread of this process.

The event loop never blocks on the model: `generate()` (server/engine/frontend.py) enqueues a command and
awaits a per-request asyncio.Queue that the engine thread fills through `loop.call_soon_threadsafe` once
per step. When the consumer stops iterating (client disconnected, task cancelled), the request is
aborted at the next step boundary and its KV blocks are freed. The thread shares the GIL with the event
loop; process_engine.ProcessEngine is the same front end with the engine in a process of its own.

CPU threads: the builder's OpenMP worker pool is released before the engine thread starts, so the
engine thread's pool is the only one (server/engine/omp_pool.py; the server decoded at 0.63x of the
offline engine while both lived).

Failure containment: a request the engine refuses to add (any exception, not only ValueError) fails
alone and is cleaned up; an exception inside `step()` marks the engine dead (`dead`), and every
request in flight or arriving later gets EngineDeadError instead of waiting forever.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable

from specserve.sampling.params import SamplingParams
from specserve.server.config import EngineConfig
from specserve.server.engine.engine import Engine
from specserve.server.engine.frontend import EngineFrontend
from specserve.server.engine.messages import Abort, AddRequest
from specserve.server.engine.omp_pool import release_thread_pool
from specserve.server.engine.stats import StepStats
from specserve.speculators.base import SpecParams

log = logging.getLogger(__name__)


class AsyncEngine(EngineFrontend):
    def __init__(self, engine: Engine, config: EngineConfig, model_name: str,
                 on_step: Callable[[StepStats], None] | None = None) -> None:
        super().__init__(config, model_name, on_step)
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.grammars = engine.grammars     # shared: the HTTP side's compile warms the engine's cache
        self.max_model_len = engine.max_model_len
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = False
        # The thread that built the engine hands its OpenMP workers over: two live pools on a small CPU
        # make every parallel op of a step wait for wake-ups (server/engine/omp_pool.py).
        release_thread_pool()
        self._thread = threading.Thread(target=self._run, name="specserve-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, cfg: EngineConfig, on_step: Callable[[StepStats], None] | None = None
                    ) -> AsyncEngine:
        from specserve.server.engine.builder import build_engine
        engine, name = build_engine(cfg)
        return cls(engine, cfg, name, on_step)

    @property
    def methods(self) -> list[str]:
        return self.engine.spec.methods

    def _check_spec(self, params: SpecParams) -> None:
        self.engine.spec.validate(params)

    def _check(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.engine.validate(prompt_token_ids, params)

    @property
    def num_running(self) -> int:
        return len(self.engine.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.engine.scheduler.waiting)

    # Read from the event loop while the engine thread runs: each read is one atomic len().
    @property
    def num_kv_blocks(self) -> int:
        return self.engine.scheduler.bm.num_blocks

    @property
    def num_free_kv_blocks(self) -> int:
        return self.engine.scheduler.bm.num_free_blocks

    async def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        await asyncio.to_thread(self._thread.join, 10)
        await asyncio.to_thread(self.engine.runner.close)      # tensor-parallel ranks, if any

    def _send(self, cmd: AddRequest | Abort) -> None:
        self._commands.put(cmd)
        self._wake.set()

    # -- engine thread -----------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop:
            try:
                self._drain_commands()
                if not self.engine.has_work:
                    self._wake.wait(0.5)
                    self._wake.clear()
                    continue
                outputs, stats = self.engine.step()
                if self.on_step is not None:      # metrics first: a finished response's steps are in /metrics
                    self.on_step(stats)
                self._deliver(outputs)
            except Exception as exc:   # an engine bug must fail requests, not hang them
                log.exception("engine step failed")
                self._die(exc)
                return

    def _drain_commands(self) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            apply_command(self.engine, cmd, self._deliver_one)


def apply_command(engine: Engine, cmd: AddRequest | Abort, reply: Callable[[str, object], None]) -> None:
    """Carry out one front-end command (AddRequest or Abort) on the engine; `reply(request_id, item)` hands
    a request its refusal (an exception) or its final output out of band."""
    if isinstance(cmd, AddRequest):
        rid = cmd.request_id
        try:
            engine.add_request(rid, cmd.prompt_token_ids, cmd.params, cmd.spec, cmd.prediction_token_ids,
                               cmd.prompt_logprobs)
        except ValueError as exc:
            reply(rid, exc)
        except Exception as exc:   # one request's bug must not kill the engine
            log.exception("adding request %s failed", rid)
            engine.abort(rid)          # undo whatever part of the add happened
            reply(rid, exc)
    elif isinstance(cmd, Abort):
        out = engine.abort(cmd.request_id)
        if out is not None:
            reply(cmd.request_id, out)
