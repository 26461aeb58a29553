"""Hand the CPU's OpenMP workers to the engine thread: release the pool of the thread that built the engine.

torch on CPU runs its parallel ops on libgomp, which keeps one pool of worker threads per thread that
ever ran a parallel op. The server builds the engine (weights, warm-up, compile) on one thread and then
steps it on another, so two pools live on. libgomp counts every worker of every pool, and once that
count exceeds the CPUs it shortens how long an idle worker spins before it sleeps to almost nothing;
every parallel region of a decode step then waits for futex wake-ups. Measured here (2 cores, bf16):
a 1x1024 @ 1024x4096 linear takes 215 us on a thread whose process has one pool and 276-381 us while
the builder's pool lives on; the server decoded at 0.63x of the same engine offline.

With one pool the default wait policy is the right one: served through HTTP (embedded target, bf16,
128-token greedy requests, code_completion) plain decoding ran 125-127 tok/s at concurrency 1 and
839-1034 at 16, against 74-91 and 667-807 with OMP_WAIT_POLICY=PASSIVE (which the server set until
this was found; it only looked best while two pools lived) and no better with GOMP_SPINCOUNT=1e7.

`release_thread_pool()` ends the calling thread's pool (OpenMP 5's omp_pause_resource_all, which
libgomp implements for the host as "free this thread's pool"); a later parallel op on that thread would
simply start a new one. It touches every libgomp the process has mapped (torch's own, and the system's
that torch.compile'd kernels may load) and does nothing where there is none (e.g. macOS, Intel OpenMP).
"""
from __future__ import annotations

import ctypes
import logging
import os

log = logging.getLogger(__name__)

OMP_PAUSE_SOFT = 1      # omp_pause_resource_t: keep the runtime, stop the threads


def loaded_libgomp() -> list[str]:
    """Paths of the libgomp copies mapped into this process (Linux /proc/self/maps; [] elsewhere)."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    paths = []
    for line in lines:
        fields = line.split(maxsplit=5)          # address perms offset dev inode [path]
        path = fields[5].strip() if len(fields) == 6 else ""
        if os.path.basename(path).startswith("libgomp") and path not in paths:
            paths.append(path)
    return paths


def release_thread_pool() -> int:
    """End the calling thread's OpenMP worker pool in every loaded libgomp; returns how many were asked."""
    released = 0
    for path in loaded_libgomp():
        try:
            lib = ctypes.CDLL(path)
            pause = lib.omp_pause_resource_all
        except (OSError, AttributeError):       # too old a libgomp (< GCC 9) or not loadable: leave it
            continue
        pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
        if pause(OMP_PAUSE_SOFT) == 0:
            released += 1
    log.debug("released this thread's OpenMP pool in %d libgomp copies", released)
    return released
