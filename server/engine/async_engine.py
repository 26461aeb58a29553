"""AsyncEngine: the asyncio facade. Steps run on one engine thread; outputs flow back per request.

The event loop never blocks on the model: `generate()` enqueues a command and awaits a per-request
asyncio.Queue that the engine thread fills through `loop.call_soon_threadsafe` once per step. When the
consumer stops iterating (client disconnected, task cancelled), the request is aborted at the next step
boundary and its KV blocks are freed.

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
from collections.abc import AsyncIterator, Callable

from sampling.params import SamplingParams
from server.config import EngineConfig, parse_speculation
from server.engine.engine import Engine
from server.engine.errors import EngineDeadError
from server.engine.omp_pool import release_thread_pool
from server.engine.outputs import RequestOutput
from server.engine.stats import StepStats
from speculators.base import SpecParams

log = logging.getLogger(__name__)


class AsyncEngine:
    def __init__(self, engine: Engine, config: EngineConfig, model_name: str,
                 on_step: Callable[[StepStats], None] | None = None) -> None:
        self.engine = engine
        self.config = config
        self.model_name = model_name
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.on_step = on_step
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stop = False
        self.dead: BaseException | None = None
        # The thread that built the engine hands its OpenMP workers over: two live pools on a small CPU
        # make every parallel op of a step wait for wake-ups (server/engine/omp_pool.py).
        release_thread_pool()
        self._thread = threading.Thread(target=self._run, name="specserve-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, cfg: EngineConfig, on_step: Callable[[StepStats], None] | None = None
                    ) -> AsyncEngine:
        from server.engine.builder import build_engine
        engine, name = build_engine(cfg)
        return cls(engine, cfg, name, on_step)

    # -- what requests may choose ------------------------------------------------------------------
    def speculators(self) -> dict[str, int]:
        k = self.config.max_speculative_tokens
        return {m: (0 if m == "none" else k) for m in self.engine.spec.methods}

    def resolve_speculation(self, spec: dict | None) -> SpecParams:
        if spec is None:
            return self.config.speculation
        params = parse_speculation(spec)
        loaded = self.speculators()
        if params.method not in loaded:
            raise ValueError(f"speculation method {params.method!r} is not loaded on this server; "
                             f"loaded: {sorted(loaded)}")
        if not 0 <= params.num_speculative_tokens <= self.config.max_speculative_tokens:
            raise ValueError(f"num_speculative_tokens must be in [0, "
                             f"{self.config.max_speculative_tokens}], got {params.num_speculative_tokens}")
        self.engine.spec.validate(params)
        return params

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

    # -- requests ----------------------------------------------------------------------------------
    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       spec: SpecParams, prediction_token_ids: list[int] | None = None,
                       prompt_logprobs: bool = False) -> AsyncIterator[RequestOutput]:
        if self.dead is not None:
            raise EngineDeadError(f"the engine has failed: {self.dead}")
        self.engine.validate(prompt_token_ids, params)      # raises ValueError / ContextLengthError
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = (loop, q)
        if self.dead is not None:       # died between the check above and the registration
            self._queues.pop(request_id, None)
            raise EngineDeadError(f"the engine has failed: {self.dead}")
        self._send(("add", request_id, prompt_token_ids, params, spec, prediction_token_ids, prompt_logprobs))
        finished = False
        try:
            while not finished:
                item = await q.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            self._queues.pop(request_id, None)
            if not finished:
                self._send(("abort", request_id))

    async def abort(self, request_id: str) -> None:
        self._send(("abort", request_id))

    def fail_all(self, make_error: Callable[[], BaseException]) -> int:
        """Raise a fresh `make_error()` in every request's consumer (e.g. the server's drain deadline
        passed); each aborts its engine request as it unwinds. Returns how many were failed."""
        rids = list(self._queues)
        for rid in rids:
            self._deliver_one(rid, make_error())
        return len(rids)

    async def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        await asyncio.to_thread(self._thread.join, 10)

    def _send(self, cmd: tuple) -> None:
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
                self._deliver(outputs)
                if self.on_step is not None:
                    self.on_step(stats)
            except Exception as exc:   # an engine bug must fail requests, not hang them
                log.exception("engine step failed")
                self.dead = exc
                self._fail_all(EngineDeadError(f"the engine has failed: {exc}"))
                return

    def _drain_commands(self) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "add":
                _, rid, prompt, params, spec, pred, plp = cmd
                try:
                    self.engine.add_request(rid, prompt, params, spec, pred, plp)
                except ValueError as exc:
                    self._deliver_one(rid, exc)
                except Exception as exc:   # one request's bug must not kill the engine
                    log.exception("adding request %s failed", rid)
                    self.engine.abort(rid)          # undo whatever part of the add happened
                    self._deliver_one(rid, exc)
            elif cmd[0] == "abort":
                out = self.engine.abort(cmd[1])
                if out is not None:
                    self._deliver_one(cmd[1], out)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for out in outputs:
            entry = self._queues.get(out.request_id)
            if entry is not None:
                by_loop.setdefault(entry[0], []).append((entry[1], out))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_put_all, items)

    def _deliver_one(self, rid: str, item) -> None:
        entry = self._queues.get(rid)
        if entry is not None:
            entry[0].call_soon_threadsafe(entry[1].put_nowait, item)

    def _fail_all(self, exc: BaseException) -> None:
        for rid in list(self._queues):
            self._deliver_one(rid, exc)


def _put_all(items: list) -> None:
    for q, out in items:
        q.put_nowait(out)
