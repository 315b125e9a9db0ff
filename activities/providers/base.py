"""The node-provider plugin interface: whoever can give us a healthy node back.

A provider replaces a node (and, where it can, reboots it or opens an RMA). Every request
carries an idempotency key (the workflow ID and the action), so a retried activity asks once.
A provider that needs a person answers `needs_human`; the runbook then waits for a
`replaced` signal from an operator.

What a request yields is part of the contract (`ProviderResult`): the same node (a reboot, a
repair in place), or a new machine under a new name — known at once (`new_node`) or to be found
(`follow`): Cluster API's MachineSet and Karpenter create a new object with a new name, and the
runbook follows it to the node that will serve (`find_replacement`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import datetime
from typing import Any, Protocol

from kubernetes import client
from kubernetes.client import ApiClient
from kubernetes.client.exceptions import ApiException

from activities.kubernetes import api_errors
from fleetmedic.models import Follow, ProviderRequest, ProviderResult, Replacement

# On the new Machine or NodeClaim: the node it replaces. Two runs that replaced two nodes of the
# same MachineSet or NodePool at once never take the same new machine (the claim is a write with
# the object's resourceVersion: the second writer gets a conflict and looks again).
REPLACES_ANNOTATION = "fleetmedic.io/replaces"

# The claims this worker made lately (object UID → the node it replaces), at most this many: the
# searches of one group share each list (activities/providers/__init__.py), so each would try the
# same oldest new object first and all but one get a conflict (a thousand replacements arriving
# together: half a million conflicting writes); and a list up to a second old does not show the
# claims made since. A claim remembered here is the claimer's, and skipped by the others.
CLAIMS_KEPT = 10_000


class NodeProvider(Protocol):
    name: str
    # Which of replace / reboot / rma this provider does itself (the rest go to a human).
    supports: frozenset[str]

    def request(self, request: ProviderRequest) -> ProviderResult: ...

    def find_replacement(self, follow: Follow) -> Replacement:
        """One look for the node that replaces `follow.old_node` (None while there is none yet)."""
        ...


def ask_a_human(provider: str, request: ProviderRequest, why: str) -> ProviderResult:
    return ProviderResult(provider=provider, action=request.action, accepted=True, needs_human=True,
                          reference=request.idempotency_key, detail=why)


def nothing_to_follow(follow: Follow) -> Replacement:
    return Replacement(detail=f"{follow.provider} gives no new node name: the operator's `replaced` does")


class KubernetesProvider:
    """What the Cluster API and Karpenter providers share: the API client, the node they act on,
    and following a replacement to the new object of the same group."""

    name = "kubernetes"
    supports: frozenset[str] = frozenset({"replace"})
    group = version = plural = ""  # the custom resource a replacement appears as

    def __init__(self, api_client: Callable[[], ApiClient], timeout_s: float) -> None:
        self._api_client = api_client
        self.timeout = timeout_s
        self._claims: dict[str, str] = {}
        self._claims_lock = threading.Lock()

    def request(self, request: ProviderRequest) -> ProviderResult:
        if request.action not in self.supports:
            return ask_a_human(self.name, request, f"{self.name} cannot {request.action}; do it by hand")
        api = self._api_client()
        with api_errors(f"get node {request.node}"):
            node = client.CoreV1Api(api).read_node(request.node, _request_timeout=self.timeout)
        return self.replace(api, node, request)

    def replace(self, api: ApiClient, node: client.V1Node, request: ProviderRequest) -> ProviderResult:
        raise NotImplementedError

    # --- following the replacement ---------------------------------------------------------------

    def members(self, api: ApiClient, group: str) -> list[dict[str, Any]]:
        """The objects of a replacement's group (a MachineSet's Machines, a NodePool's claims)."""
        raise NotImplementedError

    def members_of(self, group: str) -> list[dict[str, Any]]:
        """`members` with the provider's own client: one list that every search of the group shares
        (activities/providers/__init__.py)."""
        return self.members(self._api_client(), group)

    def node_of(self, obj: dict[str, Any]) -> str | None:
        raise NotImplementedError

    def find_replacement(self, follow: Follow) -> Replacement:
        return self.found_in(self.members_of(follow.group), follow)

    def found_in(self, members: list[dict[str, Any]], follow: Follow) -> Replacement:
        """One look for `follow`'s replacement among its group's members (a list that started at
        most a second before the look): the new object it claimed, or the oldest new one nobody has
        claimed (claimed now)."""
        kind = self.plural.rstrip("s")
        mine = [o for o in members if follow.old_node in (_annotations(o).get(REPLACES_ANNOTATION),
                                                          self._claims.get(_key(o)))]
        if not mine:
            fresh = sorted((o for o in members if _is_new(o, follow) and self._claims.get(
                                _key(o), follow.old_node) == follow.old_node),
                           key=lambda o: (o["metadata"]["creationTimestamp"], o["metadata"]["name"]))
            claimed = next((o for o in fresh if self._claim(o, follow)), None)
            if claimed is None:
                return Replacement(detail=f"no new {kind} in {follow.group} yet")
            mine = [claimed]
        obj = mine[0]
        name = obj["metadata"]["name"]
        node = self.node_of(obj)
        if node is None:
            return Replacement(detail=f"{kind} {name} has no node yet")
        return Replacement(node=node, detail=f"{kind} {name} → node {node}")

    def _claim(self, obj: dict[str, Any], follow: Follow) -> bool:
        """Annotate `obj` as `follow`'s replacement, unless another search here has it: held for this
        search while its write is on the way, so the searches sharing a list never race for one
        object on this worker (another worker's claim is a conflict, as before)."""
        meta, key = obj["metadata"], _key(obj)
        with self._claims_lock:
            if self._claims.get(key, follow.old_node) != follow.old_node:
                return False
            self._claims[key] = follow.old_node
            while len(self._claims) > CLAIMS_KEPT:
                del self._claims[next(iter(self._claims))]
        patch = {"metadata": {"resourceVersion": meta["resourceVersion"],
                              "annotations": {REPLACES_ANNOTATION: follow.old_node}}}
        custom = client.CustomObjectsApi(self._api_client())
        try:
            if meta.get("namespace"):
                custom.patch_namespaced_custom_object(self.group, self.version, meta["namespace"], self.plural,
                                                      meta["name"], patch, _request_timeout=self.timeout)
            else:
                custom.patch_cluster_custom_object(self.group, self.version, self.plural, meta["name"], patch,
                                                   _request_timeout=self.timeout)
        except ApiException as exc:
            self._unclaim(key, follow)
            if exc.status in (404, 409):
                return False  # gone, or another run claimed it first: look at the next one
            with api_errors(f"claim {meta['name']}"):
                raise
        except BaseException:
            self._unclaim(key, follow)  # a write that may have gone through: the next list says
            raise
        return True

    def _unclaim(self, key: str, follow: Follow) -> None:
        with self._claims_lock:
            if self._claims.get(key) == follow.old_node:
                del self._claims[key]


def _key(obj: dict[str, Any]) -> str:
    meta = obj["metadata"]
    return str(meta.get("uid") or f"{meta.get('namespace', '')}/{meta['name']}")


def _annotations(obj: dict[str, Any]) -> dict[str, str]:
    return obj["metadata"].get("annotations") or {}


def _is_new(obj: dict[str, Any], follow: Follow) -> bool:
    """Created since the request (second precision, as the API gives it), not being deleted, and
    nobody's replacement yet."""
    meta = obj["metadata"]
    if meta["name"] == follow.reference.rpartition("/")[2] or meta.get("deletionTimestamp"):
        return False
    if REPLACES_ANNOTATION in _annotations(obj):
        return False
    if follow.since is None:
        return True
    created = datetime.fromisoformat(meta["creationTimestamp"].replace("Z", "+00:00"))
    return created >= follow.since.replace(microsecond=0)
