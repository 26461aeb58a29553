"""The Python heap a server starts with: frozen out of the garbage collector once the engine is built.

Loading the model, the tokenizer, the compiled graphs and the numba kernels leaves ~550k tracked Python objects
that live as long as the server. CPython's oldest-generation collection walks all of them: 190-240 ms each
with the embedded model compiled (2-core Xeon), a stall of every stream in flight whenever one comes due while
serving; frozen, the same collection takes under 0.1 ms. `gc.freeze()` moves them to a permanent generation
that no collection scans; objects made while serving are collected as before.
"""
from __future__ import annotations

import gc
import logging

log = logging.getLogger(__name__)


def freeze_startup_objects() -> int:
    """Collect the start-up garbage, then freeze what is left. Returns how many objects are frozen."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("start-up heap frozen out of garbage collection: %d objects", frozen)
    return frozen
