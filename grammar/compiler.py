"""GrammarCompiler: StructuredSpec -> compiled grammar, bounded in size and time, cached (LRU).

Compilation runs on the compiler's own worker threads (never on an event loop; the HTTP layer calls
`compile` from a thread as well) and is abandoned after `timeout_s`: the request gets a 400 while the
library's own fuel limits end the work in the background. Failures are cached too, so a client that
resends an over-limit grammar costs one compile, not one per request.
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

from specserve.grammar.backend import CompiledGrammar, GrammarBackend, GrammarError
from specserve.grammar.state import GrammarState
from specserve.sampling.params import STRUCTURED_KINDS, StructuredSpec


@dataclass(frozen=True)
class GrammarLimits:
    max_bytes: int = 65536          # schema / regex / grammar text size
    timeout_s: float = 5.0          # compile time
    cache_size: int = 256           # compiled grammars kept (LRU)


class GrammarCompiler:
    def __init__(self, backend: GrammarBackend, limits: GrammarLimits = GrammarLimits()) -> None:
        self.backend = backend
        self.limits = limits
        self._cache: OrderedDict[StructuredSpec, CompiledGrammar | GrammarError] = OrderedDict()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="specserve-grammar")
        self.compile_seconds: list[float] = []      # of every compile that ran (cache misses), for benchmarks

    def check(self, spec: StructuredSpec) -> None:
        """Cheap checks before any compile work."""
        if spec.kind not in STRUCTURED_KINDS:
            raise GrammarError(f"unknown constraint kind {spec.kind!r}; one of {STRUCTURED_KINDS}")
        size = len(spec.value.encode("utf-8"))
        if size > self.limits.max_bytes:
            raise GrammarError(f"the {spec.kind} constraint is {size} bytes; this server takes at most "
                               f"{self.limits.max_bytes} (--max-grammar-bytes)")

    def compile(self, spec: StructuredSpec) -> CompiledGrammar:
        self.check(spec)
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
        if hit is None:
            hit = self._compile_bounded(spec)
            with self._lock:
                self._cache[spec] = hit
                while len(self._cache) > self.limits.cache_size:
                    self._cache.popitem(last=False)
        if isinstance(hit, GrammarError):
            raise hit
        return hit

    def start(self, spec: StructuredSpec) -> GrammarState:
        """A request's grammar state at the start of its output."""
        return GrammarState(self.compile(spec).matcher(), self.backend.vocab_size)

    def _compile_bounded(self, spec: StructuredSpec) -> CompiledGrammar | GrammarError:
        t0 = time.perf_counter()
        future = self._pool.submit(self.backend.compile, spec.kind, spec.value)
        try:
            compiled = future.result(timeout=self.limits.timeout_s)
        except FutureTimeout:
            return GrammarError(f"compiling the {spec.kind} constraint took longer than "
                                f"{self.limits.timeout_s:g} s (--grammar-compile-timeout)")
        except GrammarError as exc:
            return exc
        except Exception as exc:     # a library failure on odd input is still the input's problem: a 400
            return GrammarError(f"the {spec.kind} constraint could not be compiled: {exc}")
        self.compile_seconds.append(time.perf_counter() - t0)
        return compiled

    @property
    def cache_len(self) -> int:
        return len(self._cache)
