"""Which Slurm node a Kubernetes node is, and back (policy `slurm.mapping`).

Runbooks name nodes as Kubernetes does; the Slurm activities translate at their edge, so the
workflows read the same in both mappings:

- `same-name`: the Slurm node of Kubernetes node N is N (a slurm.conf that lists the hosts, or
  dynamic nodes registering under the host's name).
- `slinky`: SchedMD's slurm-operator runs slurmd in the pods of a NodeSet (one per Kubernetes
  node, or by replicas), and the Slurm node is named after the pod (its hostname: the pod's name
  unless `spec.hostname` says otherwise). The Slurm node of N is that of the NodeSet pod bound to
  N; a node without one has no Slurm side, and the activities say so in the run's record. A
  replacement node gets a new pod, under the same or a new name: the next lookup finds it.

One list of the slurmd pods answers every lookup made at the same time (activities/shared_reads):
50 nodes failing together cost two lists, not fifty, and each answer is as fresh as its caller's
own read would have been.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from activities.shared_reads import SharedReads
from fleetmedic.policy import SlinkyPolicy

# slurm-operator prefixes every drain reason it sets with this; a reason without it is not its own
# (slinky.schedmd.com/slurm-operator: concepts/nodeset-controller, "Drain and Cordon Design").
OPERATOR_PREFIX = "slurm-operator:"
NODESET_KIND = "NodeSet"
NODESET_GROUP = "slinky.slurm.net"


class SlurmNames(Protocol):
    mapping: str

    def slurm_node(self, node: str) -> str | None:
        """The Slurm node of Kubernetes node `node`; None: it has none."""
        ...

    def kube_nodes(self, slurm: Collection[str]) -> dict[str, str]:
        """Slurm node → the Kubernetes node it runs on (the Slurm name itself when none is known),
        from one read."""
        ...

    def missing(self, node: str) -> str:
        """Why `node` has no Slurm side, for the run's record."""
        ...


class SameName:
    mapping = "same-name"

    def slurm_node(self, node: str) -> str | None:
        return node

    def kube_nodes(self, slurm: Collection[str]) -> dict[str, str]:
        return {n: n for n in slurm}

    def missing(self, node: str) -> str:
        return f"Slurm has no node {node}"


@dataclass(frozen=True)
class SlurmdPod:
    name: str
    slurm: str  # the Slurm node it registers as
    node: str  # the Kubernetes node it is bound to
    terminating: bool


def slurmd_pods(items: list[dict[str, Any]], nodesets: Collection[str] = ()) -> list[SlurmdPod]:
    """The NodeSet pods of a pod list (plain JSON) that are bound to a node and not finished."""
    found = []
    for pod in items:
        meta, spec, status = pod.get("metadata") or {}, pod.get("spec") or {}, pod.get("status") or {}
        owner = next((o for o in meta.get("ownerReferences") or [] if o.get("kind") == NODESET_KIND
                      and str(o.get("apiVersion", "")).startswith(NODESET_GROUP + "/")), None)
        if owner is None or (nodesets and owner.get("name") not in nodesets):
            continue
        if not spec.get("nodeName") or status.get("phase") in ("Succeeded", "Failed"):
            continue
        found.append(SlurmdPod(name=meta["name"], slurm=spec.get("hostname") or meta["name"], node=spec["nodeName"],
                               terminating=bool(meta.get("deletionTimestamp"))))
    return found


class SlinkyNames:
    mapping = "slinky"

    def __init__(self, policy: SlinkyPolicy, list_pods: Callable[[str, str], list[dict[str, Any]]]) -> None:
        """`list_pods(namespace, label_selector)`: the pods, as plain JSON (it raises on failure)."""
        self.policy = policy
        self.list_pods = list_pods
        self.shared: SharedReads[None, list[SlurmdPod]] = SharedReads(self._read)

    def _read(self, _: Collection[None]) -> Mapping[None, list[SlurmdPod]]:
        items = self.list_pods(self.policy.namespace, self.policy.selector)
        return {None: slurmd_pods(items, self.policy.nodesets)}

    def pods(self) -> list[SlurmdPod]:
        return self.shared.get(None) or []

    def pod_on(self, node: str) -> SlurmdPod | None:
        """The slurmd pod bound to `node`: one that is not being deleted, if there is one."""
        pods = sorted((p for p in self.pods() if p.node == node), key=lambda p: (p.terminating, p.name))
        return pods[0] if pods else None

    def slurm_node(self, node: str) -> str | None:
        pod = self.pod_on(node)
        return pod.slurm if pod is not None else None

    def kube_nodes(self, slurm: Collection[str]) -> dict[str, str]:
        where: dict[str, str] = {}
        for pod in sorted(self.pods(), key=lambda p: not p.terminating):  # a live pod's answer last, so it wins
            where[pod.slurm] = pod.node
        return {n: where.get(n, n) for n in slurm}

    def missing(self, node: str) -> str:
        where = f"NodeSet(s) {', '.join(self.policy.nodesets)}" if self.policy.nodesets else "any NodeSet"
        return (f"no slurmd pod of {where} in namespace {self.policy.namespace} ({self.policy.selector}) on "
                f"Kubernetes node {node}: it has no Slurm side")
