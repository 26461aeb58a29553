"""Build a C++ source of this package into a shared library on the machine that runs it, once, cached.

Used by the paged attention kernel (paged_kernel.py) and the bf16 linear kernel (bf16_gemm.py). The kernels
include only the C++ standard library and compiler intrinsics (a second or two with g++) and are called
through ctypes; the linear kernel's torch operator also includes a few torch headers (`extra` flags, ~5 s).
The library goes into a cache folder keyed by the sources, the
compiler and the CPU (SPECSERVE_KERNEL_CACHE, default ~/.cache/specserve/kernels): an image built on one
machine still gets code for the CPU it runs on. `-march=native` falls back to generic -O3. OpenMP resolves
to the libgomp torch has already loaded (same soname), so the kernels share torch's threads.
"""
from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable, MutableMapping, Sequence
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")
FLAG_SETS = (["-O3", "-march=native"], ["-O3"])


def cache_dir() -> Path:
    return Path(os.environ.get("SPECSERVE_KERNEL_CACHE", Path.home() / ".cache" / "specserve" / "kernels"))


def _cpuinfo() -> str | None:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return None


def cpu_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    text = _cpuinfo() or ""
    return {flag for line in text.splitlines() if line.startswith("flags") for flag in line.split(":", 1)[1].split()}


def _cpu_signature() -> str:
    text = _cpuinfo()
    if text is None:
        return platform.processor()
    lines = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(lines)))


def compiler() -> str:
    found = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if found is None:
        raise RuntimeError("no C++ compiler (g++ / c++ / $CXX) on PATH")
    return found


def build(source: Path, headers: Sequence[Path] = (), extra: Sequence[str] = (), key_text: str = "") -> Path:
    """The shared library of `source` for this machine: from the cache, else compiled into it (atomically:
    concurrent builders never see a half-written file). `extra`: more compiler and linker arguments; they and
    `key_text` (e.g. the torch version a library links against) are part of the cache key.
    Raises RuntimeError / OSError when nothing builds."""
    cxx = compiler()
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=True).stdout
    text = source.read_bytes() + b"".join(h.read_bytes() for h in headers)
    key = hashlib.sha256(text + version.encode() + _cpu_signature().encode() + " ".join([*extra, key_text]).encode()
                         ).hexdigest()[:16]
    target = cache_dir() / f"{source.stem}-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    errors = []
    for flags in FLAG_SETS:
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            out = Path(tmp) / target.name
            cmd = [cxx, *flags, "-fopenmp", "-std=c++17", "-shared", "-fPIC", str(source), *extra,
                   "-o", str(out)]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode == 0:
                os.replace(out, target)
                return target
            errors.append(f"{' '.join(flags)}: {proc.stderr.strip()[-400:]}")
    raise RuntimeError("; ".join(errors))


def load_once(state: MutableMapping[str, object], lock: threading.Lock, open_lib: Callable[[], T | None]) -> T | None:
    """state["lib"], opened by `open_lib` on the first call (None where it cannot be; `open_lib` keeps the
    reason in state["error"]). Thread-safe; a module's tests may swap state["lib"]."""
    with lock:
        if "lib" not in state:
            state["lib"] = open_lib()
        return state["lib"]
