"""The `karpenter` provider: delete the node's NodeClaim; Karpenter provisions a new NodeClaim in
the same NodePool, which joins as a new Node under a new name (the runbook follows it through the
claim's `status.nodeName`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kubernetes import client
from kubernetes.client import ApiClient
from kubernetes.client.exceptions import ApiException
from temporalio import activity

from activities.errors import fail
from activities.kubernetes import api_errors
from activities.providers.base import KubernetesProvider
from fleetmedic.errors import ErrorKind
from fleetmedic.models import Follow, ProviderRequest, ProviderResult
from fleetmedic.policy import KarpenterProviderPolicy

GROUP, VERSION, PLURAL = "karpenter.sh", "v1", "nodeclaims"


class KarpenterProvider(KubernetesProvider):
    name = "karpenter"
    group, version, plural = GROUP, VERSION, PLURAL

    def __init__(self, api_client: Callable[[], ApiClient], policy: KarpenterProviderPolicy,
                 timeout_s: float) -> None:
        super().__init__(api_client, timeout_s)
        self.policy = policy

    def replace(self, api: ApiClient, node: client.V1Node, request: ProviderRequest) -> ProviderResult:
        pool = (node.metadata.labels or {}).get(self.policy.nodepool_label)
        if not pool:
            raise fail(ErrorKind.INVALID, f"node {request.node} has no {self.policy.nodepool_label} label: "
                                          "Karpenter does not manage it")
        custom = client.CustomObjectsApi(api)
        with api_errors("list NodeClaims"):
            claims = custom.list_cluster_custom_object(GROUP, VERSION, PLURAL, _request_timeout=self.timeout)
        claim = next((c for c in claims.get("items", []) if (c.get("status") or {}).get("nodeName") == request.node),
                     None)
        name = claim["metadata"]["name"] if claim else ""
        follow = Follow(provider=self.name, old_node=request.node, reference=name, group=pool,
                        since=activity.info().scheduled_time if activity.in_activity() else None)
        result = ProviderResult(provider=self.name, action="replace", accepted=True, dry_run=request.dry_run,
                                reference=name, follow=follow)
        if claim is None:
            # A Karpenter node without a claim: our earlier attempt already deleted it.
            return result.model_copy(update={"detail": f"no NodeClaim left for {request.node}: already deleted"})
        if request.dry_run:
            return result.model_copy(update={"detail": f"would delete NodeClaim {name} (NodePool {pool})"})
        if claim["metadata"].get("deletionTimestamp"):
            return result.model_copy(update={"detail": f"NodeClaim {name} is being deleted"})
        try:
            custom.delete_cluster_custom_object(GROUP, VERSION, PLURAL, name, _request_timeout=self.timeout)
        except ApiException as exc:
            if exc.status != 404:
                with api_errors(f"delete NodeClaim {name}"):
                    raise
        return result.model_copy(update={"detail": f"deleted NodeClaim {name}; Karpenter provisions a new node "
                                                   f"in NodePool {pool}"})

    def members(self, api: ApiClient, group: str) -> list[dict[str, Any]]:
        with api_errors(f"list NodeClaims of NodePool {group}"):
            found = client.CustomObjectsApi(api).list_cluster_custom_object(
                GROUP, VERSION, PLURAL, label_selector=f"{self.policy.nodepool_label}={group}",
                _request_timeout=self.timeout)
        return list(found.get("items", []))

    def node_of(self, obj: dict[str, Any]) -> str | None:
        return (obj.get("status") or {}).get("nodeName") or None
