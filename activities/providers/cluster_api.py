"""The `cluster-api` provider: delete the node's Machine; its MachineSet creates a new Machine,
which joins as a new Node under a new name (the runbook follows it through `status.nodeRef`).

Cluster API's own remediation conventions are honoured before anything is deleted: a Machine
annotated `cluster.x-k8s.io/skip-remediation` or paused (the Machine's or its Cluster's) is left
to a person, and a MachineHealthCheck that covers the Machine stops the replacement when its
`maxUnhealthy` is already reached, as Cluster API itself would. The Machine is annotated
`cluster.x-k8s.io/delete-machine` first, so a scale-down racing the replacement takes this one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kubernetes import client
from kubernetes.client import ApiClient
from kubernetes.client.exceptions import ApiException
from temporalio import activity

from activities.errors import fail
from activities.kubernetes import api_errors, newest_served
from activities.providers.base import KubernetesProvider, ask_a_human
from fleetmedic.errors import ErrorKind
from fleetmedic.models import Follow, ProviderRequest, ProviderResult
from fleetmedic.policy import ClusterApiProviderPolicy

GROUP, PLURAL = "cluster.x-k8s.io", "machines"
# Cluster API 1.11 serves v1beta2 and deprecates v1beta1; older releases serve v1beta1 alone. The
# CRDs of a release without its conversion webhook still serve both: the newest served is used.
VERSIONS = ("v1beta2", "v1beta1")
NAMESPACE_ANNOTATION = "cluster.x-k8s.io/cluster-namespace"
SET_LABEL = "cluster.x-k8s.io/set-name"
SKIP_REMEDIATION = "cluster.x-k8s.io/skip-remediation"
PAUSED = "cluster.x-k8s.io/paused"
DELETE_MACHINE = "cluster.x-k8s.io/delete-machine"
OWNER_KIND, OWNER_NAME = "cluster.x-k8s.io/owner-kind", "cluster.x-k8s.io/owner-name"


class ClusterApiProvider(KubernetesProvider):
    name = "cluster-api"
    group, version, plural = GROUP, VERSIONS[0], PLURAL

    def __init__(self, api_client: Callable[[], ApiClient], policy: ClusterApiProviderPolicy,
                 timeout_s: float) -> None:
        super().__init__(api_client, timeout_s)
        self.policy = policy
        self.discovered = False

    def served(self, api: ApiClient) -> str:
        """The newest Cluster API version the API server serves, asked once per process."""
        if not self.discovered:
            self.version = newest_served(api, GROUP, VERSIONS, self.timeout) or VERSIONS[-1]
            self.discovered = True
        return self.version

    def replace(self, api: ApiClient, node: client.V1Node, request: ProviderRequest) -> ProviderResult:
        annotations = node.metadata.annotations or {}
        machine = annotations.get(self.policy.machine_annotation)
        if not machine:
            raise fail(ErrorKind.INVALID, f"node {request.node} has no {self.policy.machine_annotation} "
                                          f"annotation: it is not a Cluster API machine")
        namespace = annotations.get(NAMESPACE_ANNOTATION, self.policy.namespace)
        ref = f"{namespace}/{machine}"
        custom, version = client.CustomObjectsApi(api), self.served(api)
        try:
            obj: dict[str, Any] = custom.get_namespaced_custom_object(GROUP, version, namespace, PLURAL, machine,
                                                                      _request_timeout=self.timeout)
        except ApiException as exc:
            if exc.status != 404:
                with api_errors(f"get Machine {ref}"):
                    raise
            obj = {}
        # The MachineSet: the Machine's label, or the node's owner annotations (Cluster API writes
        # both) when the Machine is gone already (a retry after the delete went through).
        machine_set = ((obj.get("metadata") or {}).get("labels") or {}).get(SET_LABEL) or (
            annotations.get(OWNER_NAME, "") if annotations.get(OWNER_KIND) == "MachineSet" else "")
        follow = Follow(provider=self.name, old_node=request.node, reference=ref,
                        group=f"{namespace}/{machine_set}" if machine_set else "",
                        since=activity.info().scheduled_time if activity.in_activity() else None)
        result = ProviderResult(provider=self.name, action="replace", accepted=True, reference=ref,
                                dry_run=request.dry_run, follow=follow if machine_set else None)
        if not obj:
            return result.model_copy(update={"detail": f"Machine {ref} already deleted"})
        if obj["metadata"].get("deletionTimestamp"):
            return result.model_copy(update={"detail": f"Machine {ref} is being deleted"})
        if (held := self.held_back(api, obj)) is not None:
            return ask_a_human(self.name, request, f"Machine {ref}: {held}; replace it by hand, then signal "
                                                   f"`replaced`")
        if not machine_set:
            raise fail(ErrorKind.INVALID, f"Machine {ref} belongs to no MachineSet ({SET_LABEL}): nothing "
                                          "would create its replacement")
        if request.dry_run:
            return result.model_copy(update={"detail": f"would delete Machine {ref} (MachineSet {machine_set})"})
        with api_errors(f"mark Machine {ref}"):
            custom.patch_namespaced_custom_object(GROUP, version, namespace, PLURAL, machine, {"metadata": {
                "annotations": {DELETE_MACHINE: f"fleetmedic: {request.idempotency_key}"}}},
                _request_timeout=self.timeout)
        try:
            custom.delete_namespaced_custom_object(GROUP, version, namespace, PLURAL, machine,
                                                   _request_timeout=self.timeout)
        except ApiException as exc:
            if exc.status != 404:
                with api_errors(f"delete Machine {ref}"):
                    raise
        return result.model_copy(update={"detail": f"deleted Machine {ref}; MachineSet {machine_set} "
                                                   "creates the replacement"})

    def held_back(self, api: ApiClient, machine: dict[str, Any]) -> str | None:
        """Why Cluster API's conventions say this Machine must not be remediated now, if they do."""
        meta = machine["metadata"]
        annotations = meta.get("annotations") or {}
        if SKIP_REMEDIATION in annotations:
            return f"annotated {SKIP_REMEDIATION}"
        if PAUSED in annotations:
            return f"annotated {PAUSED}"
        custom = client.CustomObjectsApi(api)
        cluster_name = (machine.get("spec") or {}).get("clusterName", "")
        if cluster_name:
            try:
                cluster = custom.get_namespaced_custom_object(GROUP, self.served(api), meta["namespace"], "clusters",
                                                              cluster_name, _request_timeout=self.timeout)
            except ApiException as exc:
                if exc.status != 404:
                    with api_errors(f"get Cluster {cluster_name}"):
                        raise
                cluster = {}
            if (cluster.get("spec") or {}).get("paused"):
                return f"Cluster {cluster_name} is paused"
        for check in self.health_checks(api, meta["namespace"]):
            spec = check.get("spec") or {}
            if spec.get("clusterName") != cluster_name or not _selects(spec.get("selector") or {}, meta):
                continue
            if (why := short_circuited(check, machine)) is not None:
                return why
        return None

    def health_checks(self, api: ApiClient, namespace: str) -> list[dict[str, Any]]:
        """The namespace's MachineHealthChecks in the served version (`maxUnhealthy` of v1beta1 is
        `remediation.triggerIf` in v1beta2: `short_circuited` reads either)."""
        with api_errors("list MachineHealthChecks"):
            found = client.CustomObjectsApi(api).list_namespaced_custom_object(
                GROUP, self.served(api), namespace, "machinehealthchecks", _request_timeout=self.timeout)
        return list(found.get("items", []))

    def members(self, api: ApiClient, group: str) -> list[dict[str, Any]]:
        namespace, _, machine_set = group.partition("/")
        with api_errors(f"list Machines of MachineSet {group}"):
            found = client.CustomObjectsApi(api).list_namespaced_custom_object(
                GROUP, self.served(api), namespace, PLURAL, label_selector=f"{SET_LABEL}={machine_set}",
                _request_timeout=self.timeout)
        return list(found.get("items", []))

    def node_of(self, obj: dict[str, Any]) -> str | None:
        ref = (obj.get("status") or {}).get("nodeRef") or {}
        return ref.get("name") or None


def _selects(selector: dict[str, Any], meta: dict[str, Any]) -> bool:
    labels = meta.get("labels") or {}
    if selector.get("matchExpressions"):
        return True  # read as covering the Machine: the safer reading for a limit
    return all(labels.get(k) == v for k, v in (selector.get("matchLabels") or {}).items())


def short_circuited(check: dict[str, Any], machine: dict[str, Any]) -> str | None:
    """The MachineHealthCheck's `maxUnhealthy`: with this Machine counted unhealthy, would Cluster
    API still remediate? (It stops remediating when more than maxUnhealthy are unhealthy.)"""
    spec = check.get("spec") or {}
    trigger = (spec.get("remediation") or {}).get("triggerIf") or {}
    limit = trigger.get("unhealthyLessThanOrEqualTo", spec.get("maxUnhealthy"))
    if in_range := trigger.get("unhealthyInRange", spec.get("unhealthyRange")):
        limit = str(in_range).strip("[]").partition("-")[2]  # "[3-5]": at most 5
    status = check.get("status") or {}
    expected = int(status.get("expectedMachines") or 0)
    if limit is None or expected == 0:
        return None
    unhealthy = max(expected - int(status.get("currentHealthy") or 0), 0)
    counted = any(c.get("type") == "HealthCheckSucceeded" and c.get("status") == "False"
                  for c in (machine.get("status") or {}).get("conditions") or [])
    if not counted:
        unhealthy += 1
    allowed = (expected * int(str(limit).rstrip("%")) // 100) if str(limit).endswith("%") else int(limit)
    if unhealthy > allowed:
        return (f"MachineHealthCheck {check['metadata']['name']} allows {limit} unhealthy and "
                f"{unhealthy} of {expected} would be (maxUnhealthy: Cluster API stops remediating there)")
    return None
