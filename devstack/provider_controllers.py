"""Node providers as they really behave, on the real control plane, for tests and `fleetmedic dev`.

A replacement is a new machine with a new name, never the old one coming back:

- Cluster API: a deleted Machine (finalizer `machine.cluster.x-k8s.io`) loses its Node and goes
  after `delay_s`; its MachineSet creates a new Machine (a new name, owned by the set), whose Node
  joins `delay_s` later and is written into the Machine's `status.nodeRef`.
- Karpenter: a deleted NodeClaim (finalizer `karpenter.sh/termination`) loses its Node and goes;
  a new NodeClaim of the same NodePool is made, its Node joins, `status.nodeName` says which.
- the `http` provider's stand-in: the old machine is switched off (its Node stays, NotReady: an
  http provider knows nothing of Kubernetes objects), a new Node joins, and the request's
  `GET /v1/requests/{id}` names it.

`names` are the new nodes' names, in order; `boot(name)` is called `slurmd_delay_s` after a new
Node joined (the host's slurmd starting, as a Slinky pod on the node would); `replace=False`
plays a provider that takes the old machine away and never delivers.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

from kubernetes import client

from devstack import fleet
from devstack.controllers import every, set_ready
from devstack.standins import ProviderStandIn

if TYPE_CHECKING:
    from devstack.kube_world import RealKube

log = logging.getLogger(__name__)


@dataclass
class Replacing:
    """What a controller did, for tests to read: old machine → new machine → new node."""

    removed: list[str] = field(default_factory=list)
    created: list[str] = field(default_factory=list)
    joined: list[str] = field(default_factory=list)
    booted: list[str] = field(default_factory=list)


class _Controller:
    group = version = plural = finalizer = ""
    namespaced = True

    def __init__(self, kube: RealKube, names: list[str], *, delay_s: float, slurmd_delay_s: float,
                 boot: Callable[[str], None] | None, replace: bool, namespace: str) -> None:
        self.kube, self.names = kube, list(names)
        self.delay_s, self.slurmd_delay_s, self.boot, self.replace = delay_s, slurmd_delay_s, boot, replace
        self.namespace = namespace
        self.custom = client.CustomObjectsApi(kube.api)
        self.core = client.CoreV1Api(kube.api)
        self.done = Replacing()
        self._due: list[tuple[float, Callable[[], None]]] = []
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    # --- the API, namespaced or not ------------------------------------------------------------

    def _list(self) -> list[dict[str, Any]]:
        if self.namespaced:
            found = self.custom.list_namespaced_custom_object(self.group, self.version, self.namespace, self.plural)
        else:
            found = self.custom.list_cluster_custom_object(self.group, self.version, self.plural)
        return list(found.get("items", []))

    def _patch(self, name: str, body: dict[str, Any], status: bool = False) -> None:
        if self.namespaced:
            fn = (self.custom.patch_namespaced_custom_object_status if status
                  else self.custom.patch_namespaced_custom_object)
            fn(self.group, self.version, self.namespace, self.plural, name, body)
        else:
            fn2 = self.custom.patch_cluster_custom_object_status if status else self.custom.patch_cluster_custom_object
            fn2(self.group, self.version, self.plural, name, body)

    def _create(self, obj: dict[str, Any]) -> dict[str, Any]:
        if self.namespaced:
            made: dict[str, Any] = self.custom.create_namespaced_custom_object(
                self.group, self.version, self.namespace, self.plural, obj)
        else:
            made = self.custom.create_cluster_custom_object(self.group, self.version, self.plural, obj)
        return made

    # --- what the real controllers do ------------------------------------------------------------

    def node_of(self, obj: dict[str, Any]) -> str | None:
        raise NotImplementedError

    def new_object(self, old: dict[str, Any]) -> dict[str, Any]:
        raise NotImplementedError

    def node_status(self, node: str) -> dict[str, Any]:
        raise NotImplementedError

    def node_for(self, old_node: dict[str, Any] | None, obj: dict[str, Any], name: str) -> dict[str, Any]:
        """The new Node, labelled and annotated as the provider does."""
        raise NotImplementedError

    def step(self) -> None:
        now = time.monotonic()
        with self._lock:
            due, self._due = [d for d in self._due if d[0] <= now], [d for d in self._due if d[0] > now]
        for _, action in due:
            try:
                action()
            except Exception:  # one object's failure must not stop the controller (nor hide it)
                log.exception("%s: a step failed", type(self).__name__)
        for obj in self._list():
            name = obj["metadata"]["name"]
            # Only what it manages: a finalizer of its own (what another test left is not its business).
            if (obj["metadata"].get("deletionTimestamp") and self.finalizer in (obj["metadata"].get("finalizers") or [])
                    and name not in self._seen):
                self._seen.add(name)
                self.later(self.delay_s, partial(self.finish_deletion, obj))

    def later(self, delay_s: float, action: Callable[[], None]) -> None:
        with self._lock:
            self._due.append((time.monotonic() + delay_s, action))

    def finish_deletion(self, obj: dict[str, Any]) -> None:
        """The old machine is gone: its Node with it, then the finalizer; the replacement is made."""
        node = self.node_of(obj)
        old_node = self.kube.get("v1", "Node", node) if node else None
        if node:
            self.kube.remove("v1", "Node", node)
        self._patch(obj["metadata"]["name"], {"metadata": {"finalizers": None}})
        self.done.removed.append(obj["metadata"]["name"])
        if not self.replace or not self.names:
            return
        made = self._create(self.new_object(obj))
        self.done.created.append(made["metadata"]["name"])
        name = self.names.pop(0)
        self.later(self.delay_s, lambda: self.join(old_node, made, name))

    def join(self, old_node: dict[str, Any] | None, obj: dict[str, Any], name: str) -> None:
        self.kube.put(self.node_for(old_node, obj, name))
        self._patch(obj["metadata"]["name"], {"status": self.node_status(name)}, status=True)
        self.done.joined.append(name)
        if self.boot is not None:
            self.later(self.slurmd_delay_s, lambda: self._boot(name))

    def _boot(self, name: str) -> None:
        assert self.boot is not None
        self.boot(name)
        self.done.booted.append(name)


def _labels_of(old_node: dict[str, Any] | None) -> dict[str, str]:
    """The new node's labels: the old one's, less its hostname (a new machine has its own)."""
    labels = dict(((old_node or {}).get("metadata") or {}).get("labels") or {})
    labels.pop("kubernetes.io/hostname", None)
    return labels


class ClusterApiController(_Controller):
    group, version, plural, finalizer = "cluster.x-k8s.io", "v1beta2", "machines", "machine.cluster.x-k8s.io"

    def node_of(self, obj: dict[str, Any]) -> str | None:
        return ((obj.get("status") or {}).get("nodeRef") or {}).get("name")

    def new_object(self, old: dict[str, Any]) -> dict[str, Any]:
        set_name = old["metadata"]["labels"]["cluster.x-k8s.io/set-name"]
        owner = self.custom.get_namespaced_custom_object(self.group, self.version, self.namespace, "machinesets",
                                                         set_name)
        made = fleet.machine(f"{set_name}-{secrets.token_hex(3)}", namespace=self.namespace,
                             cluster=old["spec"]["clusterName"], machine_set=owner, finalizer=True)
        made.pop("status", None)
        return made

    def node_status(self, node: str) -> dict[str, Any]:
        return {"nodeRef": {"name": node}}  # v1beta2: a MachineNodeReference

    def node_for(self, old_node: dict[str, Any] | None, obj: dict[str, Any], name: str) -> dict[str, Any]:
        meta = obj["metadata"]
        return fleet.node(name, labels=_labels_of(old_node), annotations={
            "cluster.x-k8s.io/machine": meta["name"], "cluster.x-k8s.io/cluster-namespace": meta["namespace"],
            "cluster.x-k8s.io/cluster-name": obj["spec"]["clusterName"],
            "cluster.x-k8s.io/owner-kind": "MachineSet",
            "cluster.x-k8s.io/owner-name": meta["labels"]["cluster.x-k8s.io/set-name"]})


class KarpenterController(_Controller):
    group, version, plural, finalizer = "karpenter.sh", "v1", "nodeclaims", "karpenter.sh/termination"
    namespaced = False

    def node_of(self, obj: dict[str, Any]) -> str | None:
        return (obj.get("status") or {}).get("nodeName")

    def new_object(self, old: dict[str, Any]) -> dict[str, Any]:
        pool = old["metadata"]["labels"]["karpenter.sh/nodepool"]
        return fleet.nodeclaim(f"{pool}-{secrets.token_hex(3)}", nodepool=pool, finalizer=True)

    def node_status(self, node: str) -> dict[str, Any]:
        return {"nodeName": node, "providerID": f"emulated://{node}"}

    def node_for(self, old_node: dict[str, Any] | None, obj: dict[str, Any], name: str) -> dict[str, Any]:
        return fleet.node(name, labels={**_labels_of(old_node),
                                        "karpenter.sh/nodepool": obj["metadata"]["labels"]["karpenter.sh/nodepool"]})


@contextmanager
def cluster_api_controller(kube: RealKube, names: list[str], *, namespace: str = "default", delay_s: float = 1.0,
                           slurmd_delay_s: float = 6.0, boot: Callable[[str], None] | None = None,
                           replace: bool = True) -> Iterator[Replacing]:
    controller = ClusterApiController(kube, names, delay_s=delay_s, slurmd_delay_s=slurmd_delay_s, boot=boot,
                                      replace=replace, namespace=namespace)
    with every(0.2, controller.step, "cluster-api-controller"):
        yield controller.done


@contextmanager
def karpenter_controller(kube: RealKube, names: list[str], *, delay_s: float = 1.0, slurmd_delay_s: float = 6.0,
                         boot: Callable[[str], None] | None = None, replace: bool = True) -> Iterator[Replacing]:
    controller = KarpenterController(kube, names, delay_s=delay_s, slurmd_delay_s=slurmd_delay_s, boot=boot,
                                     replace=replace, namespace="")
    with every(0.2, controller.step, "karpenter-controller"):
        yield controller.done


@contextmanager
def http_replacing_controller(kube: RealKube, provider: ProviderStandIn, names: list[str], *,
                              delay_s: float = 1.0, slurmd_delay_s: float = 6.0,
                              boot: Callable[[str], None] | None = None, replace: bool = True) -> Iterator[Replacing]:
    """The http provider bringing new machines: its answers say `replacement: new`; the old machine
    goes NotReady and its Node stays; the new Node joins and the request's GET names it."""
    done = Replacing()
    provider.replacement = "new"
    handled: set[str] = set()
    pending: list[tuple[float, Callable[[], None]]] = []

    def join(record_id: str, old: str, name: str) -> None:
        old_node = kube.get("v1", "Node", old)
        kube.put(fleet.node(name, labels=_labels_of(old_node)))
        provider.complete(record_id, node=name)
        done.joined.append(name)
        if boot is not None:
            pending.append((time.monotonic() + slurmd_delay_s, partial(booted, name)))

    def booted(name: str) -> None:
        assert boot is not None
        boot(name)
        done.booted.append(name)

    def step() -> None:
        now = time.monotonic()
        for item in [p for p in pending if p[0] <= now]:
            pending.remove(item)
            item[1]()
        for record in provider.records():
            if record.id in handled or record.body["action"] != "replace":
                continue
            handled.add(record.id)
            old = record.body["node"]
            try:
                set_ready(kube, old, False)  # the old machine is switched off; its Node object stays
            except KeyError:
                pass
            done.removed.append(old)
            if replace and names:
                name = names.pop(0)
                pending.append((now + delay_s, partial(join, record.id, old, name)))

    try:
        with every(0.2, step, "http-provider-controller"):
            yield done
    finally:
        provider.replacement = "same"
