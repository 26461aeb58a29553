"""`make lint` in the suite: ruff, with the settings in pyproject.toml, clean on the whole tree."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_ruff_is_clean_on_the_whole_tree():
    ruff = Path(sys.executable).with_name("ruff")
    out = subprocess.run([str(ruff), "check", "--no-cache", "."], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
