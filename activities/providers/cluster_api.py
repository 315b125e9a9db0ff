"""The `cluster-api` provider: delete the node's Machine; its MachineSet creates a new one."""

from __future__ import annotations

from collections.abc import Callable

from kubernetes import client
from kubernetes.client import ApiClient
from kubernetes.client.exceptions import ApiException

from activities.errors import fail
from activities.kubernetes import api_errors
from activities.providers.base import KubernetesProvider
from fleetmedic.errors import ErrorKind
from fleetmedic.models import ProviderRequest, ProviderResult
from fleetmedic.policy import ClusterApiProviderPolicy

GROUP, VERSION, PLURAL = "cluster.x-k8s.io", "v1beta1", "machines"
NAMESPACE_ANNOTATION = "cluster.x-k8s.io/cluster-namespace"


class ClusterApiProvider(KubernetesProvider):
    name = "cluster-api"

    def __init__(self, api_client: Callable[[], ApiClient], policy: ClusterApiProviderPolicy,
                 timeout_s: float) -> None:
        super().__init__(api_client, timeout_s)
        self.policy = policy

    def replace(self, api: ApiClient, node: client.V1Node, request: ProviderRequest) -> ProviderResult:
        annotations = node.metadata.annotations or {}
        machine = annotations.get(self.policy.machine_annotation)
        if not machine:
            raise fail(ErrorKind.INVALID, f"node {request.node} has no {self.policy.machine_annotation} "
                                          f"annotation: it is not a Cluster API machine")
        namespace = annotations.get(NAMESPACE_ANNOTATION, self.policy.namespace)
        result = ProviderResult(provider=self.name, action="replace", accepted=True,
                                reference=f"{namespace}/{machine}", dry_run=request.dry_run)
        if request.dry_run:
            return result.model_copy(update={"detail": f"would delete Machine {namespace}/{machine}"})
        try:
            client.CustomObjectsApi(api).delete_namespaced_custom_object(
                GROUP, VERSION, namespace, PLURAL, machine, _request_timeout=self.timeout)
        except ApiException as exc:
            if exc.status != 404:
                with api_errors(f"delete Machine {namespace}/{machine}"):
                    raise
            return result.model_copy(update={"detail": f"Machine {namespace}/{machine} already deleted"})
        return result.model_copy(update={"detail": f"deleted Machine {namespace}/{machine}; "
                                                   "its MachineSet creates the replacement"})
