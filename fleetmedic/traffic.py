"""Traffic runbooks, the pure part: what traffic-flip and migrate-back read and decide.

One cluster runs training and production inference; training always wins. When admitted
training leaves inference short of in-cluster GPUs, traffic-flip opens the virtual-kubelet node(s)
(removes the overflow taint) so inference spills to external GPU providers; when the GPUs are
free again, migrate-back closes them (NoSchedule, never NoExecute) and brings pods home in
batches without ever dropping below each Deployment's minimum of ready replicas.
"""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict, Field

from fleetmedic.models import Alert


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True)


class TrafficInput(_Model):
    """Starts traffic-flip/<cluster> or migrate-back/<cluster> (the webhook sends the node
    runbooks' shape; the node fields are ignored)."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    cluster: str = Field(min_length=1)
    dry_run: bool = False
    requested_by: str = "alertmanager"
    alert: Alert | None = None


class InferenceDeployment(_Model):
    namespace: str
    name: str
    replicas: int
    ready: int  # ready pods selected by the Deployment, wherever they run
    ready_in_cluster: int = 0
    gpus_per_pod: int = 0
    # Why FleetMedic must leave it alone (its own or its namespace's opt-out label), "" when it may act.
    opted_out: str = ""

    @property
    def ref(self) -> str:
        return f"{self.namespace}/{self.name}"


class InferencePod(_Model):
    namespace: str
    name: str
    node: str = ""
    on_virtual: bool = False
    ready: bool = False
    gpus: int = 0
    deployment: str = ""  # namespace/name of the owning Deployment, when known

    @property
    def ref(self) -> str:
        return f"{self.namespace}/{self.name}"


class TrainingWorkload(_Model):
    namespace: str
    name: str
    priority: int
    gpus: int  # admitted: what Kueue assigned; pending: what it asks for
    uid: str = ""
    # False: pending, and it would fit if inference left (Kueue preempting inference for it, or
    # inference outside Kueue holding the GPUs).
    admitted: bool = True

    @property
    def ref(self) -> str:
        return f"{self.namespace}/{self.name}" + ("" if self.admitted else " (pending)")


class TrafficSnapshot(_Model):
    virtual_nodes: list[str] = Field(default_factory=list)
    virtual_open: list[str] = Field(default_factory=list)  # virtual nodes without the overflow taint
    virtual_gpus: int = 0  # what the external providers offer right now
    cluster_gpus: int = 0  # allocatable GPUs of Ready, schedulable in-cluster GPU nodes
    used_gpus: int = 0  # GPUs requested by running pods on those nodes
    deployments: list[InferenceDeployment] = Field(default_factory=list)
    pods: list[InferencePod] = Field(default_factory=list)
    # At or above the priority: admitted, or pending and it would fit without inference.
    training: list[TrainingWorkload] = Field(default_factory=list)

    @property
    def free_gpus(self) -> int:
        return max(0, self.cluster_gpus - self.used_gpus)

    @property
    def training_gpus(self) -> int:
        return sum(w.gpus for w in self.training)

    @property
    def inference_gpus(self) -> int:
        """GPUs all inference replicas need."""
        return sum(d.replicas * d.gpus_per_pod for d in self.deployments)

    @property
    def on_virtual(self) -> list[InferencePod]:
        return [p for p in self.pods if p.on_virtual]

    def below_minimum(self, min_fraction: float) -> list[str]:
        return [f"{d.ref} {d.ready}/{minimum_ready(d.replicas, min_fraction)}" for d in self.deployments
                if d.ready < minimum_ready(d.replicas, min_fraction)]


def minimum_ready(replicas: int, fraction: float) -> int:
    return math.ceil(replicas * fraction)


def spread(pods: list[InferencePod]) -> list[InferencePod]:
    """Round-robin over Deployments: a batch takes a few replicas of each service rather than many of
    one, so no single service (or its PodDisruptionBudget) carries the whole batch."""
    by_deployment: dict[str, list[InferencePod]] = {}
    for pod in sorted(pods, key=lambda p: (p.deployment, p.name)):
        by_deployment.setdefault(pod.deployment, []).append(pod)
    queues = list(by_deployment.values())
    ordered: list[InferencePod] = []
    while any(queues):
        for queue in queues:
            if queue:
                ordered.append(queue.pop(0))
    return ordered


class Batch(_Model):
    pods: list[InferencePod] = Field(default_factory=list)  # to evict now
    waiting: int = 0  # pods away that must wait for headroom (a replacement still starting)
    left: list[str] = Field(default_factory=list)  # pods that stay away, and why


def next_batch(snapshot: TrafficSnapshot, size: int, min_fraction: float) -> Batch:
    """The next pods to bring home. Each Deployment gives at most its headroom (ready replicas above
    its minimum), so FleetMedic's own batching keeps the minimum whatever the PodDisruptionBudget
    allows; opted-out Deployments, and those whose minimum is every replica, stay where they are."""
    deployments = {d.ref: d for d in snapshot.deployments}
    room = {ref: d.ready - minimum_ready(d.replicas, min_fraction) for ref, d in deployments.items()}
    pods: list[InferencePod] = []
    left: list[str] = []
    waiting = 0
    for pod in spread(snapshot.on_virtual):
        deployment = deployments.get(pod.deployment)
        if deployment is not None and deployment.opted_out:
            left.append(f"{pod.ref} ({deployment.opted_out})")
        elif deployment is not None and minimum_ready(deployment.replicas, min_fraction) >= deployment.replicas:
            left.append(f"{pod.ref} ({deployment.ref} must keep every replica ready)")
        elif len(pods) >= size or deployment is not None and pod.ready and room[deployment.ref] <= 0:
            waiting += 1  # next batch, or its Deployment is at its minimum until a replacement is Ready
        else:
            if deployment is not None and pod.ready:
                room[deployment.ref] -= 1  # a pod that is not Ready serves nobody: moving it costs nothing
            pods.append(pod)
    return Batch(pods=pods, waiting=waiting, left=left)


def flip_needed(snapshot: TrafficSnapshot) -> tuple[bool, str]:
    """Training admitted and what is left of the cluster cannot hold inference."""
    if not snapshot.training:
        return False, "no training at or above the priority admitted, or pending behind inference"
    left = snapshot.cluster_gpus - snapshot.training_gpus
    need = snapshot.inference_gpus
    names = ", ".join(f"{w.ref} ({w.gpus} GPUs)" for w in snapshot.training)
    if left >= need:
        return False, f"training {names} leaves {left} GPUs, enough for inference's {need}"
    return True, f"training {names} leaves {left} of {snapshot.cluster_gpus} GPUs; inference needs {need}"


def home_free(snapshot: TrafficSnapshot) -> tuple[bool, str]:
    """GPUs free in-cluster for every inference pod now on a virtual node, and no training to take them."""
    away = snapshot.on_virtual
    need = sum(p.gpus for p in away)
    if snapshot.training:
        names = ", ".join(w.ref for w in snapshot.training)
        return False, f"training still holds or wants the GPUs: {names}"
    if snapshot.free_gpus < need:
        return False, f"{snapshot.free_gpus} GPUs free in-cluster, {len(away)} pod(s) away need {need}"
    return True, f"{snapshot.free_gpus} GPUs free in-cluster for {len(away)} pod(s) away ({need} GPUs)"


class EvictPods(_Model):
    pods: list[str]  # namespace/name
    deadline_s: float
    dry_run: bool = False


class WaitHome(_Model):
    """Until `in_cluster_ready` selected pods are Ready on in-cluster nodes (or `timeout_s`)."""

    in_cluster_ready: int
    min_fraction: float
    timeout_s: float


class HomeReport(_Model):
    done: bool
    in_cluster_ready: int
    min_ready_ratio: float  # the lowest ready/minimum seen while waiting (>= 1: never below)
    below_minimum: list[str] = Field(default_factory=list)  # at the end


class SloCheck(_Model):
    query: str
    max_value: float


class SloResult(_Model):
    available: bool
    passed: bool = True
    value: float | None = None
    detail: str = ""
