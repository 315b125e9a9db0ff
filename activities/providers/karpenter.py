"""The `karpenter` provider: delete the node's NodeClaim; Karpenter provisions a new node."""

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
from fleetmedic.policy import KarpenterProviderPolicy

GROUP, VERSION, PLURAL = "karpenter.sh", "v1", "nodeclaims"


class KarpenterProvider(KubernetesProvider):
    name = "karpenter"

    def __init__(self, api_client: Callable[[], ApiClient], policy: KarpenterProviderPolicy,
                 timeout_s: float) -> None:
        super().__init__(api_client, timeout_s)
        self.policy = policy

    def replace(self, api: ApiClient, node: client.V1Node, request: ProviderRequest) -> ProviderResult:
        if self.policy.nodepool_label not in (node.metadata.labels or {}):
            raise fail(ErrorKind.INVALID, f"node {request.node} has no {self.policy.nodepool_label} label: "
                                          "Karpenter does not manage it")
        custom = client.CustomObjectsApi(api)
        with api_errors("list NodeClaims"):
            claims = custom.list_cluster_custom_object(GROUP, VERSION, PLURAL, _request_timeout=self.timeout)
        claim = next((c["metadata"]["name"] for c in claims.get("items", [])
                      if (c.get("status") or {}).get("nodeName") == request.node), None)
        result = ProviderResult(provider=self.name, action="replace", accepted=True, dry_run=request.dry_run,
                                reference=claim or "")
        if claim is None:
            # A Karpenter node without a claim: our earlier attempt already deleted it.
            return result.model_copy(update={"detail": f"no NodeClaim left for {request.node}: already deleted"})
        if request.dry_run:
            return result.model_copy(update={"detail": f"would delete NodeClaim {claim}"})
        try:
            custom.delete_cluster_custom_object(GROUP, VERSION, PLURAL, claim, _request_timeout=self.timeout)
        except ApiException as exc:
            if exc.status != 404:
                with api_errors(f"delete NodeClaim {claim}"):
                    raise
        return result.model_copy(update={"detail": f"deleted NodeClaim {claim}; Karpenter provisions a new node"})
