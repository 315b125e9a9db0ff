"""Typed contracts between the alert receiver, the workflows and the activities."""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True)


# --- alerts -------------------------------------------------------------------------------

class Alert(_Model):
    """One alert of an Alertmanager webhook (version 4)."""

    model_config = ConfigDict(frozen=True, populate_by_name=True)

    status: Literal["firing", "resolved"]
    labels: dict[str, str]
    annotations: dict[str, str] = Field(default_factory=dict)
    starts_at: datetime | None = Field(None, alias="startsAt")
    ends_at: datetime | None = Field(None, alias="endsAt")
    generator_url: str = Field("", alias="generatorURL")
    fingerprint: str = ""


# --- every mutation reports what it did, or would have done --------------------------------

class ActionResult(_Model):
    system: Literal["kubernetes", "slurm", "provider", "agent", "slack"]
    action: str  # a verb: cordon, evict, set-down, requeue, replace ...
    target: str
    changed: bool  # False: it was already so (idempotent no-op) or dry-run
    dry_run: bool = False
    detail: str = ""

    @property
    def summary(self) -> str:
        verb = f"would {self.action}" if self.dry_run else (self.action if self.changed else
                                                             f"{self.action} (already done)")
        return f"{verb} {self.target}" + (f": {self.detail}" if self.detail else "")


# --- Kubernetes ------------------------------------------------------------------------------

class Taint(_Model):
    key: str
    value: str = ""
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"]

    @classmethod
    def parse(cls, text: str) -> Taint:
        """`key=value:Effect` or `key:Effect`."""
        body, _, effect = text.rpartition(":")
        key, _, value = body.partition("=")
        return cls.model_validate({"key": key, "value": value, "effect": effect})

    def __str__(self) -> str:
        return f"{self.key}={self.value}:{self.effect}" if self.value else f"{self.key}:{self.effect}"


class NodeInfo(_Model):
    name: str
    uid: str = ""
    ready: bool
    # When the Ready condition last changed: a node that is Ready "since after our request"
    # really came back, whatever its name or uid.
    ready_since: datetime | None = None
    unschedulable: bool = False
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)
    taints: list[Taint] = Field(default_factory=list)
    gpu_allocatable: int = 0
    provider_id: str = ""


class PodInfo(_Model):
    namespace: str
    name: str
    uid: str = ""
    node: str = ""
    phase: str = ""
    ready: bool = False
    labels: dict[str, str] = Field(default_factory=dict)
    owner_kind: str = ""
    owner_name: str = ""
    mirror: bool = False  # a static pod: the kubelet owns it, eviction cannot remove it
    gpus: int = 0

    @property
    def ref(self) -> str:
        return f"{self.namespace}/{self.name}"


class OptOut(_Model):
    opted_out: bool
    reasons: list[str] = Field(default_factory=list)
    missing: bool = False  # the node does not exist (an alert for a node that is not in the cluster)


class ProtectRequest(_Model):
    """The protective step: one read of the node (its opt-out, its pods', its Slurm jobs), then, if
    nothing opts it out, cordon (or `taint`) and Slurm DRAIN together. Reversible, kills nothing."""

    node: str
    workflow_id: str
    reason: str
    taint: Taint | None = None
    slurm: bool = True
    dry_run: bool = False
    cluster: str = ""  # whose fleet guard's pause and cordon breaker apply ("": none, runs before 0.2)


class BreakerTrip(_Model):
    """What a protective step found when it reached the cordon breaker's bound."""

    out: int  # GPU nodes gone out of service within the window (this step's not counted)
    gpu_nodes: int
    bound: int
    reason: str


class BreakerState(BreakerTrip):
    """The fleet guard's tripped cordon breaker: it stays until a person resets it."""

    tripped_at: datetime
    by: str  # the run whose protective step tripped it
    held: int = 0  # protective steps held since it tripped (runs that asked for a lease held by it)


class Protection(_Model):
    """What the protective step read and did. `node` None: no such node (nothing was written).
    `held`: why nothing was written though the node is there (the cordon breaker, the fleet pause);
    `trip`: this step found the breaker's bound reached (the counts the guard records)."""

    node: NodeInfo | None = None
    opt_out: OptOut
    jobs: list[SlurmJob] | None = None  # None: Slurm not enabled on this worker
    actions: list[ActionResult] = Field(default_factory=list)
    held: str | None = None
    held_by: Literal["breaker", "pause"] | None = None
    trip: BreakerTrip | None = None


class EvictRequest(_Model):
    node: str
    deadline_s: float = Field(600, gt=0)
    dry_run: bool = False
    workflow_id: str = ""
    # Only pods matching this label selector (e.g. training pods); None = all pods.
    selector: str | None = None


class PodProblem(_Model):
    pod: str
    reason: str


class EvictionReport(_Model):
    node: str
    evicted: list[str] = Field(default_factory=list)
    skipped: list[PodProblem] = Field(default_factory=list)  # DaemonSet, mirror, not selected
    failed: list[PodProblem] = Field(default_factory=list)  # PDB until the deadline, errors
    dry_run: bool = False

    @property
    def complete(self) -> bool:
        return not self.failed


class NodeTarget(_Model):
    """A node-level mutation request: who asks (workflow ID), why, and whether for real."""

    node: str
    workflow_id: str
    reason: str = ""
    dry_run: bool = False
    # A cordon that takes the node out for a remediation counts toward the lemon rule; one that
    # holds a new replacement out until its burn-in passes does not (the machine is new).
    remediation: bool = True


class TaintRequest(_Model):
    node: str
    taint: Taint
    dry_run: bool = False
    # Set: the taint holds the node for this run, like a cordon (the workflow and reason
    # annotations are written with it and cleared with it; another run's node is refused).
    workflow_id: str = ""
    reason: str = ""


class EventRequest(_Model):
    kind: str = "Node"
    name: str
    namespace: str = "default"
    api_version: str = "v1"
    reason: str
    message: str
    type: Literal["Normal", "Warning"] = "Normal"
    dry_run: bool = False


class WaitNodeReady(_Model):
    """Watch one node until it is Ready with a Ready transition at or after `since`."""

    node: str
    since: datetime | None = None
    timeout_s: float = Field(60, gt=0)


# --- Slurm -------------------------------------------------------------------------------------

class SlurmNodeState(StrEnum):
    DOWN = "DOWN"
    DRAIN = "DRAIN"
    RESUME = "RESUME"


class SlurmNode(_Model):
    name: str
    state: str  # idle, allocated, mixed, down, drained, draining ... (lower case, as Slurm says)
    flags: list[str] = Field(default_factory=list)
    reason: str = ""

    @property
    def out_of_service(self) -> bool:
        return self.state in ("down", "drained", "draining") or any(
            f in ("DRAIN", "DOWN") for f in self.flags)


class SlurmJob(_Model):
    job_id: int
    name: str = ""
    state: str  # RUNNING, PENDING, COMPLETING, COMPLETED, CANCELLED, FAILED ...
    nodes: list[str] = Field(default_factory=list)
    restart_count: int = 0
    requeue: bool = True
    work_dir: str = ""
    state_reason: str = ""


class BurnIn(_Model):
    """Run the policy's burn-in job on `node` inside a maintenance reservation (only this job can
    land there), wait for its end, and leave the node as it was (DRAINed by the run)."""

    node: str
    run_id: str  # names the reservation and the job: a retried activity finds its own job again
    script: str
    deadline_s: float = Field(gt=0)
    output_dir: str
    pass_pattern: str = ""
    dry_run: bool = False


class BurnInResult(_Model):
    passed: bool
    job_id: int | None = None
    exit_code: int | None = None
    state: str = ""
    output: str = ""  # the end of what the job printed
    detail: str = ""


class SetSlurmNodeState(_Model):
    node: str
    state: SlurmNodeState
    reason: str = ""
    dry_run: bool = False


class RequeueJob(_Model):
    job_id: int
    dry_run: bool = False
    # The bad node: a job no longer on it (Slurm already requeued it and it runs elsewhere) is left alone.
    node: str = ""
    # The job was signalled by this run to checkpoint: if it then ended on its own (most training
    # jobs exit after their SIGTERM checkpoint), it is requeued from its finished state.
    signalled: bool = False


class SignalJob(_Model):
    """Ask a job to checkpoint: `scancel --signal=<signal> --full`, only while it runs on `node`."""

    job_id: int
    node: str
    signal: str = "TERM"
    dry_run: bool = False


# --- storage -------------------------------------------------------------------------------

class CheckpointQuery(_Model):
    job_id: int
    job_name: str = ""


class Checkpoint(_Model):
    path: str
    step: int | None
    modified: datetime
    # How the storage's rule judged it complete ("marker", "stable size"); older checkpoints said nothing.
    complete_by: str = ""


# --- providers -------------------------------------------------------------------------------

class ProviderRequest(_Model):
    cluster: str
    node: str
    action: Literal["replace", "reboot", "rma", "prewarm"]
    reason: str
    idempotency_key: str  # the workflow ID + action: a retried request is the same request
    dry_run: bool = False


class Follow(_Model):
    """How to find the node that replaces `old_node` when the provider gives a new machine: the
    provider's handle for the request and for the group the replacement appears in."""

    provider: str
    old_node: str
    reference: str  # the deleted Machine (namespace/name), NodeClaim, or the http request id
    group: str = ""  # the MachineSet (namespace/name) or NodePool the replacement joins
    # When the request was made: only what the group gained since can be the replacement.
    since: datetime | None = None


class ProviderResult(_Model):
    provider: str
    action: str
    accepted: bool
    reference: str = ""  # the provider's handle: a Machine name, a ticket, a request id
    detail: str = ""
    needs_human: bool = False  # the manual provider: a person must do it and signal `replaced`
    dry_run: bool = False
    # What the request yields: the same node (reboot, repair in place: both None), a new node
    # known at once (`new_node`), or a new node to be found (`follow`).
    new_node: str | None = None
    follow: Follow | None = None


class FindReplacement(_Model):
    """Look for the node that replaces `follow.old_node`, up to `timeout_s`."""

    follow: Follow
    timeout_s: float = Field(60, gt=0)


class Replacement(_Model):
    node: str | None = None  # None: nothing yet (or the provider gave the same node back)
    detail: str = ""
    failed: bool = False  # the provider says its request failed: no replacement will come


# --- notifications -----------------------------------------------------------------------------

class NotifyStart(_Model):
    workflow_id: str
    runbook: str
    node: str = ""
    text: str
    dry_run: bool = False


class NotifyStep(_Model):
    channel: str
    thread_ts: str
    text: str
    mention: str | None = None


class NotifyResult(_Model):
    delivered: bool
    channel: str = ""
    ts: str = ""
    error: str = ""


# --- node agent --------------------------------------------------------------------------------

class Validate(_Model):
    node: str
    since: datetime  # no XID after this instant
    expected_gpus: int | None = None


class ValidationCheck(_Model):
    name: str
    passed: bool
    value: str = ""


class Validation(_Model):
    available: bool  # False: no agent configured or reachable; the runbook records it skipped
    passed: bool = False
    checks: list[ValidationCheck] = Field(default_factory=list)
    detail: str = ""


class GpuReading(_Model):
    """One GPU as the node agent reads it now (`GET /v1/gpus`)."""

    gpu: int | None  # None: the alert did not say which GPU
    temperature_c: float | None = None
    # Degrees left before the driver slows the GPU down (NVML thermal margin), where it says.
    thermal_margin_c: float | None = None


class GpuReadings(_Model):
    available: bool  # False: no agent configured or reachable
    gpus: list[GpuReading] = Field(default_factory=list)
    detail: str = ""


class GpuResetRequest(_Model):
    node: str
    gpu: int
    dry_run: bool = False


# --- runbooks ----------------------------------------------------------------------------------

class NodeRunbookInput(_Model):
    """What starts a node runbook. Also the plain JSON the Temporal UI's Start Workflow form takes:
    {"cluster": "prod", "node": "gpu-node-3", "gpu": 3, "xid": 79}."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    cluster: str = Field(min_length=1)
    node: str = Field(min_length=1)
    gpu: int | None = Field(None, ge=0, le=63)
    xid: int | None = Field(None, ge=1)
    linked_xid: int | None = None
    temperature_c: float | None = None
    alert: Alert | None = None
    dry_run: bool = False
    requested_by: str = "alertmanager"



def missing_input(runbook: str, input: NodeRunbookInput) -> str | None:
    """What a node runbook cannot start without (the workflow ends `invalid-input` with it, and the
    CLI refuses before it starts a run)."""
    if runbook == "xid-recovery" and input.xid is None:
        return "xid-recovery needs the XID (--xid, or the alert's xid label)"
    return None

class Operator(_Model):
    by: str = Field(min_length=1)
    reason: str = ""


class EscalationAnswer(_Model):
    action: Literal["retry", "skip", "abort"]
    by: str = Field(min_length=1)
    reason: str = ""


class Replaced(_Model):
    """A person replaced (or repaired) the node; `new_node` when it came back under another name."""

    by: str = Field(min_length=1)
    new_node: str | None = None
    reason: str = ""


class Approval(_Model):
    """An operator's answer to an approval request (Update `approve` or `reject`)."""

    by: str = ""
    reason: str = ""


class Escalation(_Model):
    step: str
    error: str
    since: datetime
    answered_by: str | None = None
    answer: str | None = None


class StepRecord(_Model):
    step: str
    at: datetime
    result: str


class RunbookStatus(_Model):
    runbook: str
    workflow_id: str
    cluster: str
    node: str = ""
    step: str
    waiting_for: str | None = None
    dry_run: bool = False
    paused: Operator | None = None
    escalation: Escalation | None = None
    awaiting_approval: str | None = None  # the step that waits for `approve` / `reject`
    outcome: str | None = None
    decisions: list[StepRecord] = Field(default_factory=list)
    actions: list[str] = Field(default_factory=list)


class RunContext(_Model):
    """What a run learns once at its start (and keeps in its history): the policy snapshot and
    which systems this worker can reach."""

    policy_version: int = 1
    slurm_enabled: bool
    agent_configured: bool
    provider: str
    provider_supports: list[str] = Field(default_factory=list)
    # The task queue of long waits (a node coming back): async activities that hold no thread, with
    # slots of their own, so a thousand waiting runs never take the slots other steps need.
    wait_queue: str | None = None


class AlertmanagerPayload(_Model):
    """The Alertmanager webhook body, version 4."""

    model_config = ConfigDict(frozen=True, populate_by_name=True, extra="ignore")

    version: Literal["4"]
    group_key: str = Field(alias="groupKey")
    status: Literal["firing", "resolved"]
    receiver: str
    group_labels: dict[str, str] = Field(default_factory=dict, alias="groupLabels")
    common_labels: dict[str, str] = Field(default_factory=dict, alias="commonLabels")
    common_annotations: dict[str, str] = Field(default_factory=dict, alias="commonAnnotations")
    external_url: str = Field("", alias="externalURL")
    truncated_alerts: int = Field(0, alias="truncatedAlerts", ge=0)
    alerts: list[Alert] = Field(min_length=1, max_length=10_000)


class AlertAnswer(_Model):
    """One entry of the webhook's 202 answer, per alert."""

    fingerprint: str
    runbook: str | None
    workflow_id: str | None
    # refused: meant for a runbook but unusable (unknown cluster, invalid node name, ...);
    # ignored: not for FleetMedic or nothing to do (no route, a resend of a remediated incident).
    action: Literal["started", "attached", "ignored", "refused"]
    reason: str
    code: str = ""  # machine-readable reason: the `reason` label of fleetmedic_webhook_alerts_total


# --- fleet guard ---------------------------------------------------------------------------------

class LeaseRequest(_Model):
    workflow_id: str
    node: str
    domain: str = ""  # the node's topology domain (policy budget.topology_label), "" when unknown
    requested_at: datetime | None = None
    # The run's protective step was held by the cordon breaker: no lease while the breaker is tripped.
    breaker_held: bool = False
    trip: BreakerTrip | None = None  # the step found the bound reached: the guard trips the breaker


class Lease(_Model):
    workflow_id: str
    node: str
    domain: str = ""
    granted_at: datetime


class LeaseAnswer(_Model):
    """What the guard tells a runbook about its request: granted, or its place in the queue."""

    granted: bool
    position: int = 0  # 1 = next in line
    paused: Operator | None = None
    reason: str = ""
    out_fraction: float = 0.0  # share of GPU nodes out of service (leases included) at the grant


class KillAnswer(_Model):
    """The fleet guard's answer to a protective kill: now, or not before the lease (and why)."""

    granted: bool
    reason: str = ""


class GuardState(_Model):
    """The fleet guard's whole state, carried across continue-as-new (mutable: the guard owns it)."""

    model_config = ConfigDict(frozen=False)

    cluster: str
    holders: list[Lease] = Field(default_factory=list)
    queue: list[LeaseRequest] = Field(default_factory=list)
    granted_recently: list[datetime] = Field(default_factory=list)  # for max_per_hour
    paused: Operator | None = None
    grants: int = 0
    max_held: int = 0  # the most leases ever held at once (tests and the dashboard read it)
    # Set while the Kubernetes API cannot be read: no lease is granted (fail closed) until it can.
    capacity_unknown: str | None = None
    # Protective kills (job_lost XIDs: DOWN + requeue before the lease): asked, and granted in the last minute.
    kill_requests: list[LeaseRequest] = Field(default_factory=list)
    killed_recently: list[datetime] = Field(default_factory=list)
    # The place in line each runbook was last told (0: granted). Carried so that a continue-as-new
    # tells nobody again: re-telling 1,000 holders was 2,000 events, past the history limit at once,
    # and the guard continued-as-new and re-told them all in a loop.
    told: dict[str, int] = Field(default_factory=dict)
    # The cordon breaker: tripped by a protective step past budget.protective, reset only by a person.
    breaker: BreakerState | None = None
    breaker_reset_at: datetime | None = None
    breaker_reset_by: Operator | None = None


class FleetCapacity(_Model):
    gpu_nodes: int
    unavailable: list[str] = Field(default_factory=list)  # NotReady or cordoned GPU nodes
    # The topology domain of each unavailable node (budget.topology_label), for the per-domain limit.
    domains: dict[str, str] = Field(default_factory=dict)


class FleetPause(_Model):
    """The fleet guard's pause, for runbooks that hold no lease (traffic runbooks) and so never
    hear of it through a `lease` answer."""

    paused: Operator | None = None

