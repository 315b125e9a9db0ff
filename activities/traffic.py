"""The cluster as traffic-flip and migrate-back see it: virtual-kubelet nodes and their overflow
taint, in-cluster GPU capacity, inference Deployments and their pods, admitted training; evicting a
batch of inference pods and waiting until their replacements are Ready at home."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import httpx
from kubernetes import client
from kubernetes.utils import parse_quantity
from temporalio import activity
from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.service import RPCError, RPCStatusCode

from activities.kubernetes import KubernetesActivities
from activities.kueue import KueueActivities, training_workloads
from fleetmedic.models import EvictionReport, Operator, PodProblem, Taint
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
        self.kueue = KueueActivities(kubernetes)
        self.prometheus_url = prometheus_url

    @property
    def traffic(self) -> TrafficPolicy:
        return self.k8s.policy.traffic

    @activity.defn(name="traffic.snapshot")
    def snapshot(self) -> TrafficSnapshot:
        return self.read()

    def read(self, light: bool = False) -> TrafficSnapshot:
        """`light`: only inference pods (no GPU accounting, no training) — enough to count replicas."""
        policy, gpu = self.traffic, self.k8s.policy.labels.gpu_resource
        overflow = Taint.parse(policy.overflow_taint)
        core = self.k8s.core
        nodes = self.k8s.raw_list("list nodes", core.list_node)
        pods = self.k8s.raw_list("list pods", core.list_pod_for_all_namespaces,
                                 **({"label_selector": policy.inference_selector} if light else {}))
        deployments = self.k8s.raw_list("list inference Deployments",
                                        client.AppsV1Api(core.api_client).list_deployment_for_all_namespaces,
                                        label_selector=policy.inference_selector)

        def labels(obj: dict[str, Any]) -> dict[str, str]:
            return dict(obj["metadata"].get("labels") or {})

        # The opt-out of what migrate-back would evict: the Deployment's label, or its namespace's.
        opt_out = self.k8s.policy.labels.opt_out
        opted_out_namespaces = set() if light else {
            n["metadata"]["name"] for n in self.k8s.raw_list("list opted-out namespaces", core.list_namespace,
                                                             label_selector=opt_out)}

        virtual = {n["metadata"]["name"] for n in nodes if label_selector_matches(policy.virtual_node_selector,
                                                                                 labels(n))}
        home: set[str] = set()
        snapshot: dict[str, Any] = {"virtual_nodes": sorted(virtual), "virtual_open": [], "virtual_gpus": 0,
                                    "cluster_gpus": 0}
        for node in nodes:
            status, spec, name = node.get("status") or {}, node.get("spec") or {}, node["metadata"]["name"]
            allocatable = int(parse_quantity((status.get("allocatable") or {}).get(gpu, "0")))
            if name in virtual:
                if not any(t["key"] == overflow.key and t["effect"] == overflow.effect
                           for t in spec.get("taints") or []):
                    snapshot["virtual_open"].append(name)
                snapshot["virtual_gpus"] += allocatable
                continue
            ready = any(c["type"] == "Ready" and c["status"] == "True" for c in status.get("conditions") or [])
            if label_selector_matches(self.k8s.policy.labels.gpu_node_selector, labels(node)) and ready \
                    and not spec.get("unschedulable"):
                home.add(name)
                snapshot["cluster_gpus"] += allocatable

        used = 0
        inference: list[tuple[InferencePod, dict[str, str]]] = []
        for pod in pods:
            meta, spec, status = pod["metadata"], pod.get("spec") or {}, pod.get("status") or {}
            if status.get("phase") in ("Succeeded", "Failed") or meta.get("deletionTimestamp"):
                continue
            on_node = spec.get("nodeName") or ""
            gpus = sum(int(parse_quantity(((c.get("resources") or {}).get("requests") or {}).get(gpu, "0")))
                       for c in spec.get("containers") or [])
            if on_node in home:
                used += gpus
            if label_selector_matches(policy.inference_selector, labels(pod)):
                ready = any(c["type"] == "Ready" and c["status"] == "True" for c in status.get("conditions") or [])
                inference.append((InferencePod(namespace=meta["namespace"], name=meta["name"], node=on_node,
                                               on_virtual=on_node in virtual, ready=ready, gpus=gpus), labels(pod)))
        owned: dict[str, str] = {}
        selected = []
        for deployment in deployments:
            meta, spec = deployment["metadata"], deployment["spec"]
            ref = f"{meta['namespace']}/{meta['name']}"
            match = (spec.get("selector") or {}).get("matchLabels") or {}
            mine = [p for p, pod_labels in inference if p.namespace == meta["namespace"]
                    and all(pod_labels.get(k) == v for k, v in match.items())]
            owned.update({p.ref: ref for p in mine})
            per_pod = sum(int(parse_quantity(((c.get("resources") or {}).get("requests") or {}).get(gpu, "0")))
                          for c in spec["template"]["spec"].get("containers") or [])
            opted_out = (f"Deployment {ref} has {opt_out}" if label_selector_matches(opt_out, labels(deployment))
                         else f"namespace {meta['namespace']} has {opt_out}"
                         if meta["namespace"] in opted_out_namespaces else "")
            selected.append(InferenceDeployment(
                namespace=meta["namespace"], name=meta["name"], replicas=spec.get("replicas") or 0, opted_out=opted_out,
                ready=sum(1 for p in mine if p.ready),
                ready_in_cluster=sum(1 for p in mine if p.ready and not p.on_virtual and p.node),
                gpus_per_pod=per_pod))
        return TrafficSnapshot(
            **snapshot, used_gpus=0 if light else used, deployments=selected,
            pods=[p.model_copy(update={"deployment": owned.get(p.ref, "")}) for p, _ in inference],
            training=[] if light else self._training(snapshot["cluster_gpus"]))

    def _training(self, cluster_gpus: int) -> list[TrainingWorkload]:
        """Training at or above the priority: admitted and not finished, or pending and it would fit
        in the cluster's GPUs beside the admitted training — then what keeps it out is inference
        (Kueue preempting it, or pods outside Kueue), not the size of the cluster. None without Kueue."""
        found = training_workloads(self.kueue.objects("workloads") or [], self.k8s.policy.labels.gpu_resource,
                                   self.traffic.training_priority)
        room = cluster_gpus - sum(w.gpus for w in found if w.admitted)
        wanted = []
        for workload in found:
            if not workload.admitted:
                if workload.gpus > room:
                    continue  # it waits for training or for nodes, not for inference
                room -= workload.gpus
            wanted.append(workload)
        return wanted

    @activity.defn(name="traffic.evict")
    async def evict(self, request: EvictPods) -> EvictionReport:
        """Evict these pods (PodDisruptionBudgets honoured: a 429 is waited out until the deadline).
        Async, on the waits queue (activities/waits.py)."""
        if self.k8s._dry(request.dry_run):
            return EvictionReport(node="", dry_run=True, evicted=list(request.pods))
        pending = [client.V1Pod(metadata=client.V1ObjectMeta(namespace=ref.split("/", 1)[0],
                                                              name=ref.split("/", 1)[1])) for ref in request.pods]
        evicted, left, errors = await self.k8s.evict_until(pending, time.monotonic() + request.deadline_s)
        return EvictionReport(node="", evicted=evicted,
                              failed=[PodProblem(pod=ref, reason=errors.get(ref, "deadline")) for ref in left])

    @activity.defn(name="traffic.wait_home")
    async def wait_home(self, request: WaitHome) -> HomeReport:
        """Poll until enough inference pods are Ready in-cluster; track the lowest ready/minimum ratio.
        Async, on the waits queue (activities/waits.py): each read on the waits' few threads."""
        deadline = time.monotonic() + request.timeout_s
        lowest = float("inf")
        while True:
            snap = await self.k8s.blocking(self.read, True)
            ratios = [d.ready / max(1, minimum_ready(d.replicas, request.min_fraction)) for d in snap.deployments]
            lowest = min([lowest, *ratios]) if ratios else lowest
            home = sum(d.ready_in_cluster for d in snap.deployments)
            below = snap.below_minimum(request.min_fraction)
            activity.heartbeat({"in_cluster_ready": home, "below_minimum": below})
            if home >= request.in_cluster_ready and not below:
                return HomeReport(done=True, in_cluster_ready=home, min_ready_ratio=lowest)
            if time.monotonic() >= deadline:
                return HomeReport(done=False, in_cluster_ready=home, min_ready_ratio=lowest, below_minimum=below)
            await asyncio.sleep(POLL_S)

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


class TrafficHandoff:
    """traffic-flip and migrate-back never act together: each stops the other first."""

    def __init__(self, client: Client) -> None:
        self.client = client

    @activity.defn(name="traffic.stop_runbook")
    async def stop_runbook(self, workflow_id: str, operator: Operator) -> bool:
        """Signal `stop` to a running traffic runbook and wait until it has closed. False: none ran."""
        handle = self.client.get_workflow_handle(workflow_id)
        try:
            await handle.signal("stop", operator)
        except RPCError as exc:
            if exc.status == RPCStatusCode.NOT_FOUND:
                return False
            raise
        while True:
            description = await handle.describe()
            if description.status != WorkflowExecutionStatus.RUNNING:
                return True
            activity.heartbeat(f"waiting for {workflow_id} to stop")
            await asyncio.sleep(0.5)

    def activities(self) -> list[Callable[..., Any]]:
        return [self.stop_runbook]
