"""The cluster as traffic-flip and migrate-back see it: virtual-kubelet nodes and their overflow
taint, in-cluster GPU capacity, inference Deployments and their pods, admitted training; evicting a
batch of inference pods and waiting until their replacements are Ready at home."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import httpx
from kubernetes import client
from kubernetes.utils import parse_quantity
from temporalio import activity

from activities.kubernetes import KubernetesActivities, api_errors, pod_info
from activities.kueue import GROUP, VERSION
from fleetmedic.models import EvictionReport, PodProblem, Taint
from fleetmedic.policy import TrafficPolicy
from fleetmedic.selectors import label_selector_matches
from fleetmedic.traffic import (
    EvictPods,
    HomeReport,
    InferenceDeployment,
    InferencePod,
    SloCheck,
    SloResult,
    TrafficSnapshot,
    TrainingWorkload,
    WaitHome,
    minimum_ready,
)

POLL_S = 0.25


class TrafficActivities:
    def __init__(self, kubernetes: KubernetesActivities, prometheus_url: str | None = None) -> None:
        self.k8s = kubernetes
        self.prometheus_url = prometheus_url

    @property
    def traffic(self) -> TrafficPolicy:
        return self.k8s.policy.traffic

    @activity.defn(name="traffic.snapshot")
    def snapshot(self) -> TrafficSnapshot:
        return self.read()

    def read(self) -> TrafficSnapshot:
        policy, gpu = self.traffic, self.k8s.policy.labels.gpu_resource
        overflow = Taint.parse(policy.overflow_taint)
        with api_errors("list nodes"):
            nodes = self.k8s.core.list_node(_request_timeout=self.k8s.timeout).items
        with api_errors("list pods"):
            pods = self.k8s.core.list_pod_for_all_namespaces(_request_timeout=self.k8s.timeout).items
        with api_errors("list inference Deployments"):
            deployments = client.AppsV1Api(self.k8s.core.api_client).list_deployment_for_all_namespaces(
                label_selector=policy.inference_selector, _request_timeout=self.k8s.timeout).items

        virtual = {n.metadata.name for n in nodes if label_selector_matches(policy.virtual_node_selector,
                                                                            n.metadata.labels or {})}
        gpu_selector = self.k8s.policy.labels.gpu_node_selector
        home = set()
        snapshot: dict[str, Any] = {"virtual_nodes": sorted(virtual), "virtual_open": [], "virtual_gpus": 0,
                                    "cluster_gpus": 0}
        for node in nodes:
            allocatable = int(parse_quantity((node.status.allocatable or {}).get(gpu, "0"))) if node.status else 0
            name = node.metadata.name
            if name in virtual:
                taints = node.spec.taints or [] if node.spec else []
                if not any(t.key == overflow.key and t.effect == overflow.effect for t in taints):
                    snapshot["virtual_open"].append(name)
                snapshot["virtual_gpus"] += allocatable
                continue
            ready = any(c.type == "Ready" and c.status == "True" for c in (node.status.conditions or [])) \
                if node.status else False
            if label_selector_matches(gpu_selector, node.metadata.labels or {}) and ready \
                    and not (node.spec and node.spec.unschedulable):
                home.add(name)
                snapshot["cluster_gpus"] += allocatable

        used = 0
        inference: list[InferencePod] = []
        labels_of: dict[str, dict[str, str]] = {}
        for pod in pods:
            info = pod_info(pod, gpu)
            if info.phase in ("Succeeded", "Failed") or pod.metadata.deletion_timestamp:
                continue
            if info.node in home:
                used += info.gpus
            if label_selector_matches(policy.inference_selector, info.labels):
                labels_of[info.ref] = info.labels
                inference.append(InferencePod(namespace=info.namespace, name=info.name, node=info.node,
                                              on_virtual=info.node in virtual, ready=info.ready, gpus=info.gpus))
        selected = []
        for deployment in deployments:
            match = deployment.spec.selector.match_labels or {}
            mine = [p for p in inference if p.namespace == deployment.metadata.namespace
                    and all(labels_of[p.ref].get(k) == v for k, v in match.items())]
            ref = f"{deployment.metadata.namespace}/{deployment.metadata.name}"
            inference = [p.model_copy(update={"deployment": ref}) if p in mine else p for p in inference]
            container_gpus = sum(int(parse_quantity(((c.resources.requests or {}) if c.resources else {})
                                                    .get(gpu, "0")))
                                 for c in deployment.spec.template.spec.containers)
            selected.append(InferenceDeployment(
                namespace=deployment.metadata.namespace, name=deployment.metadata.name,
                replicas=deployment.spec.replicas or 0, ready=sum(1 for p in mine if p.ready),
                ready_in_cluster=sum(1 for p in mine if p.ready and not p.on_virtual and p.node),
                gpus_per_pod=container_gpus))
        return TrafficSnapshot(**snapshot, used_gpus=used, deployments=selected, pods=inference,
                               training=self._training())

    def _training(self) -> list[TrainingWorkload]:
        """Admitted Kueue Workloads at or above the training priority (none when Kueue is absent)."""
        gpu = self.k8s.policy.labels.gpu_resource
        try:
            with api_errors("list Kueue workloads"):
                items = self.k8s.custom.list_cluster_custom_object(GROUP, VERSION, "workloads",
                                                                   _request_timeout=self.k8s.timeout)["items"]
        except Exception as exc:
            if getattr(exc, "type", None) == "NotFound":
                return []
            raise
        training = []
        for item in items:
            status, spec = item.get("status") or {}, item.get("spec") or {}
            admitted = any(c.get("type") == "Admitted" and c.get("status") == "True"
                           for c in status.get("conditions") or [])
            priority = int(spec.get("priority") or 0)
            if not admitted or priority < self.traffic.training_priority:
                continue
            gpus = sum(int(parse_quantity(str((a.get("resourceUsage") or {}).get(gpu, "0"))))
                       for a in (status.get("admission") or {}).get("podSetAssignments") or [])
            training.append(TrainingWorkload(namespace=item["metadata"].get("namespace", ""),
                                             name=item["metadata"]["name"], priority=priority, gpus=gpus))
        return training

    @activity.defn(name="traffic.evict")
    def evict(self, request: EvictPods) -> EvictionReport:
        """Evict these pods (PodDisruptionBudgets honoured: a 429 is waited out until the deadline)."""
        if self.k8s._dry(request.dry_run):
            return EvictionReport(node="", dry_run=True, evicted=list(request.pods))
        pending = [client.V1Pod(metadata=client.V1ObjectMeta(namespace=ref.split("/", 1)[0],
                                                              name=ref.split("/", 1)[1])) for ref in request.pods]
        evicted, left, errors = self.k8s.evict_until(pending, time.monotonic() + request.deadline_s)
        return EvictionReport(node="", evicted=evicted,
                              failed=[PodProblem(pod=ref, reason=errors.get(ref, "deadline")) for ref in left])

    @activity.defn(name="traffic.wait_home")
    def wait_home(self, request: WaitHome) -> HomeReport:
        """Poll until enough inference pods are Ready in-cluster; track the lowest ready/minimum ratio."""
        deadline = time.monotonic() + request.timeout_s
        lowest = float("inf")
        while True:
            snap = self.read()
            ratios = [d.ready / max(1, minimum_ready(d.replicas, request.min_fraction)) for d in snap.deployments]
            lowest = min([lowest, *ratios]) if ratios else lowest
            home = sum(d.ready_in_cluster for d in snap.deployments)
            below = snap.below_minimum(request.min_fraction)
            activity.heartbeat({"in_cluster_ready": home, "below_minimum": below})
            if home >= request.in_cluster_ready and not below:
                return HomeReport(done=True, in_cluster_ready=home, min_ready_ratio=lowest)
            if time.monotonic() >= deadline:
                return HomeReport(done=False, in_cluster_ready=home, min_ready_ratio=lowest, below_minimum=below)
            time.sleep(POLL_S)

    @activity.defn(name="traffic.slo")
    def slo(self, check: SloCheck) -> SloResult:
        """The policy's Prometheus query (error rate, latency): passes while its value is at most `max_value`."""
        if not self.prometheus_url:
            return SloResult(available=False, detail="no Prometheus configured (FLEETMEDIC_PROMETHEUS_URL)")
        response = httpx.get(f"{self.prometheus_url.rstrip('/')}/api/v1/query", params={"query": check.query},
                             timeout=self.k8s.timeout)
        response.raise_for_status()
        result = response.json()["data"]["result"]
        if not result:
            return SloResult(available=True, passed=True, detail="the query returned nothing (no traffic)")
        value = max(float(r["value"][1]) for r in result)
        return SloResult(available=True, passed=value <= check.max_value, value=value,
                         detail=f"{check.query} = {value:g} (max {check.max_value:g})")

    def activities(self) -> list[Callable[..., Any]]:
        return [self.snapshot, self.evict, self.wait_home, self.slo]

