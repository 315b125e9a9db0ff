"""Node providers (plugins) and the activity that calls the configured one."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from kubernetes.client import ApiClient
from temporalio import activity

from activities.errors import fail
from activities.providers.base import NodeProvider
from activities.providers.cluster_api import ClusterApiProvider
from activities.providers.http import HttpProvider
from activities.providers.karpenter import KarpenterProvider
from activities.providers.manual import ManualProvider
from activities.waits import BlockingCalls, heartbeat, window_left
from fleetmedic.errors import ErrorKind
from fleetmedic.models import FindReplacement, ProviderRequest, ProviderResult, Replacement
from fleetmedic.policy import ProviderPolicy
from fleetmedic.trust import node_name_error

# How often a search for the replacement looks again (and heartbeats).
LOOK_EVERY_S = 2.0


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
    def __init__(self, provider: NodeProvider, *, force_dry_run: bool = False,
                 blocking: BlockingCalls | None = None) -> None:
        self.provider = provider
        self.force_dry_run = force_dry_run
        self.blocking = blocking or BlockingCalls()  # the search's looks

    @activity.defn(name="provider.request")
    def request(self, request: ProviderRequest) -> ProviderResult:
        if self.force_dry_run and not request.dry_run:
            request = request.model_copy(update={"dry_run": True})
        result = self.provider.request(request)
        if result.new_node is not None:
            _trusted(result.new_node)
        return result

    @activity.defn(name="provider.find_replacement")
    async def find_replacement(self, find: FindReplacement) -> Replacement:
        """Look for the new node until the provider names it or `timeout_s` passes (the run's deadline);
        heartbeats between looks, so a cancelled
        search (an abort, an operator naming the node) stops at its next heartbeat.
        Async, on the waits queue (activities/waits.py): a machine that takes minutes holds no thread."""
        deadline = time.monotonic() + window_left(find.timeout_s)
        while True:
            found = await self.blocking(self.provider.find_replacement, find.follow)
            if found.node is not None:
                _trusted(found.node)
            if found.node is not None or found.failed or time.monotonic() >= deadline:
                return found
            heartbeat(found.detail)
            await asyncio.sleep(min(LOOK_EVERY_S, max(deadline - time.monotonic(), 0)))

    def activities(self) -> list[Callable[..., Any]]:
        return [self.request, self.find_replacement]


def _trusted(node: str) -> None:
    """A node name a provider gives reaches the Kubernetes API and Slurm: the same rule as alerts'."""
    if (error := node_name_error(node)) is not None:
        raise fail(ErrorKind.INVALID, f"the provider named a replacement node that cannot be used: {error}")
