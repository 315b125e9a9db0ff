"""The Helm chart (deploy/helm/fleetmedic), with Helm itself built from its Go module
(helm.sh/helm/v3, by scripts/install-kube): `helm lint`, `helm template` with the defaults and
with a site's choices, the rendered objects validated (kubernetes-validate) and sent to the real
control plane (server-side dry-run apply: admission and the API's own validation), and the same
objects, permissions and policy as the kustomize base — one truth whichever way a team deploys."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import yaml

from devstack.kube_cluster import LocalKubeCluster, cache_dir
from fleetmedic.policy import default_policy_text, parse_policy
from tests.conftest import require
from tests.test_deploy import CUSTOM, K8S_VERSION
from tests.test_rbac import ROOT, find, render

CHART = ROOT / "deploy/helm/fleetmedic"
COMPONENT = ROOT / "deploy/kubernetes/components/prometheus-operator"


def helm(*args: str) -> str:
    binary = cache_dir() / "helm"
    require(binary.exists(), "helm, built from helm.sh/helm/v3 by scripts/install-kube")
    done = subprocess.run([str(binary), *args], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def template(*values: str, namespace: str = "fleetmedic") -> list[dict[str, Any]]:
    sets = [a for v in values for a in ("--set", v)]
    out = helm("template", "fleetmedic", str(CHART), "--namespace", namespace, *sets)
    return [doc for doc in yaml.safe_load_all(out) if doc]


def policy_of(objects: list[dict[str, Any]]) -> dict[str, Any]:
    text = find(objects, "ConfigMap", "fleetmedic-policy")["data"]["policy.yaml"]
    return parse_policy(text, "the chart's policy").model_dump(mode="json")


def unhashed(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """kustomize's objects with its generated ConfigMaps' hash suffixes taken off (Helm rolls the
    pods on a policy change with a checksum annotation instead)."""
    text = re.sub(r"(fleetmedic-(?:config|policy))-[a-z0-9]{10}\b", r"\1", yaml.safe_dump_all(objects))
    return [doc for doc in yaml.safe_load_all(text) if doc]


def test_helm_lint() -> None:
    out = helm("lint", "--strict", str(CHART))
    assert "0 chart(s) failed" in out


def test_the_chart_renders_what_the_kustomize_base_does() -> None:
    chart, base = template(), unhashed(render("deploy/kubernetes/base"))
    assert {(o["kind"], o["metadata"]["name"]) for o in chart} == \
        {(o["kind"], o["metadata"]["name"]) for o in base if o["kind"] != "Namespace"}  # helm --create-namespace
    for role in ("fleetmedic-worker", "fleetmedic-agent"):
        assert find(chart, "ClusterRole", role)["rules"] == find(base, "ClusterRole", role)["rules"]
    for kind, name in (("Deployment", "fleetmedic-worker"), ("Deployment", "fleetmedic-webhook"),
                       ("DaemonSet", "fleetmedic-agent")):
        ours, theirs = (find(objs, kind, name)["spec"]["template"]["spec"] for objs in (chart, base))
        for key in ("securityContext", "serviceAccountName", "volumes", "terminationGracePeriodSeconds"):
            assert ours.get(key) == theirs.get(key), (name, key)
        for a, b in zip(ours["containers"], theirs["containers"], strict=True):
            assert a["image"] == b["image"] == "ghcr.io/fleetmedic/fleetmedic:0.1.0"
            for key in ("args", "env", "envFrom", "ports", "resources", "securityContext", "volumeMounts",
                        "readinessProbe", "livenessProbe"):
                assert a.get(key) == b.get(key), (name, key)
    assert find(chart, "ConfigMap", "fleetmedic-config")["data"] == find(base, "ConfigMap", "fleetmedic-config")["data"]
    assert policy_of(chart) == parse_policy(default_policy_text()).model_dump(mode="json")
    dashboard = find(chart, "ConfigMap", "fleetmedic-dashboard")
    assert dashboard["data"] == find(base, "ConfigMap", "fleetmedic-dashboard")["data"]


def test_the_copies_in_the_chart_are_the_shipped_files() -> None:
    """Helm reads only files inside the chart: the policy, dashboard and operator objects are copies."""
    pairs = [(CHART / "files/default-policy.yaml", ROOT / "fleetmedic/default_policy.yaml"),
             (CHART / "files/dashboard.json", ROOT / "deploy/kubernetes/base/dashboards/fleetmedic.json")]
    pairs += [(CHART / "files/prometheus-operator" / p.name, p) for p in COMPONENT.glob("*.yaml")
              if p.name != "kustomization.yaml"]
    for copy, original in pairs:
        assert copy.read_text() == original.read_text(), f"{copy} differs from {original}: copy it again"


def test_values_choose_cluster_providers_policy_agent_and_the_prometheus_operator() -> None:
    objects = template("cluster=gpu-east-1", "agent.enabled=false", "prometheusOperator.enabled=true",
                       "policy.provider.kind=cluster-api", "policy.burn_in.enabled=true", "providers.karpenter=false",
                       "policy.slurm.mapping=slinky", "policy.slurm.slinky.namespace=slinky",
                       "worker.replicas=3", namespace="gpu-ops")
    kinds = [o["kind"] for o in objects]
    assert "DaemonSet" not in kinds and kinds.count("ServiceMonitor") == 3 and "PrometheusRule" in kinds
    config = find(objects, "ConfigMap", "fleetmedic-config")["data"]
    assert config["FLEETMEDIC_CLUSTER"] == "gpu-east-1" and "FLEETMEDIC_AGENT_URL" not in config
    policy = policy_of(objects)
    assert policy["provider"]["kind"] == "cluster-api" and policy["burn_in"]["enabled"] is True
    assert parse_policy(yaml.safe_dump(policy)).slurm.model_dump() == {
        "mapping": "slinky", "slinky": {"namespace": "slinky", "selector": "app.kubernetes.io/name=slurmd",
                                        "nodesets": []}}
    assert policy["xid"] == parse_policy(default_policy_text()).model_dump(mode="json")["xid"]  # the rest kept
    groups = {g for rule in find(objects, "ClusterRole", "fleetmedic-worker")["rules"] for g in rule["apiGroups"]}
    assert "cluster.x-k8s.io" in groups and "karpenter.sh" not in groups
    assert find(objects, "Deployment", "fleetmedic-worker")["spec"]["replicas"] == 3
    binding = find(objects, "ClusterRoleBinding", "fleetmedic-worker")
    assert binding["subjects"][0]["namespace"] == "gpu-ops"
    route = find(objects, "AlertmanagerConfig", "fleetmedic")
    assert "fleetmedic-webhook.gpu-ops.svc" in yaml.safe_dump(route)


def test_mtls_to_temporal_mounts_the_secret_and_sets_the_sdks_variables() -> None:
    """`temporal.tlsSecret`: the worker and the webhook get the client certificate, its key and the
    server's CA from the Secret, named by the variables the SDK's environment configuration reads;
    without it neither has a TLS variable or volume (the defaults render the kustomize base)."""
    objects = template("temporal.tlsSecret=temporal-client", "temporal.tlsServerName=frontend.temporal")
    for name in ("fleetmedic-worker", "fleetmedic-webhook"):
        pod = find(objects, "Deployment", name)["spec"]["template"]["spec"]
        [container] = pod["containers"]
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["TEMPORAL_TLS"] == "true" and env["TEMPORAL_TLS_SERVER_NAME"] == "frontend.temporal"
        mount = next(m for m in container["volumeMounts"] if m["name"] == "temporal-tls")
        for key in ("CLIENT_CERT", "CLIENT_KEY", "SERVER_CA_CERT"):
            assert env[f"TEMPORAL_TLS_{key}_PATH"].startswith(mount["mountPath"] + "/")
        assert {"name": "temporal-tls", "secret": {"secretName": "temporal-client"}} in pod["volumes"]
    plain = find(template(), "Deployment", "fleetmedic-worker")["spec"]["template"]["spec"]
    assert not [e for e in plain["containers"][0]["env"] if e["name"].startswith("TEMPORAL_TLS")]
    assert "temporal-tls" not in {v["name"] for v in plain["volumes"]}


def test_rendered_objects_are_valid_and_the_api_server_accepts_them(kube_cluster: LocalKubeCluster,
                                                                     tmp_path: Path) -> None:
    objects = template("prometheusOperator.enabled=true", namespace="fleetmedic-helm")
    builtin = []
    for obj in objects:
        if (obj["apiVersion"], obj["kind"]) in CUSTOM:
            continue  # the Prometheus operator's CRDs are not installed here
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        builtin.append(obj)
    kubectl = ["kubectl", "--kubeconfig", str(kube_cluster.kubeconfig("admin"))]
    subprocess.run([*kubectl, "create", "namespace", "fleetmedic-helm"], capture_output=True, timeout=30)
    manifest = tmp_path / "chart.yaml"
    manifest.write_text(yaml.safe_dump_all(builtin))
    done = subprocess.run([*kubectl, "apply", "--server-side", "--dry-run=server", "-n", "fleetmedic-helm",
                           "-f", str(manifest)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("serverside-applied (server dry run)") == len(builtin), done.stdout
