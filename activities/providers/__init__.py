"""Node providers (plugins) and the activity that calls the configured one."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from kubernetes.client import ApiClient
from temporalio import activity

from activities.errors import fail
from activities.node_watch import tick_for
from activities.providers.base import KubernetesProvider, NodeProvider
from activities.providers.cluster_api import ClusterApiProvider
from activities.providers.http import HttpProvider
from activities.providers.karpenter import KarpenterProvider
from activities.providers.manual import ManualProvider
from activities.waits import BlockingCalls, alive, heartbeat, window_left
from fleetmedic.errors import ErrorKind
from fleetmedic.models import FindReplacement, Follow, ProviderRequest, ProviderResult, Replacement
from fleetmedic.policy import ProviderPolicy
from fleetmedic.trust import node_name_error

# How often a search for the replacement looks again (and heartbeats): every 2 s at first, each wait
# half as long again as the one before, up to LOOK_AT_MOST_S (and a quarter of its heartbeat timeout).
# A new machine takes minutes to join; a search that looked every 2 s all that time made, with 1,000
# replacements under way, 500 calls a second to the provider's API (a cloud's rate limit) or 500
# lists of a MachineSet to the API server. Growing waits find a quick one quickly and a slow one
# at most LOOK_AT_MOST_S late.
LOOK_EVERY_S = 2.0
LOOK_GROWTH = 1.5
LOOK_AT_MOST_S = 15.0
# How old a list of a MachineSet's Machines (a NodePool's NodeClaims) may be to answer a look.
LIST_SHARED_S = 1.0


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
        # The searches of one MachineSet or NodePool share its lists: a look is answered by the
        # group's list that started less than LIST_SHARED_S ago, or by a new one. The API server
        # then serves at most one list of a group a second, however many replacements are under
        # way in it; each search looks every 2-15 s, so a second-old list is news to it.
        self.group_lists: dict[str, tuple[float, asyncio.Future[list[dict[str, Any]]]]] = {}

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
        look_every = LOOK_EVERY_S
        at_most = max(min(LOOK_AT_MOST_S, tick_for(activity.info().heartbeat_timeout)), LOOK_EVERY_S)
        while True:
            found = await self.look(find.follow)
            if found.node is not None:
                _trusted(found.node)
            if found.node is not None or found.failed or time.monotonic() >= deadline:
                return found
            heartbeat(found.detail)
            await asyncio.sleep(min(look_every, max(deadline - time.monotonic(), 0)))
            look_every = min(look_every * LOOK_GROWTH, at_most)

    async def look(self, follow: Follow) -> Replacement:
        """One look: a Kubernetes provider's in its group's shared list, any other's its own call."""
        if isinstance(self.provider, KubernetesProvider) and follow.group:
            members = await alive(asyncio.shield(self.group_list(self.provider, follow.group)))
            return await self.blocking(self.provider.found_in, members, follow)
        return await self.blocking(self.provider.find_replacement, follow)

    def group_list(self, provider: KubernetesProvider, group: str) -> asyncio.Future[list[dict[str, Any]]]:
        """The group's shared list: the one started less than LIST_SHARED_S ago, unless it failed,
        or a new one (on the waits' threads)."""
        now = time.monotonic()
        shared = self.group_lists.get(group)
        if shared is not None and now - shared[0] < LIST_SHARED_S and not (
                shared[1].done() and shared[1].exception() is not None):
            return shared[1]
        for old in [g for g, (began, _) in self.group_lists.items() if now - began >= LIST_SHARED_S]:
            del self.group_lists[old]  # bounded by the groups listed in the last second
        listing = asyncio.get_running_loop().run_in_executor(self.blocking.executor, provider.members_of, group)
        # A list whose every search was cancelled: its error is nobody's.
        listing.add_done_callback(lambda done: done.cancelled() or done.exception())
        self.group_lists[group] = (now, listing)
        return listing

    def activities(self) -> list[Callable[..., Any]]:
        return [self.request, self.find_replacement]


def _trusted(node: str) -> None:
    """A node name a provider gives reaches the Kubernetes API and Slurm: the same rule as alerts'."""
    if (error := node_name_error(node)) is not None:
        raise fail(ErrorKind.INVALID, f"the provider named a replacement node that cannot be used: {error}")
