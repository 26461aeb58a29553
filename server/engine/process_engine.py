"""ProcessEngine: the front end of an engine that steps in a process of its own (`--engine-process`).

Why: with the engine on a thread of the server's process (AsyncEngine), the event loop and the engine
share one GIL. Every chunk the event loop writes (JSON, HTTP framing, the socket write) holds it, and the
engine thread, which drops and retakes the GIL around every torch op of its step, waits for it: the
chunk's cost is added to the step instead of running beside it. Measured on 2 cores (embedded target,
bf16, compiled, greedy, batch 1, HTTP tok/s ÷ the same engine without HTTP, interleaved per prompt):
with one torch thread and a free core, in-thread 0.83 vs this 0.91, so part of the loss is the shared
lock. With two torch threads the engine's OpenMP workers fill both cores and the front end competes for
CPU instead: this mode was 0.00-0.10 faster than in-thread in four runs (noise ±0.05), and equal at
concurrency 16. It is opt-in until a machine with spare cores (or a GPU node) shows where it pays.

Here the engine process (engine_worker.py) owns the model; this process keeps the tokenizer (prompts
are tokenized before they reach the engine) and checks every request against the engine's shape
(request_checks.py) and the speculators' option rules, so refusals stay immediate 400s. Two threads
move messages: a sender, so that the event loop never blocks on a full pipe, and a reader, which
calls on_step (metrics) and delivers each step's outputs to the requests' queues. If the engine
process dies, every request in flight fails with EngineDeadError and /health turns unhealthy, as
when AsyncEngine's thread dies.
"""
from __future__ import annotations

import asyncio
import logging
import multiprocessing
import queue
import threading
from collections.abc import Callable

from specserve.sampling.params import SamplingParams
from specserve.server.config import EngineConfig
from specserve.server.engine.builder import build_grammar_compiler
from specserve.server.engine.engine_worker import worker_main
from specserve.server.engine.frontend import EngineFrontend
from specserve.server.engine.messages import (
    Abort,
    AddRequest,
    Dead,
    EngineInfo,
    Failed,
    Gauges,
    GaugesChanged,
    Reply,
    StepDone,
    Stop,
)
from specserve.server.engine.spec_dispatch import validate_spec
from specserve.server.engine.stats import StepStats
from specserve.server.engine.tokenizer import Tokenizer
from specserve.speculators.base import SpecParams

log = logging.getLogger(__name__)

STOP_TIMEOUT_S = 10.0


class EngineStartError(RuntimeError):
    """The engine process failed while building the engine (its traceback is logged)."""


class ProcessEngine(EngineFrontend):
    def __init__(self, config: EngineConfig, on_step: Callable[[StepStats], None] | None = None) -> None:
        ctx = multiprocessing.get_context("spawn")      # fork would copy this process's threads' locks
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=worker_main, name="specserve-engine", daemon=True,
                                 args=(child, config, logging.getLogger().getEffectiveLevel()))
        self._proc.start()
        child.close()
        info = self._await_ready()
        super().__init__(config, info.model_name, on_step)
        self.info = info
        self.tokenizer = Tokenizer(info.tokenizer_dir)
        # checks structured-output constraints before they cross the pipe (the engine compiles its own)
        self.grammars = build_grammar_compiler(config, info.tokenizer_dir, info.checks.vocab_size,
                                               self.tokenizer.eos_token_ids)
        self.max_model_len = info.checks.max_model_len
        self._gauges = Gauges(0, 0, info.checks.num_blocks)
        self._stopping = False
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._sender = threading.Thread(target=self._send_loop, name="specserve-engine-send", daemon=True)
        self._sender.start()
        self._reader = threading.Thread(target=self._read_loop, name="specserve-engine-read", daemon=True)
        self._reader.start()

    @classmethod
    def from_config(cls, cfg: EngineConfig, on_step: Callable[[StepStats], None] | None = None
                    ) -> ProcessEngine:
        return cls(cfg, on_step)

    def _await_ready(self) -> EngineInfo:
        try:
            msg = self._conn.recv()
        except (EOFError, OSError):
            self._proc.join(STOP_TIMEOUT_S)
            raise EngineStartError(f"the engine process exited while starting (exit code "
                                   f"{self._proc.exitcode})") from None
        if isinstance(msg, Failed):
            log.error("building the engine failed in the engine process:\n%s", msg.traceback)
            self._proc.join(STOP_TIMEOUT_S)
            raise msg.error
        return msg.info

    # -- what EngineFrontend needs -----------------------------------------------------------------
    @property
    def methods(self) -> list[str]:
        return self.info.methods

    def _check(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.info.checks.validate(prompt_token_ids, params)

    def _check_spec(self, params: SpecParams) -> None:
        validate_spec(params)

    def _send(self, cmd: AddRequest | Abort) -> None:
        self._outbox.put(cmd)

    @property
    def num_running(self) -> int:
        return self._gauges.num_running

    @property
    def num_waiting(self) -> int:
        return self._gauges.num_waiting

    @property
    def num_kv_blocks(self) -> int:
        return self.info.checks.num_blocks

    @property
    def num_free_kv_blocks(self) -> int:
        return self._gauges.num_free_kv_blocks

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    async def shutdown(self) -> None:
        await asyncio.to_thread(self._stop_process)

    # -- threads -----------------------------------------------------------------------------------
    def _stop_process(self) -> None:
        self._stopping = True
        self._outbox.put(Stop())
        self._proc.join(STOP_TIMEOUT_S)
        if self._proc.is_alive():
            log.warning("the engine process did not stop in %.0f s; terminating it", STOP_TIMEOUT_S)
            self._proc.kill()
            self._proc.join(STOP_TIMEOUT_S)
        self._outbox.put(None)
        self._reader.join(STOP_TIMEOUT_S)
        self._conn.close()

    def _send_loop(self) -> None:
        while (cmd := self._outbox.get()) is not None:
            try:
                self._conn.send(cmd)
            except (OSError, ValueError):       # the engine process is gone; the reader reports it
                pass
            if isinstance(cmd, Stop):
                return

    def _read_loop(self) -> None:
        while True:
            try:
                msg = self._conn.recv()
            except (EOFError, OSError):
                if not self._stopping:
                    self._proc.join(1.0)
                    log.error("the engine process exited (exit code %s)", self._proc.exitcode)
                    self._die(RuntimeError(f"the engine process exited (exit code {self._proc.exitcode})"))
                return
            if isinstance(msg, StepDone):
                self._gauges = msg.gauges
                if self.on_step is not None:      # metrics first: a finished response's steps are in /metrics
                    try:
                        self.on_step(msg.stats)
                    except Exception:      # metrics must not stop the outputs
                        log.exception("on_step failed")
                self._deliver(msg.outputs)
            elif isinstance(msg, Reply):
                self._deliver_one(msg.request_id, msg.item)
            elif isinstance(msg, GaugesChanged):
                self._gauges = msg.gauges
            elif isinstance(msg, Dead):
                log.error("the engine process failed: %s", msg.error)
                self._die(msg.error)
