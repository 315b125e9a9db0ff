"""Schema-valid Kubernetes objects for an emulated GPU fleet (tests and `fleetmedic dev`)."""

from __future__ import annotations

from typing import Any

GPU_LABEL = "nvidia.com/gpu.present"


def node(name: str, *, gpus: int = 8, ready: bool = True, unschedulable: bool = False,
         labels: dict[str, str] | None = None, annotations: dict[str, str] | None = None,
         taints: list[dict[str, str]] | None = None, zone: str = "zone-a") -> dict[str, Any]:
    spec: dict[str, Any] = {"providerID": f"emulated://{name}"}
    if unschedulable:
        spec["unschedulable"] = True
    if taints:
        spec["taints"] = taints
    return {
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "labels": {GPU_LABEL: "true", "kubernetes.io/hostname": name,
                                              "topology.kubernetes.io/zone": zone, **(labels or {})},
                     "annotations": dict(annotations or {})},
        "spec": spec,
        "status": {
            "capacity": {"cpu": "96", "memory": "1Ti", "nvidia.com/gpu": str(gpus), "pods": "110"},
            "allocatable": {"cpu": "94", "memory": "1000Gi", "nvidia.com/gpu": str(gpus), "pods": "110"},
            "conditions": [{"type": "Ready", "status": "True" if ready else "False",
                            "reason": "KubeletReady" if ready else "KubeletNotReady",
                            "lastHeartbeatTime": "2026-01-01T00:00:00Z",
                            "lastTransitionTime": "2026-01-01T00:00:00Z"}],
        },
    }


def pod(name: str, node_name: str, *, namespace: str = "default", labels: dict[str, str] | None = None,
        owner_kind: str = "ReplicaSet", owner_name: str | None = None, gpus: int = 0,
        ready: bool = True, mirror: bool = False) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": namespace, "labels": dict(labels or {})}
    if owner_kind:
        meta["ownerReferences"] = [{"apiVersion": "apps/v1", "kind": owner_kind,
                                    "name": owner_name or f"{name}-owner", "uid": f"uid-{owner_name or name}",
                                    "controller": True}]
    if mirror:
        meta["annotations"] = {"kubernetes.io/config.mirror": "mirror"}
        meta.pop("ownerReferences", None)
    resources: dict[str, Any] = {}
    if gpus:
        resources = {"limits": {"nvidia.com/gpu": str(gpus)}, "requests": {"nvidia.com/gpu": str(gpus)}}
    return {
        "apiVersion": "v1", "kind": "Pod", "metadata": meta,
        "spec": {"nodeName": node_name, "containers": [{"name": "main", "image": "busybox:1.36",
                                                         "resources": resources}]},
        "status": {"phase": "Running",
                   "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
    }


def pdb(name: str, *, match_labels: dict[str, str], namespace: str = "default",
        min_available: int | str | None = None, max_unavailable: int | str | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"selector": {"matchLabels": match_labels}}
    if min_available is not None:
        spec["minAvailable"] = min_available
    if max_unavailable is not None:
        spec["maxUnavailable"] = max_unavailable
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
            "metadata": {"name": name, "namespace": namespace}, "spec": spec}


def machine(name: str, *, namespace: str = "default", cluster: str = "gpu-cluster",
            node: str | None = None, machine_set: dict[str, Any] | None = None,
            finalizer: bool = False) -> dict[str, Any]:
    """A Cluster API Machine as its v1beta2 CRD validates it (bootstrap and infrastructure references);
    owned by `machine_set` (as stored, with its uid) when given; with the finalizer Cluster API puts
    when a controller is there to remove it."""
    labels = {"cluster.x-k8s.io/cluster-name": cluster}
    meta: dict[str, Any] = {"name": name, "namespace": namespace, "labels": labels}
    if machine_set is not None:
        labels["cluster.x-k8s.io/set-name"] = machine_set["metadata"]["name"]
        meta["ownerReferences"] = [{"apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "MachineSet",
                                    "name": machine_set["metadata"]["name"], "uid": machine_set["metadata"]["uid"],
                                    "controller": True}]
    if finalizer:
        meta["finalizers"] = ["machine.cluster.x-k8s.io"]
    obj: dict[str, Any] = {
        "apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "Machine", "metadata": meta,
        "spec": {"clusterName": cluster, "bootstrap": {"dataSecretName": f"{name}-bootstrap"},
                 "infrastructureRef": {"apiGroup": "infrastructure.cluster.x-k8s.io", "kind": "GPUMachine",
                                       "name": name}}}
    if node:
        obj["status"] = {"nodeRef": {"name": node}}
    return obj


def machine_set(name: str, *, namespace: str = "default", cluster: str = "gpu-cluster",
                replicas: int = 1) -> dict[str, Any]:
    template = machine(f"{name}-template", namespace=namespace, cluster=cluster)
    return {"apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "MachineSet",
            "metadata": {"name": name, "namespace": namespace, "labels": {"cluster.x-k8s.io/cluster-name": cluster}},
            "spec": {"clusterName": cluster, "replicas": replicas,
                     "selector": {"matchLabels": {"cluster.x-k8s.io/set-name": name}},
                     "template": {"metadata": {"labels": {"cluster.x-k8s.io/set-name": name}},
                                  "spec": template["spec"]}}}


def machine_health_check(name: str, *, namespace: str = "default", cluster: str = "gpu-cluster",
                         max_unhealthy: str = "40%", expected: int = 10, healthy: int = 10) -> dict[str, Any]:
    """As Cluster API 1.11 stores it (v1beta2: `maxUnhealthy` is `remediation.triggerIf`)."""
    return {"apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "MachineHealthCheck",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"clusterName": cluster,
                     "selector": {"matchLabels": {"cluster.x-k8s.io/cluster-name": cluster}},
                     "checks": {"unhealthyNodeConditions": [{"type": "Ready", "status": "False",
                                                             "timeoutSeconds": 300}]},
                     "remediation": {"triggerIf": {"unhealthyLessThanOrEqualTo": max_unhealthy}}},
            "status": {"expectedMachines": expected, "currentHealthy": healthy}}


def capi_cluster(name: str = "gpu-cluster", *, namespace: str = "default", paused: bool = False) -> dict[str, Any]:
    return {"apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "Cluster",
            "metadata": {"name": name, "namespace": namespace}, "spec": {"paused": paused}}


def nodeclaim(name: str, *, node: str | None = None, nodepool: str = "gpu",
              finalizer: bool = False) -> dict[str, Any]:
    """A Karpenter NodeClaim as its CRD validates it (a node class and requirements)."""
    obj: dict[str, Any] = {
        "apiVersion": "karpenter.sh/v1", "kind": "NodeClaim",
        "metadata": {"name": name, "labels": {"karpenter.sh/nodepool": nodepool},
                     **({"finalizers": ["karpenter.sh/termination"]} if finalizer else {})},
        "spec": {"nodeClassRef": {"group": "karpenter.k8s.aws", "kind": "EC2NodeClass", "name": "gpu"},
                 "requirements": [{"key": "node.kubernetes.io/instance-type", "operator": "In",
                                   "values": ["p5.48xlarge"]}]}}
    if node:
        obj["status"] = {"nodeName": node}
    return obj


KUEUE = "kueue.x-k8s.io/v1beta2"  # Kueue 0.17's storage version (v1beta1 is deprecated)


def resource_flavor(name: str, node_labels: dict[str, str]) -> dict[str, Any]:
    return {"apiVersion": KUEUE, "kind": "ResourceFlavor", "metadata": {"name": name},
            "spec": {"nodeLabels": dict(node_labels)}}


def cluster_queue(name: str, gpu_quota: dict[str, int], *, cohort: str = "") -> dict[str, Any]:
    """A ClusterQueue with one resource group: cpu and GPUs per flavor (cpu is never touched)."""
    spec: dict[str, Any] = {"namespaceSelector": {}, "resourceGroups": [{
        "coveredResources": ["cpu", "nvidia.com/gpu"],
        "flavors": [{"name": flavor, "resources": [{"name": "cpu", "nominalQuota": "512"},
                                                   {"name": "nvidia.com/gpu", "nominalQuota": gpus}]}
                    for flavor, gpus in gpu_quota.items()]}]}
    if cohort:
        spec["cohortName"] = cohort  # v1beta1's `cohort`
    return {"apiVersion": KUEUE, "kind": "ClusterQueue", "metadata": {"name": name}, "spec": spec}


def workload(name: str, queue: str, flavor: str, gpus: int, *, namespace: str = "training",
             admitted: bool = True, priority: int = 1000) -> dict[str, Any]:
    """A Kueue Workload; admitted ones carry their ClusterQueue, flavor and GPU usage."""
    status: dict[str, Any] = {"conditions": [{"type": "Admitted", "status": "True" if admitted else "False",
                                              "reason": "Admitted" if admitted else "Pending",
                                              "message": "admitted by the test" if admitted else "pending",
                                              "lastTransitionTime": "2026-11-30T00:00:00Z"}]}
    if admitted:
        status["admission"] = {"clusterQueue": queue, "podSetAssignments": [{
            "name": "main", "count": max(1, gpus // 8), "flavors": {"nvidia.com/gpu": flavor, "cpu": flavor},
            "resourceUsage": {"nvidia.com/gpu": str(gpus), "cpu": "64"}}]}
    return {"apiVersion": KUEUE, "kind": "Workload", "metadata": {"name": name, "namespace": namespace},
            "spec": {"queueName": f"{queue}-local", "priority": priority,
                     "podSets": [{"name": "main", "count": max(1, gpus // 8),
                                  "template": {"spec": {"containers": [{"name": "main", "image": "trainer:1"}]}}}]},
            "status": status}


def demo_fleet(nodes: int = 8) -> list[dict[str, Any]]:
    """About what `fleetmedic dev` shows: GPU nodes, a training job's pods, inference, DaemonSets."""
    objects: list[dict[str, Any]] = [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}}
        for ns in ("default", "training", "inference", "gpu-operator")
    ]
    for i in range(nodes):
        name = f"gpu-node-{i}"
        objects.append(node(name, zone=f"zone-{'ab'[i % 2]}"))
        objects.append(pod(f"dcgm-exporter-{i}", name, namespace="gpu-operator", owner_kind="DaemonSet",
                           owner_name="dcgm-exporter", labels={"app": "dcgm-exporter"}))
        if i < nodes - 2:
            objects.append(pod(f"trainer-{i}", name, namespace="training", owner_kind="Job",
                               owner_name="llm-pretrain", gpus=8,
                               labels={"app": "llm-pretrain", "fleetmedic.io/workload": "training"}))
        else:
            for r in range(2):
                objects.append(pod(f"diffusion-{i}-{r}", name, namespace="inference", gpus=4,
                                   owner_name="diffusion-7d9f",
                                   labels={"app": "diffusion", "fleetmedic.io/workload": "inference"}))
    objects.append(pdb("diffusion", namespace="inference", match_labels={"app": "diffusion"},
                       min_available=2))
    # For traffic-flip / migrate-back: the Deployment behind those pods and a closed virtual-kubelet node.
    from devstack.replicas import deployment, virtual_node

    objects.append(deployment("diffusion", 4, gpus=4))
    objects.append(virtual_node("virtual-gpu", gpus=64, overflow_closed=True))
    # For kueue-quota-sync: one flavor over every GPU node and the training queue on it.
    objects.append(resource_flavor("gpu", {GPU_LABEL: "true"}))
    objects.append(cluster_queue("training", {"gpu": 8 * nodes}))
    return objects
