"""The distribution claims one import name, `specserve`, and installs beside vLLM's `speculators` library.

The folders server/, speculators/, sampling/ install as specserve.server, specserve.speculators,
specserve.sampling (pyproject.toml's package-dir mapping). A second venv gets the plain wheel next to the
real speculators 0.9.0 wheel and serves a request from another directory.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import venv
from pathlib import Path

import httpx
import pytest
import tomllib
from conftest import ServerProcess
from packaging_support import REPO, install_target

SPECULATORS_PIN = "speculators==0.9.0"      # vLLM's checkpoint library: its top-level name is `speculators`
FOLDERS = {"server": "specserve.server", "speculators": "specserve.speculators", "sampling": "specserve.sampling",
           "grammar": "specserve.grammar", "specserve": "specserve"}
BARE_IMPORT = re.compile(r"^\s*(from|import) (server|speculators|sampling|grammar)\b", re.M)


@pytest.fixture(scope="module")
def side_by_side(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv holding our wheel and the real speculators wheel; other dependencies come from the test venv
    through a .pth line (that venv's own .pth files, the editable finder among them, are not processed)."""
    root = tmp_path_factory.mktemp("side-by-side")
    venv.create(root / "venv", with_pip=False)
    site = next((root / "venv" / "lib").glob("python3*/site-packages"))
    install_target(site, SPECULATORS_PIN)
    deps = next(p for p in map(Path, sys.path) if p.name == "site-packages" and p.is_dir())
    (site / "zz_test_deps.pth").write_text(str(deps) + "\n")
    return root / "venv" / "bin" / "python"


def run_elsewhere(python: Path, code: str, cwd: Path) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "SPECSERVE_MODELS_DIR")}
    out = subprocess.run([str(python), "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_every_package_folder_is_installed_under_specserve():
    tool = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    for folder, name in FOLDERS.items():
        assert tool["package-dir"][name] == folder
    rel = [p.relative_to(REPO).parent.parts for folder in FOLDERS for p in (REPO / folder).rglob("__init__.py")]
    found = {".".join((FOLDERS[parts[0]], *parts[1:])) for parts in rel}
    assert found == set(tool["packages"])


def test_the_installed_distribution_claims_specserve_only(tmp_path):
    target = install_target(tmp_path / "t")
    dist = next(target.glob("specserve-*.dist-info"))
    assert (dist / "top_level.txt").read_text().split() == ["specserve"]
    assert sorted(p.name for p in target.iterdir() if not p.name.endswith(".dist-info")
                  and p.name != "bin") == ["specserve"]
    assert (target / "specserve" / "speculators" / "registry.py").is_file()
    assert (target / "specserve" / "server" / "engine" / "probe_long.txt").is_file()    # the probe's long text


def test_no_file_imports_the_bare_folder_names():
    offenders = [str(p.relative_to(REPO)) for folder in ("server", "speculators", "sampling", "specserve",
                                                          "tests", "loadtest", "training")
                 for p in (REPO / folder).rglob("*.py") if BARE_IMPORT.search(p.read_text(encoding="utf-8"))]
    assert offenders == []


def test_the_editable_install_leaves_vllms_speculators_alone(tmp_path):
    """The test venv holds the real speculators wheel too (Makefile); from outside the checkout both resolve."""
    out = run_elsewhere(Path(sys.executable), "import importlib.util as u, importlib.metadata as m\n"
                        "import specserve.speculators.registry as r\n"
                        "print(u.find_spec('speculators').origin); print(m.version('speculators')); print(r.__file__)",
                        tmp_path).split()
    assert "site-packages" in out[0] and out[1] == "0.9.0"
    assert Path(out[2]).resolve() == REPO / "speculators" / "registry.py"


def test_wheel_beside_vllms_speculators_serves_a_request(side_by_side, tiny_model_dir, tmp_path):
    out = run_elsewhere(side_by_side, "import importlib.util as u, specserve.server.cli as c\n"
                        "print(u.find_spec('speculators').origin); print(c.__file__)\n"
                        "from specserve.server.models.embedded import locate; print(locate())", tmp_path).split()
    site = side_by_side.parents[1] / "lib"
    assert Path(out[0]).is_relative_to(site) and out[0].endswith("speculators/__init__.py")
    assert Path(out[1]).is_relative_to(site)
    assert out[2] == "None"           # a wheel never guesses where the embedded family is
    assert "SpeculatorModelConfig" in Path(out[0]).read_text()        # vLLM's library, not ours
    server = ServerProcess(tiny_model_dir, tmp_path / "server.log", python=side_by_side, cwd=tmp_path)
    try:
        url = server.wait_ready()
        r = httpx.post(f"{url}/v1/completions", timeout=60, json={
            "model": "tiny-llama", "prompt": "def f(x):", "max_tokens": 8, "temperature": 0,
            "speculation": {"method": "ngram", "num_speculative_tokens": 3}})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 8
    finally:
        server.stop()


def test_the_embedded_family_is_found_by_flag_env_or_checkout(tmp_path, monkeypatch):
    from specserve.server.models import embedded
    monkeypatch.delenv(embedded.ENV_VAR, raising=False)
    assert embedded.locate().root == REPO / "models"            # the editable install's checkout
    monkeypatch.setenv(embedded.ENV_VAR, str(tmp_path))
    with pytest.raises(ValueError, match="SPECSERVE_MODELS_DIR"):
        embedded.locate()                                         # named, but holds no family
    assert embedded.locate(str(REPO / "models")).root == REPO / "models"   # the flag wins

