"""Every activity a workflow calls, typed: its registered name, what it takes and what it returns.

Workflows never import the activities themselves (the sandbox must not load client libraries), so
they call them by name. These constants carry the name with its argument and result types, so
mypy checks every call site and a reader can follow the hop; `tests/test_activity_refs.py`
compares them with the functions the worker registers (the same names, arguments and results,
nothing dead, nothing missing). Names never change: recorded histories refer to them.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any, Generic, TypeVar

from pydantic import BaseModel, ConfigDict

from fleetmedic.job_failures import JobEnd, OutputRequest, RestartJob, SuspectRequest
from fleetmedic.models import (
    ActionResult,
    BurnIn,
    BurnInResult,
    Checkpoint,
    CheckpointQuery,
    EventRequest,
    EvictionReport,
    EvictRequest,
    FindReplacement,
    FleetCapacity,
    FleetPause,
    GpuReadings,
    GpuResetRequest,
    LeaseRequest,
    NodeInfo,
    NodeTarget,
    NotifyResult,
    NotifyStart,
    NotifyStep,
    Operator,
    OptOut,
    Protection,
    ProtectRequest,
    ProviderRequest,
    ProviderResult,
    Replacement,
    RequeueJob,
    RunContext,
    SetSlurmNodeState,
    SignalJob,
    SlurmJob,
    SlurmNode,
    TaintRequest,
    Validate,
    Validation,
    WaitNodeReady,
)
from fleetmedic.policy import Policy
from fleetmedic.quota import KueueSnapshot, QuotaUpdate
from fleetmedic.traffic import EvictPods, HomeReport, SloCheck, SloResult, TrafficSnapshot, WaitHome

In = TypeVar("In")
Out = TypeVar("Out")


@dataclass(frozen=True)
class Activity(Generic[In, Out]):
    """One activity. `In` is its one argument, or a tuple of its arguments when it takes several
    (or none: `tuple[()]`); `params` and `result` say the same at run time, for the converter and
    for the test that holds them to the registered functions."""

    name: str
    params: tuple[Any, ...]
    result: Any

    def args(self, arg: In) -> list[Any]:
        """The positional arguments of a call with `arg`."""
        if len(self.params) == 1:
            return [arg]
        assert isinstance(arg, tuple) and len(arg) == len(self.params), f"{self.name} takes {len(self.params)}"
        return list(arg)


NoArgs = tuple[()]

# --- configuration (local activities: the worker's own) ------------------------------------------


class RunConfig(BaseModel):
    """What a node run reads first, in one local activity (since 0.2.0): the worker's policy and its
    context. Read side by side, they were two activations of the run's first workflow task, the one
    whose protective step an alert waits for."""

    model_config = ConfigDict(frozen=True)
    policy: Policy
    context: RunContext


CONFIG_RUN: Activity[NoArgs, RunConfig] = Activity("config.run", (), RunConfig)
CONFIG_POLICY: Activity[NoArgs, Policy] = Activity("config.policy", (), Policy)  # the guard, the listener
CONFIG_CONTEXT: Activity[NoArgs, RunContext] = Activity("config.context", (), RunContext)  # 0.1.0's node runs

# --- the protective step (a local activity in the run's workflow task) ---------------------------
PROTECT_NODE: Activity[ProtectRequest, Protection] = Activity("protect.node", (ProtectRequest,), Protection)

# --- Kubernetes ------------------------------------------------------------------------------------
GET_NODE: Activity[str, NodeInfo | None] = Activity("k8s.get_node", (str,), NodeInfo | None)
FLEET_CAPACITY: Activity[tuple[str, str | None], FleetCapacity] = Activity(
    "k8s.fleet_capacity", (str, str | None), FleetCapacity)
CHECK_OPT_OUT: Activity[str, OptOut] = Activity("k8s.check_opt_out", (str,), OptOut)
WAIT_NODE_READY: Activity[WaitNodeReady, NodeInfo | None] = Activity("k8s.wait_node_ready", (WaitNodeReady,),
                                                                     NodeInfo | None)
CORDON: Activity[NodeTarget, ActionResult] = Activity("k8s.cordon_node", (NodeTarget,), ActionResult)
UNCORDON: Activity[NodeTarget, ActionResult] = Activity("k8s.uncordon_node", (NodeTarget,), ActionResult)
RETIRE_NODE: Activity[NodeTarget, ActionResult] = Activity("k8s.retire_node", (NodeTarget,), ActionResult)
ANNOTATE_QUARANTINE: Activity[NodeTarget, ActionResult] = Activity("k8s.annotate_quarantine", (NodeTarget,),
                                                                   ActionResult)
ADD_TAINT: Activity[TaintRequest, ActionResult] = Activity("k8s.add_taint", (TaintRequest,), ActionResult)
REMOVE_TAINT: Activity[TaintRequest, ActionResult] = Activity("k8s.remove_taint", (TaintRequest,), ActionResult)
EVICT_PODS: Activity[EvictRequest, EvictionReport] = Activity("k8s.evict_pods", (EvictRequest,), EvictionReport)
RECORD_EVENT: Activity[EventRequest, ActionResult] = Activity("k8s.record_event", (EventRequest,), ActionResult)
FAILED_TRAINING_PODS: Activity[datetime, list[JobEnd]] = Activity("k8s.failed_training_pods", (datetime,),
                                                                  list[JobEnd])

# --- Slurm -----------------------------------------------------------------------------------------
JOBS_ON_NODE: Activity[str, list[SlurmJob]] = Activity("slurm.jobs_on_node", (str,), list[SlurmJob])
GET_JOB: Activity[int, SlurmJob] = Activity("slurm.get_job", (int,), SlurmJob)
SLURM_NODE: Activity[str, SlurmNode] = Activity("slurm.get_node", (str,), SlurmNode)
SET_SLURM_STATE: Activity[SetSlurmNodeState, ActionResult] = Activity("slurm.set_node_state", (SetSlurmNodeState,),
                                                                      ActionResult)
REQUEUE_JOB: Activity[RequeueJob, ActionResult] = Activity("slurm.requeue_job", (RequeueJob,), ActionResult)
SIGNAL_JOB: Activity[SignalJob, ActionResult] = Activity("slurm.signal_job", (SignalJob,), ActionResult)
BURN_IN: Activity[BurnIn, BurnInResult] = Activity("slurm.burn_in", (BurnIn,), BurnInResult)
RESTART_JOB: Activity[RestartJob, ActionResult] = Activity("slurm.restart_job", (RestartJob,), ActionResult)
JOB_OUTPUT: Activity[OutputRequest, list[str]] = Activity("slurm.job_output", (OutputRequest,), list[str])
ENDED_JOBS: Activity[datetime, list[JobEnd]] = Activity("slurm.ended_jobs", (datetime,), list[JobEnd])

# --- storage, provider, node agent -----------------------------------------------------------------
NEWEST_CHECKPOINT: Activity[CheckpointQuery, Checkpoint | None] = Activity(
    "storage.newest_checkpoint", (CheckpointQuery,), Checkpoint | None)
PROVIDER_REQUEST: Activity[ProviderRequest, ProviderResult] = Activity("provider.request", (ProviderRequest,),
                                                                       ProviderResult)
FIND_REPLACEMENT: Activity[FindReplacement, Replacement] = Activity("provider.find_replacement", (FindReplacement,),
                                                                    Replacement)
AGENT_AVAILABLE: Activity[str, bool] = Activity("agent.available", (str,), bool)
AGENT_GPUS: Activity[str, GpuReadings] = Activity("agent.gpus", (str,), GpuReadings)
AGENT_VALIDATE: Activity[Validate, Validation] = Activity("agent.validate", (Validate,), Validation)
AGENT_RESET_GPU: Activity[GpuResetRequest, ActionResult] = Activity("agent.reset_gpu", (GpuResetRequest,),
                                                                    ActionResult)

# --- Slack -----------------------------------------------------------------------------------------
NOTIFY_START: Activity[NotifyStart, NotifyResult] = Activity("slack.notify_start", (NotifyStart,), NotifyResult)
NOTIFY_STEP: Activity[NotifyStep, NotifyResult] = Activity("slack.notify_step", (NotifyStep,), NotifyResult)

# --- the fleet guard and Temporal itself -----------------------------------------------------------
GUARD_REQUEST: Activity[tuple[str, LeaseRequest], None] = Activity("guard.request", (str, LeaseRequest), None)
GUARD_KILL: Activity[tuple[str, LeaseRequest], None] = Activity("guard.kill", (str, LeaseRequest), None)
GUARD_RELEASE: Activity[tuple[str, str], None] = Activity("guard.release", (str, str), None)
GUARD_PAUSED: Activity[str, FleetPause] = Activity("guard.paused", (str,), FleetPause)
RUNNING: Activity[list[str], list[str]] = Activity("temporal.running", (list[str],), list[str])
COUNT_REMEDIATIONS: Activity[tuple[str, str, datetime], int] = Activity(
    "temporal.count_remediations", (str, str, datetime), int)
HARDWARE_RUNBOOKS: Activity[tuple[str, list[str], datetime], dict[str, str]] = Activity(
    "temporal.hardware_runbooks", (str, list[str], datetime), dict[str, str])
START_SUSPECT: Activity[SuspectRequest, str] = Activity("jobs.start_suspect", (SuspectRequest,), str)

# --- Kueue and traffic -----------------------------------------------------------------------------
KUEUE_SNAPSHOT: Activity[NoArgs, KueueSnapshot] = Activity("kueue.snapshot", (), KueueSnapshot)
SET_QUOTA: Activity[QuotaUpdate, ActionResult] = Activity("kueue.set_quota", (QuotaUpdate,), ActionResult)
REQUEST_QUOTA_SYNC: Activity[str, None] = Activity("kueue.request_sync", (str,), None)
TRAFFIC_SNAPSHOT: Activity[NoArgs, TrafficSnapshot] = Activity("traffic.snapshot", (), TrafficSnapshot)
TRAFFIC_EVICT: Activity[EvictPods, EvictionReport] = Activity("traffic.evict", (EvictPods,), EvictionReport)
TRAFFIC_WAIT_HOME: Activity[WaitHome, HomeReport] = Activity("traffic.wait_home", (WaitHome,), HomeReport)
TRAFFIC_SLO: Activity[SloCheck, SloResult] = Activity("traffic.slo", (SloCheck,), SloResult)
STOP_RUNBOOK: Activity[tuple[str, Operator], bool] = Activity("traffic.stop_runbook", (str, Operator), bool)

ALL: tuple[Activity[Any, Any], ...] = tuple(value for value in dict(globals()).values() if isinstance(value, Activity))
