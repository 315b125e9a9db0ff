"""Slurm's side of the job-failures runbook: restart a failed job, read what it printed, and list
the jobs that ended lately (the reconciliation, for ends pushed while nobody listened)."""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

from temporalio import activity

from activities.slurm import SlurmActivities, scontrol_fields
from fleetmedic.errors import ErrorKind
from fleetmedic.job_failures import ENDED_STATES, JobEnd, OutputRequest, RestartJob, from_squeue
from fleetmedic.models import ActionResult

MAX_MATCHED = 10
MAX_LINE = 300


class JobActivities:
    def __init__(self, slurm: SlurmActivities) -> None:
        self.slurm = slurm
        self.cli = slurm.cli

    def _show(self, job_id: int) -> dict[str, str] | None:
        """`scontrol show job -o`, or None when Slurm no longer has it (past MinJobAge)."""
        try:
            line = self.cli.run("scontrol", "show", "job", "-o", str(job_id))
        except Exception as exc:
            if getattr(exc, "type", None) == ErrorKind.NOT_FOUND or "Invalid job id" in str(exc):
                return None
            raise
        return scontrol_fields(line.strip())

    @activity.defn(name="slurm.restart_job")
    def restart_job(self, request: RestartJob) -> ActionResult:
        target = f"Slurm job {request.job_id}"
        fields = self._show(request.job_id)
        if fields is None:
            return ActionResult(system="slurm", action="requeue", target=target, changed=False,
                                detail="Slurm no longer has the job (ended longer than MinJobAge ago): not restarted")
        state = fields.get("JobState", "")
        restarts = fields.get("Restarts", "0")
        if state not in ENDED_STATES or state == "COMPLETED":
            # PENDING or RUNNING again: Slurm requeued it (NODE_FAIL), or an earlier attempt of ours did.
            return ActionResult(system="slurm", action="requeue", target=target, changed=False,
                                detail=f"already {state.lower()} (restarts: {restarts})")
        if fields.get("Requeue") == "0":
            return ActionResult(system="slurm", action="requeue", target=target, changed=False,
                                detail="the job was submitted with --no-requeue: not restarted")
        if request.dry_run or self.slurm.force_dry_run:
            return ActionResult(system="slurm", action="requeue", target=target, changed=False, dry_run=True,
                                detail=f"would requeue it ({state})")
        try:
            self.cli.run("scontrol", "requeue", str(request.job_id))
        except Exception as exc:
            if getattr(exc, "type", None) == ErrorKind.CONFLICT:
                return ActionResult(system="slurm", action="requeue", target=target, changed=False,
                                    detail="already pending")
            raise
        return ActionResult(system="slurm", action="requeue", target=target, changed=True,
                            detail=f"restarted from its checkpoint after {state} (restarts before: {restarts})")

    @activity.defn(name="slurm.job_output")
    def job_output(self, request: OutputRequest) -> list[str]:
        """The job's output lines that match a pattern, from the end of the file Slurm names."""
        if not request.roots or not request.patterns:
            return []
        fields = self._show(request.job_id)
        if fields is None or not fields.get("StdOut"):
            return []
        path = Path(fields["StdOut"].replace("%j", str(request.job_id))).resolve()
        roots = [Path(r).resolve() for r in request.roots]
        if not any(path.is_relative_to(root) for root in roots):
            return []  # outside what the policy lets the worker read
        try:
            with open(path, "rb") as out:
                size = os.fstat(out.fileno()).st_size
                out.seek(max(size - request.tail_bytes, 0))
                tail = out.read(request.tail_bytes).decode("utf-8", errors="replace")
        except OSError:
            return []  # not on this worker's filesystem: the post's own lines, or none
        patterns = [re.compile(p) for p in request.patterns]
        matched = [line[:MAX_LINE] for line in tail.splitlines() if any(p.search(line) for p in patterns)]
        return matched[-MAX_MATCHED:]

    @activity.defn(name="slurm.ended_jobs")
    def ended_jobs(self, since: datetime) -> list[JobEnd]:
        """Jobs Slurm still shows (MinJobAge) that ended after `since`."""
        # An unreachable slurmctld raises here, naming it (SlurmCli): the runbook tries again later.
        ends = []
        for raw in self.cli.ended_jobs():
            try:
                end = from_squeue(raw)
            except ValueError:
                continue  # a name Kubernetes could not carry: not a node FleetMedic acts on
            if end is not None and end.ended_at > since:
                ends.append(end)
        return ends

    def activities(self) -> list[Callable[..., Any]]:
        return [self.restart_job, self.job_output, self.ended_jobs]
