"""The node-provider plugin interface: whoever can give us a healthy node back.

A provider replaces a node (and, where it can, reboots it or opens an RMA). Every request
carries an idempotency key (the workflow ID and the action), so a retried activity asks once.
A provider that needs a person answers `needs_human`; the runbook then waits for a
`replaced` signal from an operator.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from kubernetes import client
from kubernetes.client import ApiClient

from activities.kubernetes import api_errors
from fleetmedic.models import ProviderRequest, ProviderResult


class NodeProvider(Protocol):
    name: str
    # Which of replace / reboot / rma this provider does itself (the rest go to a human).
    supports: frozenset[str]

    def request(self, request: ProviderRequest) -> ProviderResult: ...


def ask_a_human(provider: str, request: ProviderRequest, why: str) -> ProviderResult:
    return ProviderResult(provider=provider, action=request.action, accepted=True, needs_human=True,
                          reference=request.idempotency_key, detail=why)


class KubernetesProvider:
    """What the Cluster API and Karpenter providers share: the API client, and the node they act on."""

    name = "kubernetes"
    supports: frozenset[str] = frozenset({"replace"})

    def __init__(self, api_client: Callable[[], ApiClient], timeout_s: float) -> None:
        self._api_client = api_client
        self.timeout = timeout_s

    def request(self, request: ProviderRequest) -> ProviderResult:
        if request.action not in self.supports:
            return ask_a_human(self.name, request, f"{self.name} cannot {request.action}; do it by hand")
        api = self._api_client()
        with api_errors(f"get node {request.node}"):
            node = client.CoreV1Api(api).read_node(request.node, _request_timeout=self.timeout)
        return self.replace(api, node, request)

    def replace(self, api: ApiClient, node: client.V1Node, request: ProviderRequest) -> ProviderResult:
        raise NotImplementedError
