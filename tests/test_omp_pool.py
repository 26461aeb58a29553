"""release_thread_pool ends the calling thread's OpenMP workers (server/engine/omp_pool.py).

Run in a fresh interpreter so the thread count is this test's alone.
"""
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

SCRIPT = r"""
import os, threading, torch
from specserve.server.engine.omp_pool import loaded_libgomp, release_thread_pool

def threads():
    return len(os.listdir("/proc/self/task"))

def busy():
    torch.randn(1 << 22).exp_().sum()           # an at::parallel_for op: starts this thread's pool

torch.set_num_threads(2)
start = threads()
out = {}
def builder():
    busy()
    out["with_pool"] = threads()
    out["released"] = release_thread_pool()
    out["after"] = threads()
    busy()                                      # a later op on the same thread starts a new pool
    out["again"] = threads()
t = threading.Thread(target=builder)
t.start(); t.join()
print(start, out["with_pool"], out["released"], out["after"], out["again"], len(loaded_libgomp()))
"""


def test_release_ends_the_calling_threads_pool_and_a_later_op_starts_one():
    res = subprocess.run([sys.executable, "-c", SCRIPT], check=False, cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    start, with_pool, released, after, again, n_gomp = map(int, res.stdout.split())
    assert n_gomp >= 1                          # torch's CPU wheel runs on libgomp
    assert with_pool == start + 2               # the builder thread and its one worker
    assert released == n_gomp
    assert after == with_pool - 1               # the worker is gone
    assert again == with_pool                   # and comes back when needed
