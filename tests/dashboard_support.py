"""Reading the Grafana dashboard for the tests: its panels, query targets, template variables, Grafana's
variable interpolation, and the metric names server/metrics.py exports."""
from __future__ import annotations

import json
import re
from collections.abc import Iterator

from conftest import REPO

DASHBOARD = REPO / "docker" / "grafana" / "dashboards" / "specserve.json"
DATASOURCES = REPO / "docker" / "grafana" / "provisioning" / "datasources" / "prometheus.yaml"
WINDOW = "10m"            # every range selector covers the whole test: Prometheus starts with it
GRAFANA_BUILTINS = ("__rate_interval", "__interval", "__range", "__range_s", "__range_ms", "__interval_ms")


def load_dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def iter_panels(panels: list[dict]) -> Iterator[dict]:
    for panel in panels:
        yield panel
        yield from iter_panels(panel.get("panels", []))      # collapsed rows nest their panels


def dashboard_targets(dash: dict) -> list[tuple[str, dict]]:
    """(panel title, target) for every query target of every panel."""
    return [(p["title"], t) for p in iter_panels(dash["panels"]) for t in p.get("targets", [])]


def template_variables(dash: dict) -> dict[str, dict]:
    return {v["name"]: v for v in dash["templating"]["list"]}


VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\[\[(\w+)\]\]|\$(\w+)")


def substitute(expr: str, values: dict[str, str], window: str = WINDOW) -> str:
    """Grafana's variable interpolation for the forms the dashboard may use ($x, ${x}, [[x]])."""
    def one(match: re.Match) -> str:
        name = next(g for g in match.groups() if g)
        if name in values:
            return values[name]
        if name in ("__range_s",):
            return str(int(window[:-1]) * 60)
        if name.startswith("__"):
            return window
        raise AssertionError(f"undefined variable ${name} in {expr}")
    return VARIABLE.sub(one, expr)


def exported_metric_names() -> set[str]:
    """Every sample name server/metrics.py can emit (families expanded to _total/_bucket/...)."""
    from specserve.server.metrics import Metrics
    m = Metrics()
    m.set_model_name("m", {"none": 0, "ngram": 2})
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "gauge": ("",)}
    return {fam.name + s for fam in m.registry.collect() for s in suffixes[fam.type]}
