"""numba's compiler for the lookups' loops (speculators/suffix_kernels.py, speculators/ngram_match.py).

`compiled(fn)` is `numba.njit(cache=True, nogil=True)(fn)`: the machine code is kept beside the source or in the
user's cache directory (~/.cache/numba, or NUMBA_CACHE_DIR), so a second process loads it in milliseconds. Where
no such directory is writable (a read-only file system and no home), numba refuses to cache; the loops are then
compiled in each process (about 1.5 s at start-up) instead of failing the import.
"""
from __future__ import annotations

import logging
from collections.abc import Callable

import numba

log = logging.getLogger(__name__)


def compiled(fn: Callable) -> Callable:
    try:
        return numba.njit(cache=True, nogil=True)(fn)
    except RuntimeError as exc:           # "cannot cache function ...: no locator available"
        log.info("numba cannot cache %s (%s): compiling it in this process", fn.__name__, exc)
        return numba.njit(nogil=True)(fn)
