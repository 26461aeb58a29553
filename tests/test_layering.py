"""The import direction is checked by import-linter's contracts in pyproject.toml, on the installed layout
(grimp walks a package's own folder, so it reads the files as a wheel lays them out under specserve/)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from packaging_support import REPO, install_target


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return install_target(tmp_path_factory.mktemp("layout") / "site")


def lint_imports(site: Path, cwd: Path) -> subprocess.CompletedProcess:
    lint = Path(sys.executable).with_name("lint-imports")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(REPO)])}
    return subprocess.run([str(lint), str(REPO / "pyproject.toml"), "--no-cache"], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def test_the_contracts_hold(installed, tmp_path):
    out = lint_imports(installed, tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "3 kept, 0 broken" in out.stdout


@pytest.mark.parametrize("module,planted,contract", [
    ("specserve/speculators/draft_kv.py", "import specserve.server.engine.scheduler",
     "request path"),                                          # a drafter reaching up into the engine
    ("specserve/sampling/params.py", "from specserve.server.models import config",
     "request path"),                                          # sampling is the bottom layer
    ("specserve/server/engine/engine.py", "import loadtest.prompt_sets",
     "the package never imports the tools built on it"),
])
def test_a_planted_forbidden_import_breaks_a_contract(installed, tmp_path, module, planted, contract):
    site = tmp_path / "site"
    shutil.copytree(installed, site)
    path = site / module
    path.write_text(path.read_text() + f"\n{planted}  # planted\n")
    out = lint_imports(site, tmp_path)
    assert out.returncode != 0
    assert "1 broken" in out.stdout and contract in out.stdout.replace("\n", " ")
