"""The remediation policy: every threshold, limit and choice a platform team may tune.

A policy file is YAML validated by these models. Unknown keys are errors (a typo must not
silently fall back to a default), and :func:`parse_policy` reports the exact field and why.
"""

from __future__ import annotations

import difflib
import re
from datetime import timedelta
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from fleetmedic.durations import Duration
from fleetmedic.errors import validation_errors
from fleetmedic.quota import QueueShare
from fleetmedic.trust import cluster_name_error
from fleetmedic.xid import BurstRule, XidAction, XidRule, default_burst, default_catalog, default_reset_repeat


class PolicyError(ValueError):
    """A policy file that cannot be used. `field` is the dotted path of the first bad field."""

    def __init__(self, source: str, field: str, reason: str) -> None:
        self.source, self.field, self.reason = source, field, reason
        super().__init__(f"invalid policy {source}: {field}: {reason}")


def _td(**kwargs: float) -> timedelta:
    return timedelta(**kwargs)


def _key_value(value: str) -> str:
    key, sep, val = value.partition("=")
    if not sep or not key or not val or "," in value:
        raise ValueError(f"'{value}' must be written key=value")
    return value


# A label written `key=value`: one label, as selectors and opt-outs use it.
KeyValue = Annotated[str, AfterValidator(_key_value)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class LabelPolicy(_Strict):
    # `key=value`: a node or a pod carrying it opts out of every destructive step.
    opt_out: KeyValue = "fleetmedic.io/remediation=disabled"
    workflow_annotation: str = "fleetmedic.io/workflow"
    reason_annotation: str = "fleetmedic.io/quarantine-reason"
    # The times of the node's last remediations, for the lemon rule (see fleetmedic/lemon.py).
    remediations_annotation: str = "fleetmedic.io/remediations"
    gpu_resource: str = "nvidia.com/gpu"
    # Only nodes with this label count as GPU nodes for budgets and capacity.
    gpu_node_selector: KeyValue = "nvidia.com/gpu.present=true"

    @property
    def opt_out_pair(self) -> tuple[str, str]:
        key, _, value = self.opt_out.partition("=")
        return key, value


class ShadowPolicy(_Strict):
    # Shadow (dry-run) mode: mutating activities record what they would do and do nothing.
    all_runbooks: bool = Field(False, alias="global")
    runbooks: dict[str, bool] = Field(default_factory=dict)

    def enabled_for(self, runbook: str) -> bool:
        return self.all_runbooks or self.runbooks.get(runbook, False)


class XidPolicy(_Strict):
    catalog: dict[int, XidRule] = Field(default_factory=default_catalog)
    unknown_action: XidAction = XidAction.NOTIFY
    application_burst: BurstRule = Field(default_factory=default_burst)
    reset_repeat: BurstRule = Field(default_factory=default_reset_repeat)
    # When a GPU reset is asked for and no node agent can do it: reboot or replace.
    reset_fallback: Literal["reboot", "replace"] = "reboot"

    @field_validator("catalog", mode="before")
    @classmethod
    def _merge_catalog(cls, value: Any) -> Any:
        # A policy lists only the XIDs it changes; the rest keep their defaults.
        if isinstance(value, dict):
            merged: dict[Any, Any] = {k: v.model_dump() for k, v in default_catalog().items()}
            for key, rule in value.items():
                try:
                    xid = int(key)
                except (TypeError, ValueError):
                    raise ValueError(f"XID '{key}' is not a number") from None
                if isinstance(rule, str):
                    rule = {"action": rule}
                if isinstance(rule, dict):  # what the entry does not say keeps the built-in's
                    rule = {**merged.get(xid, {}), **rule}
                merged[xid] = rule
            return merged
        return value


class ThermalPolicy(_Strict):
    threshold_c: float = Field(78.0, gt=0, lt=150)
    # absolute: temperature above threshold_c; margin: thermal margin to slowdown below margin_c.
    mode: Literal["absolute", "margin"] = "absolute"
    margin_c: float = Field(5.0, ge=0)
    sustain: Duration = Field(default_factory=lambda: _td(minutes=2))
    pull_mode: Literal["immediate", "at-checkpoint"] = "immediate"
    at_checkpoint_deadline: Duration = Field(default_factory=lambda: _td(minutes=30))

    def too_hot(self, temperature_c: float | None, margin_c: float | None) -> str | None:
        """Why this reading is too hot under the policy, or None when it is not (or says nothing)."""
        if self.mode == "margin":
            if margin_c is not None and margin_c < self.margin_c:
                return f"{margin_c:g} °C from slowdown, under the {self.margin_c:g} °C margin"
            return None
        if temperature_c is not None and temperature_c > self.threshold_c:
            return f"{temperature_c:g} °C, above {self.threshold_c:g} °C"
        return None


class NvlinkPolicy(_Strict):
    error_rate_per_min: float = Field(10.0, gt=0)
    keep_serving_inference: bool = True
    # On a node kept for inference: the taint inference workloads tolerate and training ones do not.
    degraded_taint: str = "fleetmedic.io/degraded=nvlink:NoSchedule"
    # The pods that are inference (they stay on a degraded node); every other pod is evicted.
    inference_selector: KeyValue = "fleetmedic.io/workload=inference"

    @field_validator("degraded_taint")
    @classmethod
    def _taint(cls, value: str) -> str:
        body, sep, effect = value.rpartition(":")
        if not sep or not body or effect not in ("NoSchedule", "PreferNoSchedule"):
            # NoExecute would evict the inference pods the taint is meant to keep.
            raise ValueError(f"'{value}' must be written key=value:NoSchedule (or PreferNoSchedule)")
        return value

class GracePolicy(_Strict):
    # How long running jobs get to write a checkpoint before the node goes DOWN. In immediate mode
    # the job is sent `signal` first and the node goes DOWN only after a fresh, complete checkpoint
    # (or this long): Slurm's own DOWN would kill it after KillWait (30 s by default), whatever this says.
    checkpoint: Duration = Field(default_factory=lambda: _td(seconds=120))
    signal: str = Field("TERM", pattern=r"^(SIG)?[A-Z][A-Z0-9]{1,9}$")
    eviction_deadline: Duration = Field(default_factory=lambda: _td(minutes=10))
    node_ready_deadline: Duration = Field(default_factory=lambda: _td(minutes=30))
    job_resume_deadline: Duration = Field(default_factory=lambda: _td(minutes=15))


class ProtectiveBudgetPolicy(_Strict):
    """The cordon breaker: protective steps (cordon + Slurm DRAIN ahead of the lease) are cheap,
    not free. Past either bound the breaker trips; it stays tripped until a person resets it."""

    # GPU nodes that may go out of service (cordoned or NotReady, by anyone) within `window` before
    # FleetMedic stops cordoning ahead of the lease: a share of the GPU nodes, at least `min_nodes`.
    max_out_fraction: float = Field(0.15, gt=0, le=1)
    min_nodes: int = Field(3, ge=1)
    window: Duration = Field(default_factory=lambda: _td(minutes=10))
    # FleetMedic's own protective cordons in the last minute, fleet-wide.
    max_per_minute: int = Field(50, ge=1)


class BudgetPolicy(_Strict):
    max_concurrent: int = Field(5, ge=1)
    max_unavailable_fraction: float = Field(0.10, gt=0, le=1)
    max_per_hour: int = Field(20, ge=1)
    topology_label: str | None = "topology.kubernetes.io/zone"
    max_per_domain: int = Field(2, ge=1)
    # The fleet guard continues-as-new (keeping its state) past this many history events.
    guard_history_events: int = Field(2000, ge=50, le=40000)
    # How often the guard checks that lease holders still run (a crashed holder's lease comes back).
    guard_reclaim_interval: Duration = Field(default_factory=lambda: _td(minutes=1))
    # Signals (a grant, a place in line, a kill's answer) the guard sends in one workflow task; the
    # rest go in the next. Thousands in one task (a storm's grants) kept it past the SDK's 2 s
    # deadlock timeout on a busy worker, and a guard that fails the same task on each retry grants
    # no lease again.
    guard_signals_per_task: int = Field(200, ge=1, le=2000)
    # A runbook that waited this long for its lease escalates (retry: wait again; skip: go on without
    # the lease, an operator's override; abort). It keeps its place in line meanwhile.
    lease_timeout: Duration = Field(default_factory=lambda: _td(hours=2))
    # XIDs whose job is already dead (catalog `job_lost`): this many nodes a minute, fleet-wide, may
    # go DOWN with their job requeued before their lease (the protective step). Beyond it, a storm
    # (a broken exporter, a bad driver push) waits for leases like any other. 0: never before.
    max_protective_kills_per_minute: int = Field(2, ge=0, le=1000)
    protective: ProtectiveBudgetPolicy = Field(default_factory=ProtectiveBudgetPolicy)


class DrainPolicy(_Strict):
    # A pod still on the node when grace.eviction_deadline passes (its PodDisruptionBudget allows no
    # eviction): escalate (the operator answers retry / skip / abort) or proceed (recorded, and the
    # outcome says how many pods were left past their PDB).
    on_blocked: Literal["escalate", "proceed"] = "escalate"


class ApprovalPolicy(_Strict):
    # Steps that wait for a human `approve` Update before they run, e.g. ["replace"].
    steps: list[Literal["cordon", "drain", "slurm_down", "replace", "reset", "reboot", "quota_cut"]] = Field(
        default_factory=list)
    # Ask for approval of every destructive step while this share of GPU nodes is out.
    above_unavailable_fraction: float | None = Field(None, gt=0, le=1)
    timeout: Duration = Field(default_factory=lambda: _td(hours=4))
    on_timeout: Literal["escalate", "abort"] = "escalate"


class LemonPolicy(_Strict):
    count: int = Field(3, ge=2)
    window: Duration = Field(default_factory=lambda: _td(days=7))
    # Each live remediation is also written on the node (annotation fleetmedic.io/remediations, the
    # newest `keep`), so the count survives Temporal's retention of closed runs.
    keep: int = Field(10, ge=2, le=50)


class HttpProviderPolicy(_Strict):
    url: str = "http://127.0.0.1:8089"
    timeout: Duration = Field(default_factory=lambda: _td(seconds=10))


class ClusterApiProviderPolicy(_Strict):
    namespace: str = "default"
    # The Node -> Machine link: Cluster API sets this annotation on every Node it owns.
    machine_annotation: str = "cluster.x-k8s.io/machine"


class KarpenterProviderPolicy(_Strict):
    nodepool_label: str = "karpenter.sh/nodepool"


class ProviderPolicy(_Strict):
    kind: Literal["manual", "cluster-api", "karpenter", "http"] = "manual"
    http: HttpProviderPolicy = HttpProviderPolicy()
    cluster_api: ClusterApiProviderPolicy = ClusterApiProviderPolicy()
    karpenter: KarpenterProviderPolicy = KarpenterProviderPolicy()


_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
_SELECTOR_TERM = re.compile(r"[A-Za-z0-9./_-]+(\s*(=|==|!=)\s*[A-Za-z0-9._-]*)?")


class SlinkyPolicy(_Strict):
    """Where Slinky's slurm-operator runs slurmd: the pods of its NodeSets (docs/production.md)."""

    namespace: str = "slurm"
    # The slurmd pods: slurm-operator labels every NodeSet pod `app.kubernetes.io/name=slurmd`.
    selector: str = "app.kubernetes.io/name=slurmd"
    # The NodeSets whose pods are Slurm nodes of this cluster; empty: every NodeSet in `namespace`.
    nodesets: list[str] = Field(default_factory=list)

    @field_validator("namespace")
    @classmethod
    def _namespace(cls, value: str) -> str:
        if not _DNS_LABEL.fullmatch(value):
            raise ValueError(f"{value!r} is not a namespace name")
        return value

    @field_validator("nodesets")
    @classmethod
    def _nodesets(cls, value: list[str]) -> list[str]:
        for name in value:
            if not re.fullmatch(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?", name):
                raise ValueError(f"{name!r} is not a NodeSet name")
        return value

    @field_validator("selector")
    @classmethod
    def _selector(cls, value: str) -> str:
        # Equality terms only (`key=value,key!=value,key`): the selector reaches the API as given.
        if not value or not all(_SELECTOR_TERM.fullmatch(term.strip()) for term in value.split(",")):
            raise ValueError(f"{value!r} is not a label selector of equality terms (key=value, key!=value, key)")
        return value


class SlurmPolicy(_Strict):
    """Which Slurm node a Kubernetes node is. `same-name`: the one named like it (slurm.conf lists
    the hosts, or dynamic nodes register under the host's name). `slinky`: the Slurm node of the
    slurmd pod that a Slinky NodeSet runs on it, named after the pod; a node without one has no
    Slurm side."""

    mapping: Literal["same-name", "slinky"] = "same-name"
    slinky: SlinkyPolicy = SlinkyPolicy()


class BurnInPolicy(_Strict):
    """A diagnostic on the node between its validation and its return to service (none of the
    anchors has one): a Slurm job run on the node inside a maintenance reservation, so nothing else
    lands there. It passes on exit code 0 and, when `pass_pattern` is set, output that matches it.
    A failure sends the node back to the provider, at most `rounds` provider requests per run."""

    enabled: bool = False
    kind: Literal["slurm"] = "slurm"
    # Run as the job script (a short NCCL or DCGM diagnostic, e.g. `dcgmi diag -r 2`).
    script: str = "#!/bin/sh\nexec dcgmi diag -r 2\n"
    deadline: Duration = Field(default_factory=lambda: _td(minutes=30))
    pass_pattern: str = ""
    # Where the job's output goes: a path the node and the worker share (the job writes, the worker reads).
    output_dir: str = "/var/log/fleetmedic/burn-in"
    rounds: int = Field(2, ge=1, le=5)

    @field_validator("pass_pattern")
    @classmethod
    def _regex(cls, value: str) -> str:
        try:
            re.compile(value)
        except re.error as exc:
            raise ValueError(f"not a regular expression: {exc}") from None
        return value


def _regexes(value: dict[str, str]) -> dict[str, str]:
    for name, pattern in value.items():
        if not re.fullmatch(r"[a-z][a-z0-9_]{0,31}", name):
            raise ValueError(f"pattern name {name!r} must be 1-32 of a-z, 0-9 and '_' (it is a metric label)")
        try:
            re.compile(pattern)
        except re.error as exc:
            raise ValueError(f"{name}: not a regular expression: {exc}") from None
    return value


class CrashPolicy(_Strict):
    """Training-job failures (the job-failures runbook): let it crash, and if it persists, find the
    node (fleetmedic/attribution.py says how and why)."""

    enabled: bool = True
    # Restarts FleetMedic asks for one job within `window`; past it a person is asked.
    max_restarts: int = Field(5, ge=0, le=100)
    window: Duration = Field(default_factory=lambda: _td(hours=24))
    # Exit codes the training code uses for its own errors: such a failure says nothing of a node.
    application_exit_codes: list[int] = Field(default_factory=list)
    # Lines of the job's output that name the cause (the first that matches is the failure's cause).
    patterns: Annotated[dict[str, str], AfterValidator(_regexes)] = Field(default_factory=lambda: {
        "nccl": r"NCCL.*(timeout|Timeout|unhandled system error)", "cuda": r"CUDA error", "ecc": r"\bECC\b"})
    # ... and lines that say the code failed (a Python traceback's last line): not evidence.
    application_patterns: Annotated[dict[str, str], AfterValidator(_regexes)] = Field(default_factory=lambda: {
        "python": r"^\w*(Error|Exception): "})
    # The job's output is read (its last `output_tail_bytes`) only under these directories, from the
    # path Slurm gives for the job, never from a post. Empty: output is not read.
    output_roots: list[str] = Field(default_factory=list)
    output_tail_bytes: int = Field(65536, ge=1024, le=4 * 1024 * 1024)
    # A node in each of a job's last `suspect_after` failed allocations, the allocations otherwise
    # varied, and at most `max_common_nodes` nodes in all of them: a suspect.
    suspect_after: int = Field(3, ge=2, le=20)
    max_common_nodes: int = Field(2, ge=1, le=16)
    # A node in failures of at least `min_jobs` different jobs in `window` and far more than chance
    # gives it (Poisson tail below `significance`, Bonferroni over the fleet): a suspect.
    min_jobs: int = Field(3, ge=2, le=100)
    significance: float = Field(0.01, gt=0, lt=1)
    # This many different jobs failing within `widespread_window`: software, not a node; nobody out.
    widespread_jobs: int = Field(6, ge=2)
    widespread_window: Duration = Field(default_factory=lambda: _td(minutes=30))
    # Suspects sent to trial within an hour, fleet-wide (a bad push must not empty the fleet).
    max_suspects_per_hour: int = Field(2, ge=0, le=100)
    # A failure on a node whose hardware runbook ran this recently is explained by it.
    explained_within: Duration = Field(default_factory=lambda: _td(hours=1))
    # How often Slurm's recently ended jobs, and the failed pods of Indexed Jobs and JobSets, are read
    # (a job that ended while FleetMedic was down, and Kubernetes' training jobs, which post nothing).
    reconcile_every: Duration = Field(default_factory=lambda: _td(minutes=2))
    kubernetes_jobs: bool = True


class StoragePolicy(_Strict):
    # Checkpoints of job <job_id> live under `root`/`layout`; the newest file or directory
    # matching it is the one the job resumes from. `{job_id}` and `{job_name}` are filled in.
    root: str = "/checkpoints"
    layout: str = "{job_id}/*"
    step_pattern: str = r"(\d+)"
    # When a checkpoint counts as written: `stable` — its size (a directory's total) and modification
    # time are the same across two reads `stable_interval` apart; `marker` — the file `marker` names
    # exists (`{path}` is the checkpoint, e.g. `{path}/.metadata` for torch.distributed.checkpoint).
    complete: Literal["stable", "marker"] = "stable"
    marker: str = "{path}/COMPLETE"
    stable_interval: Duration = Field(default_factory=lambda: _td(seconds=1))

    @field_validator("marker")
    @classmethod
    def _marker(cls, value: str) -> str:
        if "{path}" not in value or ".." in value.split("/"):
            raise ValueError("marker must contain {path} and no '..', e.g. '{path}/COMPLETE' or '{path}.done'")
        return value

    @field_validator("layout")
    @classmethod
    def _relative(cls, value: str) -> str:
        if value.startswith("/") or ".." in value.split("/"):
            raise ValueError("layout must be a relative glob under root, without '..'")
        return value


class EscalationPolicy(_Strict):
    slack_mention: str = "@gpu-oncall"
    # How long a runbook waits for `retry`/`skip`/`abort` before it asks again.
    reminder: Duration = Field(default_factory=lambda: _td(hours=1))


class RetryBudget(_Strict):
    """A bounded retry policy: after `attempts` the step escalates to a human."""

    attempts: int = Field(ge=1, le=100)
    initial_interval: Duration = Field(default_factory=lambda: _td(seconds=1))
    max_interval: Duration = Field(default_factory=lambda: _td(seconds=30))


class RetryPolicyConfig(_Strict):
    # Reads are safe to repeat; writes get fewer attempts so a broken system reaches a human
    # within minutes instead of being hammered for hours.
    reads: RetryBudget = RetryBudget(attempts=8, max_interval=_td(seconds=20))
    writes: RetryBudget = RetryBudget(attempts=5)
    # start-to-close of one attempt of an ordinary call; a worker that dies mid-call is noticed
    # after this long. Longer steps (drain) have their own deadline and heartbeat.
    call_timeout: Duration = Field(default_factory=lambda: _td(seconds=30))
    # How long a wait (a node coming back Ready, a replacement joining, pods leaving, inference
    # coming home) may go without a heartbeat before the server hands it to another worker: a worker
    # that dies mid-wait is noticed after this long. Every heartbeat is a write on the Temporal server
    # (a billed Action on Temporal Cloud), and an incident keeps thousands of runs waiting for hours:
    # 1,000 waits sent 43 a second at 30 s, 13 at 2 min (bench/worker_scale.py). A cancelled run's
    # wait learns of it through its heartbeat too, so up to this long later. Steps that evict while
    # they wait (a drain, a batch of traffic) heartbeat every 8 s at most, whatever this is.
    wait_heartbeat: Duration = Field(default_factory=lambda: _td(minutes=2))

    @field_validator("wait_heartbeat")
    @classmethod
    def _heartbeat_in_range(cls, value: timedelta) -> timedelta:
        # A wait heartbeats every quarter of this (activities/node_watch.py tick_for): below 10 s a
        # busy worker's wait could time out while alive; past an hour a dead worker's waits stall for hours.
        if not timedelta(seconds=10) <= value <= timedelta(hours=1):
            raise ValueError("must be between 10s and 1h")
        return value


class KubeApiPolicy(_Strict):
    # Client-side rate limit of each FleetMedic process toward the Kubernetes API server: a token
    # bucket of `qps` requests a second on average and `burst` at once. An incident that takes out
    # a rack must not become a flood on an API server that may be in trouble itself; a 429 from the
    # server holds every caller for its Retry-After. (client-go's defaults, 5/10, are for one controller.)
    qps: float = Field(50, gt=0, le=10000)
    burst: int = Field(100, ge=1, le=10000)
    # The protective step's own bucket (cordon + the reads before it), beside the main one: drains,
    # watches and replacements using up `qps` never delay a new alert's cordon. The process's
    # total toward the server is at most qps + protective_qps. Each node costs two requests (its
    # read and its cordon; the opted-out pods are one list shared by the runs asking at once), so
    # the default burst takes a rack of 100 nodes failing together without a wait: at 20/50 a storm
    # of 50 nodes waited up to 5 s here for tokens, while the server had room to spare.
    protective_qps: float = Field(50, gt=0, le=10000)
    protective_burst: int = Field(200, ge=1, le=10000)


class Route(_Strict):
    """Alerts named `alertname` (and matching `match`, read from the labels, else the annotations)
    start or reach `runbook`."""

    alertname: str = Field(min_length=1)
    match: dict[str, str] = Field(default_factory=dict)
    runbook: Literal["xid-recovery", "hot-gpu-pull", "nvlink-fault-replace", "traffic-flip", "migrate-back"]
    # One incident, one remediation: a firing alert whose startsAt is not later than the end of the
    # last closed run for its workflow ID is a resend of an incident already handled (dcgm-exporter's
    # XID gauge and Alertmanager's repeat_interval both resend). `reopen: true` starts a new run anyway.
    reopen: bool = False


def _default_routes() -> list[Route]:
    # XID 74 is an NVLink fault: its own runbook owns it (the first matching route wins).
    nvlink_xid = Route.model_validate({"alertname": "FleetMedicGpuXid", "match": {"xid": "74"},
                                       "runbook": "nvlink-fault-replace"})
    pairs = [("FleetMedicGpuXid", "xid-recovery"), ("FleetMedicGpuHot", "hot-gpu-pull"),
             ("FleetMedicNvlinkErrors", "nvlink-fault-replace"), ("FleetMedicNvlinkDown", "nvlink-fault-replace"),
             ("FleetMedicTrainingStarted", "traffic-flip"), ("FleetMedicGpusExhausted", "traffic-flip"),
             ("FleetMedicTrainingFinished", "migrate-back"), ("FleetMedicGpusFree", "migrate-back")]
    return [nvlink_xid] + [Route.model_validate({"alertname": name, "runbook": runbook}) for name, runbook in pairs]


class RoutingPolicy(_Strict):
    routes: list[Route] = Field(default_factory=_default_routes)
    # Where each input is read from, first label present wins.
    node_labels: list[str] = Field(default_factory=lambda: ["node", "Hostname", "kubernetes_node"])
    # dcgm-exporter's `gpu` is the GPU index; its `GPU_I_ID` is the MIG instance, not a GPU.
    gpu_labels: list[str] = Field(default_factory=lambda: ["gpu"])
    xid_labels: list[str] = Field(default_factory=lambda: ["xid", "err_code"])
    cluster_label: str = "cluster"
    default_cluster: str = "default"
    # The clusters this deployment serves (each has its own fleet guard and budget). An alert's
    # cluster label may only select among them; empty: default_cluster alone.
    clusters: list[str] = Field(default_factory=list)

    @field_validator("default_cluster")
    @classmethod
    def _cluster_name(cls, value: str) -> str:
        if (error := cluster_name_error(value)) is not None:
            raise ValueError(error)
        return value

    @field_validator("clusters")
    @classmethod
    def _cluster_names(cls, value: list[str]) -> list[str]:
        for name in value:
            if (error := cluster_name_error(name)) is not None:
                raise ValueError(error)
        return value

    @property
    def served_clusters(self) -> tuple[str, ...]:
        return tuple(self.clusters) or (self.default_cluster,)


class KueuePolicy(_Strict):
    """kueue-quota-sync: ClusterQueue quotas follow the healthy GPUs that exist."""

    enabled: bool = False  # on: the worker keeps a Temporal Schedule, and node runbooks trigger a sync
    interval: Duration = Field(default_factory=lambda: _td(minutes=5))
    # How each ClusterQueue's GPU quota follows its flavors' healthy GPUs (default: all of them).
    queues: dict[str, QueueShare] = Field(default_factory=dict)
    default: QueueShare = QueueShare()
    # At most this share of a queue's quota is added in one run (cuts to the healthy count are not bounded).
    max_change_fraction: float = Field(0.25, gt=0, le=1)
    # Degraded inference-only nodes (nvlink.degraded_taint) count as training capacity.
    count_degraded: bool = False

    def share_for(self, queue: str) -> QueueShare:
        return self.queues.get(queue, self.default)


class TrafficPolicy(_Strict):
    """traffic-flip and migrate-back: inference spills to external GPUs while training holds the cluster."""

    # The virtual-kubelet node(s) in front of external GPU providers.
    virtual_node_selector: KeyValue = "type=virtual-kubelet"
    # Present: inference stays in-cluster; absent: new inference pods may land on the virtual node(s).
    overflow_taint: str = "fleetmedic.io/overflow=closed:NoSchedule"
    # Inference Deployments and their pods carry this label.
    inference_selector: KeyValue = "fleetmedic.io/workload=inference"
    # Each Deployment keeps at least this share of its replicas Ready (rounded up).
    min_ready_fraction: float = Field(0.9, gt=0, le=1)
    # Kueue Workloads at or above this priority are the training that takes the cluster.
    training_priority: int = 1000
    # Kueue's own decisions start the runbooks (workers/kueue_admission.py): traffic-flip when such
    # a Workload is admitted or waits behind inference, migrate-back when the last one is gone.
    start_from_kueue: bool = True
    # How often that watch also looks at every Workload (a missed event, a restarted worker).
    kueue_resync: Duration = Field(default_factory=lambda: _td(seconds=30))
    below_minimum_grace: Duration = Field(default_factory=lambda: _td(minutes=2))
    watch_duration: Duration = Field(default_factory=lambda: _td(minutes=15))
    prewarm: bool = False  # ask the provider (action prewarm) for external capacity before the flip
    prewarm_timeout: Duration = Field(default_factory=lambda: _td(minutes=10))
    batch_size: int = Field(5, ge=1, le=500)
    batch_pause: Duration = Field(default_factory=lambda: _td(seconds=30))
    batch_timeout: Duration = Field(default_factory=lambda: _td(minutes=5))
    # Optional SLO gate between batches: a PromQL query (FLEETMEDIC_PROMETHEUS_URL) whose value must
    # stay at or below slo_max, e.g. the 5xx ratio of the inference gateway.
    slo_query: str = ""
    slo_max: float = 0.01

    @field_validator("overflow_taint")
    @classmethod
    def _no_execute_never(cls, value: str) -> str:
        body, sep, effect = value.rpartition(":")
        if not sep or not body or effect != "NoSchedule":
            # NoExecute would evict every inference pod on the virtual node at once.
            raise ValueError(f"'{value}' must be written key=value:NoSchedule (never NoExecute)")
        return value

class NotifyPolicy(_Strict):
    slack_channel: str | None = None  # FLEETMEDIC_SLACK_CHANNEL wins when set
    # Dry (shadow) runs post here, never in the live channel and never with a mention; unset: nowhere.
    shadow_channel: str | None = None


class Policy(_Strict):
    version: Literal[1] = 1
    labels: LabelPolicy = LabelPolicy()
    shadow: ShadowPolicy = ShadowPolicy()
    xid: XidPolicy = XidPolicy()
    thermal: ThermalPolicy = ThermalPolicy()
    nvlink: NvlinkPolicy = NvlinkPolicy()
    grace: GracePolicy = GracePolicy()
    drain: DrainPolicy = DrainPolicy()
    budget: BudgetPolicy = BudgetPolicy()
    approvals: ApprovalPolicy = ApprovalPolicy()
    lemon: LemonPolicy = LemonPolicy()
    provider: ProviderPolicy = ProviderPolicy()
    slurm: SlurmPolicy = SlurmPolicy()
    burn_in: BurnInPolicy = BurnInPolicy()
    crash: CrashPolicy = CrashPolicy()
    storage: StoragePolicy = StoragePolicy()
    escalation: EscalationPolicy = EscalationPolicy()
    notify: NotifyPolicy = NotifyPolicy()
    retries: RetryPolicyConfig = RetryPolicyConfig()
    kube_api: KubeApiPolicy = KubeApiPolicy()
    routing: RoutingPolicy = RoutingPolicy()
    kueue: KueuePolicy = KueuePolicy()
    traffic: TrafficPolicy = TrafficPolicy()

    def serving(self, *clusters: str) -> Policy:
        """This policy serving `clusters` as well (tests and benchmarks run one cluster each)."""
        served = list(dict.fromkeys([*self.routing.clusters, *clusters]))
        return self.model_copy(update={"routing": RoutingPolicy.model_validate(
            {**self.routing.model_dump(), "clusters": served})})

    @model_validator(mode="after")
    def _consistent(self) -> Policy:
        if self.grace.checkpoint > self.grace.eviction_deadline:
            raise ValueError("grace.checkpoint must not be longer than grace.eviction_deadline")
        return self


# The policies runs hold (`shared`). A worker serves one policy at a time; a change of the file
# adds one, and the few it keeps are dropped together (runs keep the objects they hold).
_SHARED: dict[str, Policy] = {}
_SHARED_KEEP = 4


def shared(policy: Policy) -> Policy:
    """One object for every run holding an equal policy. A run in flight keeps the policy it
    loaded, each its own copy (40 KB): at 5,000 runs that was 200 MB of the worker's memory for
    5,000 equal objects. Policies are frozen, so sharing one cannot let a run change another's.
    Runs call this from the workflow threads at once: only single, atomic dict operations."""
    global _SHARED
    if any(policy is known for known in list(_SHARED.values())):
        return policy  # read once already (fleetmedic/converter.py): no need to write it out again
    if len(_SHARED) >= _SHARED_KEEP:
        _SHARED = {}
    return _SHARED.setdefault(policy.model_dump_json(), policy)


DEFAULT_POLICY_RESOURCE = "default_policy.yaml"


def default_policy_text() -> str:
    return resources.files("fleetmedic").joinpath(DEFAULT_POLICY_RESOURCE).read_text()


def parse_policy(text: str, source: str = "<policy>") -> Policy:
    """Parse and validate a policy document; raise PolicyError naming the bad field."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise PolicyError(source, "(document)", f"not valid YAML: {exc}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise PolicyError(source, "(document)", "the top level must be a mapping")
    try:
        return Policy.model_validate(data)
    except ValidationError as exc:
        where, why = validation_errors(exc)[0]
        if exc.errors()[0]["type"] == "extra_forbidden":
            why = unknown_key_hint(where)
        raise PolicyError(source, where or "(document)", why) from None


def unknown_key_hint(where: str) -> str:
    """`budget.max_concurent` → "unknown key; did you mean 'max_concurrent'? valid: ..."."""
    *parents, key = where.split(".")
    model: Any = Policy
    for part in parents:
        field = model.model_fields.get(part) if isinstance(model, type) and issubclass(model, BaseModel) else None
        model = field.annotation if field is not None else None
    if not (isinstance(model, type) and issubclass(model, BaseModel)):
        return "unknown key"
    valid = sorted(field.alias or name for name, field in model.model_fields.items())
    close = difflib.get_close_matches(key, valid, n=1)
    return "unknown key" + (f"; did you mean '{close[0]}'?" if close else "") + f" (valid: {', '.join(valid)})"


def load_policy(path: str | Path | None) -> Policy:
    """Read the policy file at `path`, or the shipped default policy when no path is given."""
    if not path:
        return parse_policy(default_policy_text(), f"(default {DEFAULT_POLICY_RESOURCE})")
    file = Path(path)
    try:
        text = file.read_text()
    except OSError as exc:
        raise PolicyError(str(file), "(file)", f"cannot read: {exc.strerror}") from None
    return parse_policy(text, str(file))
