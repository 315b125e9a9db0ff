"""Least privilege, checked against reality.

Every request the worker's adapters sent to the Kubernetes apiserver during the test session was
recorded (tests/rbac.py; in every process of the suite when scripts/test runs it on every core).
The worker's ClusterRole, as `kubectl kustomize` renders it, must allow each of them, and — when
the whole suite ran — nothing beyond them. The webhook has no Kubernetes access at all; the agent
may only read nodes.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests import rbac
from tests.conftest import require

ROOT = Path(__file__).resolve().parent.parent
# The test modules whose runs drive every adapter; with all of them in the session the recording
# is complete and the role must not allow more than was used.
ADAPTER_TESTS = {"test_xid_recovery", "test_hot_gpu_pull", "test_nvlink_fault_replace", "test_node_runbooks",
                 "test_kubernetes_activities", "test_providers", "test_fleet_guard", "test_kueue_quota_sync",
                 "test_traffic", "test_replacements"}


def render(path: str) -> list[dict[str, Any]]:
    require(shutil.which("kubectl") is not None, "kubectl (with kustomize)")
    out = subprocess.run(["kubectl", "kustomize", str(ROOT / path)], capture_output=True, text=True, timeout=60,
                         check=True).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def allowed_by(role: dict[str, Any]) -> set[tuple[str, str, str]]:
    allowed = set()
    for rule in role["rules"]:
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                for verb in rule["verbs"]:
                    allowed.add((verb, group, resource))
    return allowed


def recording(request: pytest.FixtureRequest) -> rbac.Recording:
    """What this session and the processes before it (scripts/test) sent and collected."""
    return rbac.everything(rbac.modules(request.session.items), request.session.testsfailed)


def find(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    return next(o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name)


def test_the_workers_clusterrole_allows_exactly_what_its_adapters_send(request: pytest.FixtureRequest) -> None:
    objects = render("deploy/kubernetes/base")
    role = find(objects, "ClusterRole", "fleetmedic-worker")
    allowed = allowed_by(role)
    for rule in role["rules"]:
        assert "*" not in rule["verbs"] + rule["resources"] + rule["apiGroups"], rule
    seen = recording(request)
    missing = sorted(seen.observed - allowed)
    assert not missing, f"the worker sends requests its ClusterRole forbids: {missing}"
    if ADAPTER_TESTS <= seen.modules and seen.failed == 0:
        unused = sorted(allowed - seen.observed)
        assert not unused, f"the ClusterRole allows what no adapter uses: {unused}"


def test_the_webhook_has_no_kubernetes_access_and_the_agent_only_reads_nodes() -> None:
    objects = render("deploy/kubernetes/base")
    webhook_sa = find(objects, "ServiceAccount", "fleetmedic-webhook")
    assert webhook_sa.get("automountServiceAccountToken") is False
    webhook_pod = find(objects, "Deployment", "fleetmedic-webhook")["spec"]["template"]["spec"]
    assert webhook_pod["automountServiceAccountToken"] is False
    bindings = [o for o in objects if o["kind"] in ("RoleBinding", "ClusterRoleBinding")]
    bound = {(s["name"], o["roleRef"]["name"]) for o in bindings for s in o["subjects"]}
    assert bound == {("fleetmedic-worker", "fleetmedic-worker"), ("fleetmedic-agent", "fleetmedic-agent")}
    assert allowed_by(find(objects, "ClusterRole", "fleetmedic-agent")) == {("get", "", "nodes")}


NOT_YET_MOVED: set[str] = set()  # groups whose move off a deprecated version is still to come


def crd_versions() -> dict[tuple[str, str], dict[str, bool]]:
    """(group, plural) → {served version: deprecated?}, from the CRDs the test control plane installs."""
    from devstack.kube_cluster import cache_dir

    found: dict[tuple[str, str], dict[str, bool]] = {}
    for path in sorted((cache_dir() / "crds").glob("*.yaml")):
        for crd in yaml.safe_load_all(path.read_text()):
            if not crd or crd.get("kind") != "CustomResourceDefinition":
                continue
            spec = crd["spec"]
            found[(spec["group"], spec["names"]["plural"])] = {
                v["name"]: bool(v.get("deprecated")) for v in spec["versions"] if v.get("served")}
    return found


def test_the_worker_calls_no_deprecated_api_version(request: pytest.FixtureRequest) -> None:
    """Every custom resource version the worker called (the apiserver's audit log, all suite long) is
    one its installed CRD serves without deprecating it: Cluster API and Kueue through v1beta2, Karpenter v1."""
    served = crd_versions()
    require(bool(served), "the CRDs scripts/install-kube installs")
    seen = recording(request)
    if not {"test_providers", "test_replacements"} <= seen.modules:
        pytest.skip("the provider tests did not run in this session: no Cluster API or Karpenter call to judge")
    called = sorted(c for c in seen.versions if (c[0], c[2]) in served)
    groups = {group for group, _, _ in called}
    assert {"cluster.x-k8s.io", "karpenter.sh"} <= groups, called  # the recording covers the providers
    if "test_kueue_quota_sync" in seen.modules:  # ... and Kueue, which FleetMedic speaks in v1beta2
        assert "kueue.x-k8s.io" in groups, called
    deprecated = [c for c in called if c[0] not in NOT_YET_MOVED and served[(c[0], c[2])].get(c[1], True)]
    assert not deprecated, f"the worker calls API versions its CRDs deprecate (or do not serve): {deprecated}"
