"""Node providers (plugins) and the activity that calls the configured one."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kubernetes.client import ApiClient
from temporalio import activity

from activities.providers.base import NodeProvider
from activities.providers.cluster_api import ClusterApiProvider
from activities.providers.http import HttpProvider
from activities.providers.karpenter import KarpenterProvider
from activities.providers.manual import ManualProvider
from fleetmedic.models import ProviderRequest, ProviderResult
from fleetmedic.policy import ProviderPolicy


def make_provider(policy: ProviderPolicy, api_client: Callable[[], ApiClient], *, token: str | None,
                  kube_timeout_s: float) -> NodeProvider:
    if policy.kind == "cluster-api":
        return ClusterApiProvider(api_client, policy.cluster_api, kube_timeout_s)
    if policy.kind == "karpenter":
        return KarpenterProvider(api_client, policy.karpenter, kube_timeout_s)
    if policy.kind == "http":
        return HttpProvider(policy.http.url, token, policy.http.timeout.total_seconds())
    return ManualProvider()


class ProviderActivities:
    def __init__(self, provider: NodeProvider, *, force_dry_run: bool = False) -> None:
        self.provider = provider
        self.force_dry_run = force_dry_run

    @activity.defn(name="provider.request")
    def request(self, request: ProviderRequest) -> ProviderResult:
        if self.force_dry_run and not request.dry_run:
            request = request.model_copy(update={"dry_run": True})
        return self.provider.request(request)

    def activities(self) -> list[Callable[..., Any]]:
        return [self.request]
