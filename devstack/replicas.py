"""The objects of the traffic runbooks' world: inference Deployments and the virtual-kubelet node
in front of external GPU providers. The real controller-manager, scheduler and kwok run them."""

from __future__ import annotations

from typing import Any

GPU = "nvidia.com/gpu"
VIRTUAL_LABEL = "type"
VIRTUAL_VALUE = "virtual-kubelet"


def deployment(name: str, replicas: int, *, namespace: str = "inference", gpus: int = 1,
               labels: dict[str, str] | None = None) -> dict[str, Any]:
    """An inference Deployment: tolerates the virtual-kubelet node's own taint, not the overflow taint."""
    pod_labels = {"app": name, "fleetmedic.io/workload": "inference", **(labels or {})}
    return {"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": name, "namespace": namespace, "labels": {"fleetmedic.io/workload": "inference"}},
            "spec": {"replicas": replicas, "selector": {"matchLabels": {"app": name}},
                     "template": {"metadata": {"labels": pod_labels}, "spec": {
                         # An inference server drains its requests for a few seconds after SIGTERM.
                         "terminationGracePeriodSeconds": 5,
                         "containers": [{"name": "serve", "image": "serve:1",
                                         "resources": {"requests": {GPU: str(gpus)}, "limits": {GPU: str(gpus)}}}],
                         "tolerations": [{"key": "virtual-kubelet.io/provider", "operator": "Exists"}]}}}}


def virtual_node(name: str = "virtual-gpu", gpus: int = 1000, *, overflow_closed: bool = True) -> dict[str, Any]:
    """A virtual-kubelet node in front of external GPU providers."""
    taints = [{"key": "virtual-kubelet.io/provider", "value": "external", "effect": "NoSchedule"}]
    if overflow_closed:
        taints.append({"key": "fleetmedic.io/overflow", "value": "closed", "effect": "NoSchedule"})
    return {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "labels": {VIRTUAL_LABEL: VIRTUAL_VALUE, "kubernetes.io/hostname": name}},
            "spec": {"taints": taints},
            "status": {"allocatable": {GPU: str(gpus), "cpu": "1000", "pods": "5000"},
                       "capacity": {GPU: str(gpus), "cpu": "1000", "pods": "5000"},
                       "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                                       "lastHeartbeatTime": "2026-01-01T00:00:00Z",
                                       "lastTransitionTime": "2026-01-01T00:00:00Z"}]}}


def pod_ready(pod: dict[str, Any]) -> bool:
    """Ready and not on its way out: a replica that serves."""
    return not pod["metadata"].get("deletionTimestamp") and any(
        c["type"] == "Ready" and c["status"] == "True" for c in (pod.get("status") or {}).get("conditions") or [])
