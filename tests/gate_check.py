"""The safety gate, proved from the history: every destructive activity a runbook scheduled came
right after a gate read (the opt-out check, or the fleet pause asked of the guard) of the same step.

Each activity's summary in the history starts with its step ("drain: k8s.evict_pods"), and each
gate read with the step it guards ("drain: opt-out check: k8s.check_opt_out").
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from temporalio.api.history.v1 import HistoryEvent
from temporalio.client import WorkflowHistory

from workers.audit import local_activity


def _always(_: dict[str, Any]) -> bool:
    return True


# Every activity that changes what runs where, kills or signals something, or spends money —
# with the inputs for which it does. A new activity must be listed here or in SAFE (checked below).
DESTRUCTIVE: dict[str, Callable[[dict[str, Any]], bool]] = {
    "slurm.set_node_state": lambda arg: arg.get("state") in ("DOWN", "DRAIN"),
    "slurm.signal_job": _always,
    "slurm.requeue_job": _always,
    "k8s.cordon_node": _always,
    "k8s.add_taint": _always,
    "k8s.evict_pods": _always,
    "traffic.evict": _always,
    "provider.request": _always,
    "agent.reset_gpu": _always,
    "kueue.set_quota": _always,
}
GATE_READS = {"k8s.check_opt_out", "guard.paused"}
# Protective (reversible, kills nothing: cordon or taint and Slurm DRAIN) and reading the opt-out
# itself, right before it writes; it runs before the lease and is held by no pause (DESIGN.md,
# "Protective first"). Not a destructive step: what it writes must be what it may.
PROTECTIVE = {"protect.node"}
# Steps whose writes hold a *new* machine out until it passed its checks (Slurm DRAIN, cordon without
# a remediation counted) or record why a replaced one is gone: protective or clean-up, never gated.
PROTECTIVE_STEPS = {"take in replacement", "retire replaced node"}
# Reads, notifications, bookkeeping, and the recovery steps that give a node back (never held by a
# pause: a paused fleet must still heal).
SAFE = {
    "agent.available", "agent.gpus", "agent.validate", "config.context", "config.policy", "config.run", "guard.kill",
    "guard.paused", "guard.release", "guard.request", "k8s.annotate_quarantine", "k8s.check_opt_out",
    "k8s.fleet_capacity", "k8s.get_node", "k8s.record_event", "k8s.remove_taint", "k8s.uncordon_node",
    "k8s.wait_node_ready", "kueue.request_sync", "kueue.snapshot", "slack.notify_start", "slack.notify_step",
    "slurm.get_job", "slurm.get_node", "slurm.jobs_on_node", "storage.newest_checkpoint",
    "temporal.count_remediations", "temporal.running", "traffic.slo", "traffic.snapshot", "traffic.stop_runbook",
    "traffic.wait_home", *PROTECTIVE,
    # Following a replacement (a read); retiring a replaced node's leftover Node object (the machine is
    # gone: the object NotReady; a Ready one is only annotated); the burn-in, a job on a node the run
    # holds out, in a reservation of its own, which it leaves as it found it.
    "provider.find_replacement", "k8s.retire_node", "slurm.burn_in",
    # The job-failures runbook: reads of ended jobs, their output, failed pods and hardware runbooks;
    # the restart of a job that already ended (it kills nothing and takes no capacity from anyone: it
    # puts the job back in line); the start of a suspect's trial, a suspect-node run that passes the
    # gate itself before each of its destructive steps.
    "slurm.ended_jobs", "slurm.job_output", "slurm.restart_job", "k8s.failed_training_pods",
    "temporal.hardware_runbooks", "jobs.start_suspect",
}


def scheduled_events(history: WorkflowHistory, activity_type: str) -> list[HistoryEvent]:
    """The ActivityTaskScheduled events of one activity type, in order (their timeouts, their ids)."""
    return [e for e in history.events if e.HasField("activity_task_scheduled_event_attributes")
            and e.activity_task_scheduled_event_attributes.activity_type.name == activity_type]


def cancels_requested(history: WorkflowHistory) -> list[int]:
    """The scheduled event of each activity whose cancel the run requested (an abort during a wait)."""
    return [e.activity_task_cancel_requested_event_attributes.scheduled_event_id for e in history.events
            if e.HasField("activity_task_cancel_requested_event_attributes")]


def scheduled(history: WorkflowHistory) -> list[tuple[str, str, dict[str, Any]]]:
    """(activity type, step, first argument) of each activity the run scheduled, in order — and of
    each it ran as a local activity inside a workflow task (the protective step, the configuration
    reads), whose argument the history does not keep ({})."""
    out = []
    for event in history.events:
        summary = json.loads(event.user_metadata.summary.data) if event.user_metadata.summary.data else ""
        if (ran := local_activity(event)) is not None:
            out.append((ran["type"], str(summary).split(":")[0], {}))
        if not event.HasField("activity_task_scheduled_event_attributes"):
            continue
        attributes = event.activity_task_scheduled_event_attributes
        payloads = attributes.input.payloads
        arg = json.loads(payloads[0].data) if payloads else None
        out.append((attributes.activity_type.name, str(summary).split(":")[0], arg if isinstance(arg, dict) else {}))
    return out


def assert_gated(history: WorkflowHistory) -> set[str]:
    """Every destructive call preceded by a gate read of its own step. Returns the destructive (and
    protective) activity types the run called, so a test can say which it expected."""
    seen: set[str] = set()
    last_gate: str | None = None
    for name, step, arg in scheduled(history):
        if name in GATE_READS:
            last_gate = step
        elif name in PROTECTIVE or (step in PROTECTIVE_STEPS and name in DESTRUCTIVE):
            seen.add(name)
        elif name in DESTRUCTIVE and DESTRUCTIVE[name](arg):
            assert last_gate == step, f"{name} ({step}) was not preceded by the gate of its step " \
                                      f"(last gate: {last_gate})"
            seen.add(name)
    return seen
