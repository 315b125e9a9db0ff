"""A stand-in for SchedMD's slurm-operator (Slinky), on the real control plane and a real Slurm.

slurm-operator is not served by the Go module proxy, so it cannot run here; this plays the part
FleetMedic meets, each behaviour from the operator's published documentation
(slinky.schedmd.com/slurm-operator/v1.1.0):

- **NodeSet pods** (concepts/nodeset-controller; the NodeSet API, `slinky.slurm.net/v1beta1`): a
  NodeSet owns its slurmd pods directly (no StatefulSet between), named `<nodeset>-<ordinal>`,
  labelled `app.kubernetes.io/name=slurmd`, `app.kubernetes.io/instance=<nodeset>`,
  `app.kubernetes.io/component=worker`. With `scalingMode: DaemonSet` there is one pod per node
  that the template's `nodeSelector` selects, a new node getting the lowest free ordinal; the pod
  is bound to its node (a DaemonSet's pods tolerate a cordon, so a replacement held cordoned
  still gets its slurmd).
- **slurmd registers as the Slurm node named after the pod** (the pod's hostname): a real slurmd
  per pod, started once the pod runs on a Ready node and stopped when the pod goes or its machine
  is switched off (the node NotReady). Slinky's slurmd registers as a dynamic node (`slurmd -Z`);
  here every slurmd shares one host, so each needs a port of its own, which `slurmd -Z --conf`
  refuses, and slurmctld 22.05 never delivered a batch job's launch to a dynamic slurmd on a port
  of its own (tried: `scontrol create … port=`, a SlurmdPort per slurmd). So the cluster's
  slurm.conf lists the names the NodeSet's pods take (`<nodeset>-<ordinal>`, LocalSlurmCluster's
  spare nodes, each with its port) and the pod's slurmd starts under its pod's name: to FleetMedic
  the same, a Slurm node that appears, named after a pod, when that pod's slurmd starts.
- **Cordon → drain, one way** (concepts/nodeset-controller, "Drain and Cordon Design";
  usage/nodeset-operations): a cordoned Kubernetes node, or a pod annotated
  `nodeset.slinky.slurm.net/pod-cordon=true`, drains its Slurm node with a reason prefixed
  `slurm-operator:` (the node's `nodeset.slinky.slurm.net/node-cordon-reason` annotation, if set),
  unless the node already has the DRAIN flag; when neither holds any more it undrains the node,
  only where the reason is its own. A reason without the prefix is never modified or cleared.
  It never cordons anything itself.
- A pod whose node is gone is deleted (the controller-manager's pod GC does it, after 40 s).

What FleetMedic does not read is left out: the pod conditions (`SlurmNodeState…`) the operator
projects, scale-in by replicas, the Slurm REST API (this talks to slurmctld with scontrol).
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from activities.slurm import node_from_scontrol
from devstack.controllers import every

if TYPE_CHECKING:
    from devstack.kube_world import RealKube
    from devstack.slurm_cluster import LocalSlurmCluster

log = logging.getLogger(__name__)

API_VERSION = "slinky.slurm.net/v1beta1"
POD_CORDON = "nodeset.slinky.slurm.net/pod-cordon"
NODE_CORDON_REASON = "nodeset.slinky.slurm.net/node-cordon-reason"
PREFIX = "slurm-operator:"


def nodeset(name: str, *, namespace: str = "slurm", node_selector: dict[str, str] | None = None) -> dict[str, Any]:
    """A NodeSet in DaemonSet mode: a slurmd pod on every node `node_selector` selects."""
    return {"apiVersion": API_VERSION, "kind": "NodeSet", "metadata": {"name": name, "namespace": namespace},
            "spec": {"scalingMode": "DaemonSet", "template": {"spec": {"nodeSelector": dict(node_selector or {})}}}}


@dataclass
class OperatorLog:
    """What the operator did, for tests to tell its writes from FleetMedic's."""

    created: list[str] = field(default_factory=list)  # pod names
    drained: list[tuple[str, str]] = field(default_factory=list)  # (Slurm node, reason)
    undrained: list[str] = field(default_factory=list)


class SlinkyOperator:
    def __init__(self, kube: RealKube, slurm: LocalSlurmCluster, namespace: str = "slurm") -> None:
        self.kube, self.slurm, self.namespace = kube, slurm, namespace
        self.log = OperatorLog()
        self.running: set[str] = set()  # pods whose slurmd we started
        self._lock = threading.Lock()

    # --- one pass ------------------------------------------------------------------------------

    def reconcile(self) -> None:
        with self._lock:
            nodes = {n["metadata"]["name"]: n for n in self.kube.list("v1", "Node")}
            pods = self._slurmd_pods()
            for ns in self.kube.list(API_VERSION, "NodeSet", self.namespace):
                self._pods_for(ns, nodes, [p for p in pods if _owner(p) == ns["metadata"]["name"]])
            pods = self._slurmd_pods()  # as the pass above left them
            self._slurmds(pods, nodes)
            self._sync_cordons(pods, nodes)

    def _slurmd_pods(self) -> list[dict[str, Any]]:
        return [p for p in self.kube.list("v1", "Pod", self.namespace)
                if (p["metadata"].get("labels") or {}).get("app.kubernetes.io/name") == "slurmd"]

    def _pods_for(self, ns: dict[str, Any], nodes: dict[str, dict[str, Any]], pods: list[dict[str, Any]]) -> None:
        name = ns["metadata"]["name"]
        selector = ((ns["spec"].get("template") or {}).get("spec") or {}).get("nodeSelector") or {}
        for pod in pods:
            if pod["spec"].get("nodeName") not in nodes:  # its machine is gone: as the pod GC would
                self.kube.remove("v1", "Pod", pod["metadata"]["name"], self.namespace)
        served = {p["spec"].get("nodeName") for p in pods}
        taken = {int(m.group(1)) for p in pods if (m := re.fullmatch(rf"{re.escape(name)}-(\d+)",
                                                                       p["metadata"]["name"]))}
        for node_name in sorted(nodes):
            labels = nodes[node_name]["metadata"].get("labels") or {}
            if node_name in served or any(labels.get(k) != v for k, v in selector.items()):
                continue
            ordinal = next(i for i in range(len(taken) + 1) if i not in taken)
            taken.add(ordinal)
            pod_name = f"{name}-{ordinal}"
            self.kube.put(_pod(pod_name, self.namespace, node_name, ns))
            self.log.created.append(pod_name)

    def _slurmds(self, pods: list[dict[str, Any]], nodes: dict[str, dict[str, Any]]) -> None:
        up = set()
        for pod in pods:
            node = nodes.get(pod["spec"].get("nodeName", ""))
            if node is not None and _ready(node) and not pod["metadata"].get("deletionTimestamp"):
                up.add(_slurm_name(pod))
        for name in sorted(up - self.running):
            self.slurm.boot(name)
        for name in sorted(self.running - up):
            self.slurm.stop_slurmd(name)
        self.running = up

    def _sync_cordons(self, pods: list[dict[str, Any]], nodes: dict[str, dict[str, Any]]) -> None:
        states = self._slurm_nodes()
        for pod in pods:
            name = _slurm_name(pod)
            node = nodes.get(pod["spec"].get("nodeName", ""))
            if name not in states or node is None:
                continue
            flags, reason = states[name]
            cordoned = bool(node["spec"].get("unschedulable"))
            pod_cordoned = (pod["metadata"].get("annotations") or {}).get(POD_CORDON) == "true"
            if cordoned or pod_cordoned:
                if "DRAIN" not in flags:
                    why = ((node["metadata"].get("annotations") or {}).get(NODE_CORDON_REASON)
                           or ("Kubernetes node cordoned" if cordoned else "pod cordoned"))
                    text = f"{PREFIX} {why}"
                    if self._scontrol("update", f"nodename={name}", "state=DRAIN", f"reason={text}"):
                        self.log.drained.append((name, text))
            elif "DRAIN" in flags and reason.startswith(PREFIX):
                if self._scontrol("update", f"nodename={name}", "state=UNDRAIN"):
                    self.log.undrained.append(name)

    def _slurm_nodes(self) -> dict[str, tuple[set[str], str]]:
        done = self.slurm.run("scontrol", "show", "node", "-o", check=False, timeout=10)
        nodes = (node_from_scontrol(line) for line in done.stdout.splitlines() if line.startswith("NodeName="))
        return {node.name: (set(node.flags), node.reason) for node in nodes}

    def _scontrol(self, *args: str) -> bool:
        done = self.slurm.run("scontrol", *args, check=False, timeout=10)
        if done.returncode != 0:
            log.warning("slinky stand-in: scontrol %s: %s", " ".join(args), done.stderr.strip())
        return done.returncode == 0

    def stop(self) -> None:
        with self._lock:
            for name in sorted(self.running):
                self.slurm.stop_slurmd(name)
            self.running.clear()


def _owner(pod: dict[str, Any]) -> str:
    return next((o["name"] for o in pod["metadata"].get("ownerReferences") or [] if o.get("kind") == "NodeSet"), "")


def _slurm_name(pod: dict[str, Any]) -> str:
    return str(pod["spec"].get("hostname") or pod["metadata"]["name"])


def _ready(node: dict[str, Any]) -> bool:
    conditions = (node.get("status") or {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def _pod(name: str, namespace: str, node: str, ns: dict[str, Any]) -> dict[str, Any]:
    owner = ns["metadata"]["name"]
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace,
                     "labels": {"app.kubernetes.io/name": "slurmd", "app.kubernetes.io/instance": owner,
                                "app.kubernetes.io/component": "worker"},
                     "ownerReferences": [{"apiVersion": API_VERSION, "kind": "NodeSet", "name": owner,
                                          "uid": ns["metadata"]["uid"], "controller": True}]},
        "spec": {"nodeName": node, "hostname": name,
                 "tolerations": [{"operator": "Exists"}],
                 "containers": [{"name": "slurmd", "image": "ghcr.io/slinkyproject/slurmd:25.05"}]},
        "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]},
    }


@contextmanager
def slinky_operator(kube: RealKube, slurm: LocalSlurmCluster, namespace: str = "slurm",
                    interval_s: float = 0.3) -> Iterator[SlinkyOperator]:
    """The operator, reconciling every `interval_s` until the block ends (its slurmds then stop)."""
    kube.ensure_namespace(namespace)
    operator = SlinkyOperator(kube, slurm, namespace)

    def step() -> None:
        try:
            operator.reconcile()
        except Exception as exc:  # a pass that fails is tried again, as a controller's would be
            log.warning("slinky stand-in: %s", exc)

    try:
        with every(interval_s, step, "slinky-operator"):
            yield operator
    finally:
        operator.stop()
