"""Builds the installed layout of this distribution once per test session (pip install --target: the same
files a wheel puts in site-packages), for the packaging and import-contract tests."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def install_target(dest: Path, *requirements: str) -> Path:
    """`pip install --no-deps --target dest` of this checkout (as a wheel) plus `requirements`."""
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--disable-pip-version-check",
           "--target", str(dest), str(REPO), *requirements]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    return dest
