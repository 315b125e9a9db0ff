"""What a ReplicaSet controller, the scheduler and the kubelet do for Deployments, enough for
traffic runbooks on the emulated fleet: keep `replicas` pods per Deployment, place each new pod on
a node with free GPUs whose taints it tolerates (in-cluster nodes before virtual ones), and mark it
Ready `ready_delay_s` after it landed. Pods without a home stay Pending.
"""

from __future__ import annotations

import copy
import itertools
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from devstack.controllers import every
from devstack.kube_emulator import KubeEmulatorThread
from fleetmedic.selectors import match_labels_selector

GPU = "nvidia.com/gpu"
VIRTUAL_LABEL = "type"
VIRTUAL_VALUE = "virtual-kubelet"


def _gpus(pod: dict[str, Any]) -> int:
    return sum(int((c.get("resources") or {}).get("requests", {}).get(GPU, 0)) for c in pod["spec"]["containers"])


def _tolerates(pod: dict[str, Any], taint: dict[str, Any]) -> bool:
    if taint.get("effect") == "PreferNoSchedule":
        return True
    for toleration in pod["spec"].get("tolerations") or []:
        if toleration.get("operator") == "Exists" and toleration.get("key") in (None, "", taint["key"]):
            return True
        if toleration.get("key") == taint["key"] and toleration.get("value", "") == taint.get("value", "") \
                and toleration.get("effect") in (None, "", taint.get("effect")):
            return True
    return False


def _ready_node(node: dict[str, Any]) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in node["status"].get("conditions") or [])


@dataclass
class ReplicaController:
    kube: KubeEmulatorThread
    ready_delay_s: float = 0.3
    interval_s: float = 0.05
    names: Iterator[int] = field(default_factory=lambda: itertools.count(1))
    landed: dict[str, float] = field(default_factory=dict)  # pod ref -> when it got a node

    def step(self) -> None:
        emulator = self.kube.emulator
        pods = emulator.list("v1", "Pod")
        for deployment in emulator.list("apps/v1", "Deployment"):
            meta, spec = deployment["metadata"], deployment["spec"]
            selector = spec["selector"]
            mine = [p for p in pods if p["metadata"]["namespace"] == meta["namespace"]
                    and match_labels_selector(selector, p["metadata"].get("labels") or {})]
            for _ in range(spec.get("replicas", 0) - len(mine)):
                template = copy.deepcopy(spec["template"])
                name = f"{meta['name']}-{next(self.names):05d}"
                pod = {"apiVersion": "v1", "kind": "Pod",
                       "metadata": {"name": name, "namespace": meta["namespace"],
                                    "labels": template["metadata"].get("labels", {}),
                                    "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet",
                                                         "name": f"{meta['name']}-rs", "uid": f"uid-{meta['name']}",
                                                         "controller": True}]},
                       "spec": template["spec"],
                       "status": {"phase": "Pending", "conditions": [{"type": "Ready", "status": "False"}]}}
                emulator.put(pod)
                pods.append(pod)
        self.schedule(pods)
        self.make_ready(pods)

    def schedule(self, pods: list[dict[str, Any]]) -> None:
        emulator = self.kube.emulator
        nodes = emulator.list("v1", "Node")
        used: dict[str, int] = {}
        for pod in pods:
            if pod["spec"].get("nodeName"):
                used[pod["spec"]["nodeName"]] = used.get(pod["spec"]["nodeName"], 0) + _gpus(pod)
        # In-cluster nodes first (by name), then virtual ones: the scheduler's preference for home.
        ordered = sorted(nodes, key=lambda n: (n["metadata"].get("labels", {}).get(VIRTUAL_LABEL) == VIRTUAL_VALUE,
                                               n["metadata"]["name"]))
        for pod in pods:
            if pod["spec"].get("nodeName"):
                continue
            need = _gpus(pod)
            for node in ordered:
                name = node["metadata"]["name"]
                free = int(node["status"]["allocatable"].get(GPU, 0)) - used.get(name, 0)
                if not _ready_node(node) or node["spec"].get("unschedulable") or free < need:
                    continue
                if not all(_tolerates(pod, t) for t in node["spec"].get("taints") or []
                           if t["effect"] in ("NoSchedule", "NoExecute")):
                    continue
                current = emulator.get("v1", "Pod", pod["metadata"]["name"], pod["metadata"]["namespace"])
                if current is None:
                    break
                current["spec"]["nodeName"] = name
                current["status"]["phase"] = "Running"
                emulator.put(current)
                pod["spec"]["nodeName"] = name
                used[name] = used.get(name, 0) + need
                self.landed[f"{pod['metadata']['namespace']}/{pod['metadata']['name']}"] = time.monotonic()
                break

    def make_ready(self, pods: list[dict[str, Any]]) -> None:
        now = time.monotonic()
        for pod in pods:
            ref = f"{pod['metadata']['namespace']}/{pod['metadata']['name']}"
            landed = self.landed.get(ref)
            if landed is None or now - landed < self.ready_delay_s:
                continue
            current = self.kube.emulator.get("v1", "Pod", pod["metadata"]["name"], pod["metadata"]["namespace"])
            if current is not None and current["status"]["conditions"][0]["status"] != "True":
                current["status"]["conditions"] = [{"type": "Ready", "status": "True"}]
                self.kube.emulator.put(current)
            self.landed.pop(ref, None)


@contextmanager
def replica_controller(kube: Any, ready_delay_s: float = 0.3) -> Iterator[ReplicaController | None]:
    """The Deployment and ReplicaSet controllers, the scheduler and the kubelet, for the emulator.
    Against the real control plane they run for real: nothing to do here."""
    if hasattr(kube, "set_ready"):
        yield None
        return
    controller = ReplicaController(kube, ready_delay_s)
    with every(controller.interval_s, controller.step, "replica-controller"):
        yield controller


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
