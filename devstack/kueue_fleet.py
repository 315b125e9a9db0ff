"""A cluster where Kueue shares the GPUs between training and inference, as in Krea's talk: objects
for tests and bench/flip_cycle.py, to put on a control plane where Kueue's controller runs
(devstack/kueue_controller.py).

- in-cluster GPU nodes (flavor `h100`) and one virtual-kubelet node in front of external GPUs
  (flavor `external`), with virtual-kubelet's own provider taint and FleetMedic's overflow taint;
- one ClusterQueue `gpus` over both flavors, h100 first, preempting lower priorities within it;
  a LocalQueue `gpus` in the training and the inference namespace;
- WorkloadPriorityClasses `training` (at the traffic policy's training priority) and `inference`;
- inference: a Deployment Kueue manages (pod integration, one Workload per pod), tolerating the
  virtual-kubelet taint; training: a suspended Job that Kueue admits, on the h100 flavor only.

Kueue admits training by preempting inference Workloads; the replacement pods Kueue admits on the
next flavor, `external`, whose nodeLabels put them on the virtual node, where the overflow taint
holds them Pending until traffic-flip removes it.
"""

from __future__ import annotations

from typing import Any

from devstack import fleet
from devstack.kube_world import RealKube
from devstack.kueue_controller import MANAGED_LABEL

KUEUE = fleet.KUEUE
TRAINING_NS, INFERENCE_NS = "training", "inference"
POOL = "fleetmedic.test/pool"
VIRTUAL_NODE = "vk-external"
PROVIDER_TAINT = {"key": "virtual-kubelet.io/provider", "value": "external", "effect": "NoSchedule"}
OVERFLOW_TAINT = {"key": "fleetmedic.io/overflow", "value": "closed", "effect": "NoSchedule"}
INFERENCE_APP = "diffusion"
QUEUE = "gpus"
COMPLETE_ANNOTATION = "fleetmedic.test/complete"  # devstack/kwok-stages.yaml: the pod's containers exit 0


def gpu_nodes(names: list[str], gpus: int = 8) -> list[dict[str, Any]]:
    return [fleet.node(name, gpus=gpus, labels={POOL: "h100"}) for name in names]


def virtual_node(gpus: int) -> dict[str, Any]:
    """GPUs of a provider behind virtual-kubelet: the external flavor's capacity (kueue-quota-sync
    counts them there), never the cluster's own (traffic runbooks tell them apart by its label)."""
    return fleet.node(VIRTUAL_NODE, gpus=gpus, labels={POOL: "external", "type": "virtual-kubelet"},
                      taints=[PROVIDER_TAINT, OVERFLOW_TAINT])


def kueue_objects(home_gpus: int, external_gpus: int, training_priority: int) -> list[dict[str, Any]]:
    namespaces = [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns, "labels": {MANAGED_LABEL: "true"}}}
                  for ns in (TRAINING_NS, INFERENCE_NS)]
    flavors = [{"apiVersion": KUEUE, "kind": "ResourceFlavor", "metadata": {"name": name},
                "spec": {"nodeLabels": {POOL: name}}} for name in ("h100", "external")]
    queue = {"apiVersion": KUEUE, "kind": "ClusterQueue", "metadata": {"name": QUEUE}, "spec": {
        "namespaceSelector": {},
        "preemption": {"withinClusterQueue": "LowerPriority"},
        "resourceGroups": [{"coveredResources": ["nvidia.com/gpu"], "flavors": [
            {"name": "h100", "resources": [{"name": "nvidia.com/gpu", "nominalQuota": home_gpus}]},
            {"name": "external", "resources": [{"name": "nvidia.com/gpu", "nominalQuota": external_gpus}]}]}]}}
    local = [{"apiVersion": KUEUE, "kind": "LocalQueue", "metadata": {"name": QUEUE, "namespace": ns},
              "spec": {"clusterQueue": QUEUE}} for ns in (TRAINING_NS, INFERENCE_NS)]
    priorities = [{"apiVersion": KUEUE, "kind": "WorkloadPriorityClass", "metadata": {"name": name}, "value": value}
                  for name, value in (("training", training_priority), ("inference", 10))]
    return [*namespaces, *flavors, queue, *local, *priorities]


def inference(replicas: int, gpus_per_pod: int = 1, name: str = INFERENCE_APP) -> dict[str, Any]:
    labels = {"app": name, "fleetmedic.io/workload": "inference"}
    kueue = {"kueue.x-k8s.io/queue-name": QUEUE, "kueue.x-k8s.io/priority-class": "inference"}
    return {"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": name, "namespace": INFERENCE_NS, "labels": {**labels, **kueue}},
            "spec": {"replicas": replicas, "selector": {"matchLabels": {"app": name}},
                     "template": {"metadata": {"labels": {**labels, **kueue}}, "spec": {
                         "terminationGracePeriodSeconds": 1,
                         "tolerations": [{"key": PROVIDER_TAINT["key"], "operator": "Exists", "effect": "NoSchedule"}],
                         "containers": [{"name": "serve", "image": "diffusion:1", "resources": {
                             "requests": {"nvidia.com/gpu": str(gpus_per_pod)},
                             "limits": {"nvidia.com/gpu": str(gpus_per_pod)}}}]}}}}


def training_job(name: str, pods: int, gpus_per_pod: int, backoff_limit: int = 0) -> dict[str, Any]:
    kueue = {"kueue.x-k8s.io/queue-name": QUEUE, "kueue.x-k8s.io/priority-class": "training"}
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": name, "namespace": TRAINING_NS,
                                                                  "labels": kueue},
            "spec": {"suspend": True, "parallelism": pods, "completions": pods, "backoffLimit": backoff_limit,
                     "template": {"metadata": {"labels": {"app": name}}, "spec": {
                         "restartPolicy": "Never", "terminationGracePeriodSeconds": 1,
                         # Training runs on the cluster's own GPUs only: Kueue skips the flavors whose
                         # nodeLabels this contradicts, so it preempts inference on h100 rather than
                         # admitting training on the external flavor.
                         "nodeSelector": {POOL: "h100"},
                         "containers": [{"name": "train", "image": "trainer:1", "resources": {
                             "requests": {"nvidia.com/gpu": str(gpus_per_pod)},
                             "limits": {"nvidia.com/gpu": str(gpus_per_pod)}}}]}}}}


# --- what tests and the benchmark read -------------------------------------------------------------

def inference_on(kube: RealKube, where: str) -> list[dict[str, Any]]:
    """Inference pods (not terminating) on the virtual node (`virtual`) or on the h100 nodes (`home`)."""
    pods = [p for p in kube.list("v1", "Pod", INFERENCE_NS) if not p["metadata"].get("deletionTimestamp")]
    if where == "virtual":
        return [p for p in pods if p["spec"].get("nodeName") == VIRTUAL_NODE]
    return [p for p in pods if p["spec"].get("nodeName") not in (None, "", VIRTUAL_NODE)]


def overflow(kube: RealKube) -> list[str]:
    """The effects of the overflow taint on the virtual node ([] when open)."""
    taints = ((kube.get("v1", "Node", VIRTUAL_NODE) or {}).get("spec") or {}).get("taints") or []
    return [t["effect"] for t in taints if t["key"] == OVERFLOW_TAINT["key"]]


def workload_of(kube: RealKube, job: str) -> dict[str, Any] | None:
    """The Workload Kueue made for the training Job `job`."""
    for workload in kube.list(KUEUE, "Workload", TRAINING_NS):
        if any(o.get("name") == job for o in workload["metadata"].get("ownerReferences") or []):
            return workload
    return None


def condition(workload: dict[str, Any] | None, kind: str) -> bool:
    return any(c["type"] == kind and c["status"] == "True"
               for c in ((workload or {}).get("status") or {}).get("conditions") or [])


def finish(kube: RealKube, job: str) -> None:
    """The training Job's pods exit 0 (kwok), so the Job completes and Kueue finishes its Workload."""
    pods = kube.dynamic.resources.get(api_version="v1", kind="Pod")
    for pod in kube.list("v1", "Pod", TRAINING_NS):
        if (pod["metadata"].get("labels") or {}).get("app") == job:
            pods.patch(name=pod["metadata"]["name"], namespace=TRAINING_NS,
                       body={"metadata": {"annotations": {COMPLETE_ANNOTATION: "true"}}},
                       content_type="application/merge-patch+json")
