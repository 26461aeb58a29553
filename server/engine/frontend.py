"""EngineFrontend: what the HTTP layer talks to, whichever way the engine steps behind it.

Requests go in as commands (`_send`); each request's outputs come back on its own asyncio.Queue, filled
from another thread through `loop.call_soon_threadsafe`. The engine itself steps on a thread of this
process (async_engine.AsyncEngine) or in a process of its own (process_engine.ProcessEngine); both
share everything here: admission checks, speculation choice, the per-request queues, abort when the
consumer stops iterating, and failing every request once the engine is dead.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from specserve.sampling.params import SamplingParams, StructuredSpec
from specserve.server.config import EngineConfig, parse_speculation
from specserve.server.engine.errors import EngineDeadError
from specserve.server.engine.messages import Abort, AddRequest
from specserve.server.engine.outputs import RequestOutput
from specserve.server.engine.stats import StepStats
from specserve.speculators.base import SpecParams


class EngineFrontend:
    """Subclasses set tokenizer, max_model_len, and implement `_send`, `_check`, `_check_spec`, `methods`,
    the four load gauges and `shutdown`."""

    def __init__(self, config: EngineConfig, model_name: str,
                 on_step: Callable[[StepStats], None] | None = None) -> None:
        self.config = config
        self.model_name = model_name
        self.on_step = on_step
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self.dead: BaseException | None = None

    # -- what requests may choose ------------------------------------------------------------------
    @property
    def methods(self) -> list[str]:
        raise NotImplementedError

    def speculators(self) -> dict[str, int]:
        k = self.config.max_speculative_tokens
        return {m: (0 if m == "none" else k) for m in self.methods}

    def resolve_speculation(self, spec: dict | None) -> SpecParams:
        if spec is None:
            return self.config.default_speculation(self.methods)
        params = parse_speculation(spec)
        loaded = self.speculators()
        if params.method not in loaded:
            raise ValueError(f"speculation method {params.method!r} is not loaded on this server; "
                             f"loaded: {sorted(loaded)}")
        if not 0 <= params.num_speculative_tokens <= self.config.max_speculative_tokens:
            raise ValueError(f"num_speculative_tokens must be in [0, "
                             f"{self.config.max_speculative_tokens}], got {params.num_speculative_tokens}")
        self._check_spec(params)
        return self.config.with_default_tree(params)

    async def check_structured(self, spec: StructuredSpec) -> None:
        """Compile a structured-output constraint on a worker thread, never on the event loop (GrammarError,
        a ValueError naming the problem, when it cannot be used). The compiled grammar stays cached."""
        grammars = getattr(self, "grammars", None)
        if grammars is None:
            raise ValueError("structured outputs are not available on this server")
        await asyncio.to_thread(grammars.compile, spec)

    # -- requests ----------------------------------------------------------------------------------
    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       spec: SpecParams, prediction_token_ids: list[int] | None = None,
                       prompt_logprobs: bool = False) -> AsyncIterator[RequestOutput]:
        if self.dead is not None:
            raise EngineDeadError(f"the engine has failed: {self.dead}")
        self._check(prompt_token_ids, params)      # raises ValueError / ContextLengthError
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = (loop, q)
        if self.dead is not None:       # died between the check above and the registration
            self._queues.pop(request_id, None)
            raise EngineDeadError(f"the engine has failed: {self.dead}")
        self._send(AddRequest(request_id, prompt_token_ids, params, spec, prediction_token_ids, prompt_logprobs))
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
                self._send(Abort(request_id))

    async def abort(self, request_id: str) -> None:
        self._send(Abort(request_id))

    def fail_all(self, make_error: Callable[[], BaseException]) -> int:
        """Raise a fresh `make_error()` in every request's consumer (e.g. the server's drain deadline
        passed); each aborts its engine request as it unwinds. Returns how many were failed."""
        rids = list(self._queues)
        for rid in rids:
            self._deliver_one(rid, make_error())
        return len(rids)

    # -- called from the thread that receives the engine's outputs ----------------------------------
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

    def _die(self, exc: BaseException) -> None:
        """The engine is gone: remember why and fail every request in flight."""
        self.dead = exc
        for rid in list(self._queues):
            self._deliver_one(rid, EngineDeadError(f"the engine has failed: {exc}"))

    # -- supplied by the subclass ------------------------------------------------------------------
    def _send(self, cmd: AddRequest | Abort) -> None:
        raise NotImplementedError

    def _check(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        raise NotImplementedError

    def _check_spec(self, params: SpecParams) -> None:
        raise NotImplementedError


def _put_all(items: list) -> None:
    for q, out in items:
        q.put_nowait(out)
