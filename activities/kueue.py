"""Kueue through the Kubernetes API: ResourceFlavors, ClusterQueues and admitted Workloads read
for kueue-quota-sync, and a ClusterQueue's GPU `nominalQuota` set with optimistic concurrency.

Kueue's objects are cluster-scoped (flavors, queues) and namespaced (workloads), in the newest
version the API server serves: `kueue.x-k8s.io/v1beta2` (Kueue 0.15 on, its storage version since),
else v1beta1 (deprecated from 0.17). Every field read here is the same in both.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kubernetes.utils import parse_quantity
from temporalio import activity
from temporalio.client import Client

from activities.errors import fail, reread_on_conflict
from activities.kubernetes import KubernetesActivities, api_errors, newest_served, node_info
from activities.start import RUNBOOK_TASK_TIMEOUT, signal_shared
from fleetmedic.details import run_details
from fleetmedic.errors import ErrorKind
from fleetmedic.ids import cluster_workflow_id, run_summary, start_attributes
from fleetmedic.models import ActionResult
from fleetmedic.quota import Flavor, KueueSnapshot, Queue, QuotaSlot, QuotaSyncInput, QuotaUpdate
from fleetmedic.traffic import TrainingWorkload

GROUP, VERSIONS = "kueue.x-k8s.io", ("v1beta2", "v1beta1")


class KueueActivities:
    def __init__(self, kubernetes: KubernetesActivities) -> None:
        self.k8s = kubernetes
        self.served: str | None = None  # found once per process; Kueue may be installed later

    def version(self) -> str | None:
        """The Kueue API version to speak (None: Kueue is not installed here)."""
        if self.served is None:
            self.served = newest_served(self.k8s.custom.api_client, GROUP, VERSIONS, self.k8s.timeout)
        return self.served

    @property
    def gpu(self) -> str:
        return self.k8s.policy.labels.gpu_resource

    def objects(self, plural: str) -> list[dict[str, Any]] | None:
        """Every cluster-wide Kueue object of a kind; None when Kueue's API is not installed here."""
        version = self.version()
        if version is None:
            return None
        try:
            with api_errors(f"list Kueue {plural}"):
                result = self.k8s.custom.list_cluster_custom_object(GROUP, version, plural,
                                                                    _request_timeout=self.k8s.timeout)
        except Exception as exc:
            if getattr(exc, "type", None) == ErrorKind.NOT_FOUND:
                self.served = None  # uninstalled, or moved to a newer version: ask again next time
                return None
            raise
        return list(result.get("items", []))

    @activity.defn(name="kueue.snapshot")
    def snapshot(self) -> KueueSnapshot:
        """Flavors, the GPU quotas of every ClusterQueue, what admitted workloads hold, and the GPU nodes."""
        flavors = self.objects("resourceflavors")
        if flavors is None:
            return KueueSnapshot(installed=False)  # no Kueue API in this cluster: nothing to keep in sync
        queues, workloads = self.objects("clusterqueues") or [], self.objects("workloads") or []
        with api_errors("list GPU nodes"):
            nodes = self.k8s.core.list_node(label_selector=self.k8s.policy.labels.gpu_node_selector,
                                            _request_timeout=self.k8s.timeout).items
        used = self._admitted_usage(workloads)
        return KueueSnapshot(
            flavors=[Flavor(name=f["metadata"]["name"], node_labels=(f.get("spec") or {}).get("nodeLabels") or {})
                     for f in flavors],
            queues=[Queue(name=q["metadata"]["name"], resource_version=q["metadata"].get("resourceVersion", ""),
                          slots=self._slots(q), used=used.get(q["metadata"]["name"], {})) for q in queues],
            nodes=[node_info(n, self.gpu) for n in nodes])

    def _slots(self, queue: dict[str, Any]) -> list[QuotaSlot]:
        slots = []
        for g, group in enumerate((queue.get("spec") or {}).get("resourceGroups") or []):
            for f, flavor in enumerate(group.get("flavors") or []):
                for r, resource in enumerate(flavor.get("resources") or []):
                    if resource.get("name") == self.gpu:
                        slots.append(QuotaSlot(flavor=flavor["name"], group=g, flavor_index=f, resource_index=r,
                                               nominal=int(parse_quantity(str(resource.get("nominalQuota", 0))))))
        return slots

    def _admitted_usage(self, workloads: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
        """queue -> flavor -> GPUs held by admitted (quota-reserved) workloads."""
        used: dict[str, dict[str, int]] = {}
        for workload in workloads:
            queue = ((workload.get("status") or {}).get("admission") or {}).get("clusterQueue")
            if not admitted(workload, "Admitted", "QuotaReserved") or not queue:
                continue
            per_flavor = used.setdefault(queue, {})
            for flavor, gpus in assigned_gpus(workload, self.gpu):
                if flavor:
                    per_flavor[flavor] = per_flavor.get(flavor, 0) + gpus
        return used

    @activity.defn(name="kueue.set_quota")
    def set_quota(self, update: QuotaUpdate) -> ActionResult:
        """Set GPU nominalQuotas of one ClusterQueue: read, change only those numbers, replace with the
        resourceVersion; on a 409 read the fresh object and apply the same numbers to it."""
        target = f"ClusterQueue {update.queue}"
        detail = ", ".join(f"{s.flavor} {s.nominal}" for s in update.slots)

        def attempt() -> ActionResult:
            version = self.version()
            if version is None:
                raise fail(ErrorKind.NOT_FOUND, f"{target}: Kueue's API ({GROUP}) is not served here")
            with api_errors(f"get ClusterQueue {update.queue}"):
                queue = self.k8s.custom.get_cluster_custom_object(GROUP, version, "clusterqueues", update.queue,
                                                                  _request_timeout=self.k8s.timeout)
            changed = False
            for slot in update.slots:
                try:
                    flavor = queue["spec"]["resourceGroups"][slot.group]["flavors"][slot.flavor_index]
                    resource = flavor["resources"][slot.resource_index]
                except (KeyError, IndexError, TypeError):
                    flavor, resource = {}, {}
                if flavor.get("name") != slot.flavor or resource.get("name") != self.gpu:
                    # Someone restructured the queue since we read it: recompute rather than guess.
                    raise fail(ErrorKind.CONFLICT, f"{target} changed shape: {slot.flavor} is no longer where "
                                                   "it was; the next sync recomputes")
                if int(parse_quantity(str(resource.get("nominalQuota", 0)))) != slot.nominal:
                    resource["nominalQuota"] = slot.nominal
                    changed = True
            if not changed:
                return ActionResult(system="kubernetes", action="set quota", target=target, changed=False,
                                    dry_run=update.dry_run, detail=f"already {detail}")
            if self.k8s._dry(update.dry_run):
                return ActionResult(system="kubernetes", action="set quota", target=target, changed=False,
                                    dry_run=True, detail=detail)
            with api_errors(f"update ClusterQueue {update.queue}"):
                self.k8s.custom.replace_cluster_custom_object(GROUP, version, "clusterqueues", update.queue,
                                                              queue, _request_timeout=self.k8s.timeout)
            return ActionResult(system="kubernetes", action="set quota", target=target, changed=True,
                                detail=detail)

        return reread_on_conflict(target, attempt)

    def activities(self) -> list[Callable[..., Any]]:
        return [self.snapshot, self.set_quota]


def admitted(workload: dict[str, Any], *conditions: str) -> bool:
    """One of these conditions (Admitted, QuotaReserved) is True on the Workload."""
    return any(c.get("type") in conditions and c.get("status") == "True"
               for c in (workload.get("status") or {}).get("conditions") or [])


def assigned_gpus(workload: dict[str, Any], gpu: str) -> list[tuple[str, int]]:
    """(flavor, GPUs) of each pod set Kueue admitted with GPUs; the flavor is "" when none is named."""
    assignments = ((workload.get("status") or {}).get("admission") or {}).get("podSetAssignments") or []
    return [((a.get("flavors") or {}).get(gpu, ""), int(parse_quantity(str((a.get("resourceUsage") or {})[gpu]))))
            for a in assignments if gpu in (a.get("resourceUsage") or {})]


def finished(workload: dict[str, Any]) -> bool:
    """Kueue marked it Finished (its Job ended): it holds nothing, whatever its Admitted condition says."""
    return admitted(workload, "Finished")


def requested_gpus(workload: dict[str, Any], gpu: str) -> int:
    """GPUs the Workload asks for: every pod set's count times its pods' GPU requests."""
    total = 0
    for pod_set in (workload.get("spec") or {}).get("podSets") or []:
        pod = (pod_set.get("template") or {}).get("spec") or {}
        per_pod = sum(int(parse_quantity(str(((c.get("resources") or {}).get("requests") or {}).get(gpu, 0))))
                      for c in pod.get("containers") or [])
        total += int(pod_set.get("count") or 1) * per_pod
    return total


def training_workloads(workloads: list[dict[str, Any]], gpu: str, priority: int) -> list[TrainingWorkload]:
    """Workloads at or above the training priority that hold GPUs (admitted) or want them (pending:
    active, not admitted, not finished — Kueue may be preempting for them this very moment)."""
    training = []
    for item in workloads:
        level = int((item.get("spec") or {}).get("priority") or 0)
        if level < priority or finished(item):
            continue
        if admitted(item, "Admitted"):
            gpus = sum(n for _, n in assigned_gpus(item, gpu))
        elif (item.get("spec") or {}).get("active", True) is not False:
            gpus = requested_gpus(item, gpu)
        else:
            continue  # deactivated: wants nothing until someone activates it
        training.append(TrainingWorkload(namespace=item["metadata"].get("namespace", ""), name=item["metadata"]["name"],
                                         uid=item["metadata"].get("uid", ""), priority=level, gpus=gpus,
                                         admitted=admitted(item, "Admitted")))
    return training


class KueueTrigger:
    """Starts (or nudges) kueue-quota-sync/<cluster> when a node runbook takes a node out or back."""

    def __init__(self, client: Client, task_queue: str) -> None:
        self.client = client
        self.task_queue = task_queue

    @activity.defn(name="kueue.request_sync")
    async def request_quota_sync(self, cluster: str) -> None:
        """A node left or returned: start kueue-quota-sync/<cluster>, or tell the running one to
        make another pass."""
        workflow_id = cluster_workflow_id("kueue-quota-sync", cluster)
        request = QuotaSyncInput(cluster=cluster, requested_by="node runbook")
        await signal_shared(self.client, "kueue-quota-sync", request, refused=f"{workflow_id} did not take the sync",
                            workflow_id=workflow_id, task_queue=self.task_queue, signal="sync",
                            task_timeout=RUNBOOK_TASK_TIMEOUT,
                            search_attributes=start_attributes("kueue-quota-sync", cluster),
                            summary=run_summary("kueue-quota-sync", cluster, why="a node left or came back"),
                            details=run_details(workflow_id, "kueue-quota-sync", cluster,
                                                started_by="a node runbook (a node left or came back)"))

    def activities(self) -> list[Callable[..., Any]]:
        return [self.request_quota_sync]
