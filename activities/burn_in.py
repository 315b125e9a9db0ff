"""Burn-in: a diagnostic job on a node before it returns to training (policy `burn_in`).

The node is DRAINed by the run while this happens. The job runs inside a Slurm maintenance
reservation of the node alone: the reservation keeps every other job off while the node is
resumed for the burn-in, and the node is DRAINed again (and the reservation removed) before the
activity returns, pass or fail — the runbook alone decides whether it goes back to service.

A run that lets go of the burn-in (an abort) cancels the activity, and the job with it (`scancel`),
heard at the activity's next heartbeat. A worker that dies mid burn-in (a rollout's kill, a lost
node) leaves the node resumed inside its reservation: the next attempt finds the reservation, the
job (by the heartbeat, else by its name) and the reason the run held the node for (the heartbeat),
and follows that job instead of refusing a node that no longer reads as FleetMedic's.

Pass: the job ends COMPLETED with exit code 0 and, when the policy sets `pass_pattern`, its
output matches it. Slurm's exit code 0 alone is not trusted where a tool prints its verdict.
"""

from __future__ import annotations

import getpass
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from temporalio import activity
from temporalio.exceptions import CancelledError

from activities.errors import fail
from activities.slurm import REASON_PREFIX, SlurmActivities, scontrol_fields
from fleetmedic.errors import ErrorKind
from fleetmedic.job_failures import BURN_IN_JOB_PREFIX
from fleetmedic.models import BurnIn, BurnInResult

ENDED = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
                   "DEADLINE", "PREEMPTED"})
POLL_S = 1.0
OUTPUT_TAIL = 2000


def reservation_name(node: str) -> str:
    return f"fleetmedic-burnin-{node}"


def job_name(request: BurnIn) -> str:
    return f"{BURN_IN_JOB_PREFIX}{request.run_id}"


class BurnInActivities:
    def __init__(self, slurm: SlurmActivities) -> None:
        self.slurm = slurm
        self.cli = slurm.cli

    @activity.defn(name="slurm.burn_in")
    def burn_in(self, request: BurnIn) -> BurnInResult:
        if request.dry_run or self.slurm.force_dry_run:
            return BurnInResult(passed=True, detail=f"would run the burn-in on {request.node} "
                                                    f"(reservation {reservation_name(request.node)})")
        node = self.slurm.get_node(request.node)
        slurm = self.slurm.slurm_name(request.node)  # Slinky: the node's slurmd pod names it
        if slurm is None:
            raise fail(ErrorKind.NOT_FOUND, self.slurm.names.missing(request.node))
        before = self._before()
        if node.reason.startswith(REASON_PREFIX):
            held_for = node.reason
        elif self._reserved(request):  # an attempt cut short resumed it for its job: ours still
            held_for = before.get("held_for") or f"{REASON_PREFIX} burn-in {request.run_id} (its attempt was cut short)"
        else:
            raise fail(ErrorKind.NOT_OWNED, f"Slurm node {slurm} is not held by FleetMedic "
                                            f"('{node.reason}'): no burn-in there")
        self._reserve(request, slurm)
        try:
            if node.out_of_service:
                self.cli.run("scontrol", "update", f"nodename={slurm}", "state=RESUME")
            job_id = self._job(request, before, slurm)
            try:
                return self._wait(request, job_id, held_for)
            except CancelledError:
                # The run let go of the burn-in (an operator's abort, or the run is gone): the job
                # must not go on testing a node nobody waits for. A worker shutting down leaves it
                # to the next attempt, which finds it by the heartbeat's job id.
                if not activity.is_worker_shutdown():
                    self.cli.run("scancel", str(job_id))
                raise
        finally:
            # Out of service again, as the run left it, before anything else may land there.
            self.cli.run("scontrol", "update", f"nodename={slurm}", "state=DRAIN", f"reason={held_for}")
            self.cli.run("scontrol", "delete", f"reservation={reservation_name(request.node)}")

    @staticmethod
    def _before() -> dict[str, Any]:
        """What a previous attempt said in its last heartbeat (its job, the node's reason)."""
        details = activity.info().heartbeat_details if activity.in_activity() else ()
        return details[0] if details and isinstance(details[0], dict) else {}

    def _reserved(self, request: BurnIn) -> bool:
        shown = self.cli.run("scontrol", "show", "reservation", "-o")
        return f"ReservationName={reservation_name(request.node)} " in shown

    def _reserve(self, request: BurnIn, slurm: str) -> None:
        name = reservation_name(request.node)
        if self._reserved(request):
            return
        minutes = max(int(request.deadline_s // 60) + 5, 10)
        self.cli.run("scontrol", "create", f"reservation={name}", f"nodes={slurm}",
                     f"users={getpass.getuser()}", "starttime=now", f"duration={minutes}", "flags=maint,ignore_jobs")

    def _job(self, request: BurnIn, before: dict[str, Any], slurm: str) -> int:
        """This run's burn-in job: the one a previous attempt submitted (its heartbeat, or its name
        when it died before its first heartbeat), else a new one."""
        if before.get("job_id"):
            return int(before["job_id"])
        named = self.cli.run("squeue", "-h", "-t", "all", "-n", job_name(request), "-o", "%i").split()
        if named:
            return int(named[0])
        out = Path(request.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        script = out / f"{job_name(request)}.sh"
        script.write_text(request.script)
        script.chmod(0o755)
        minutes = max(int(request.deadline_s // 60), 1)
        submitted = self.cli.run(
            "sbatch", "--parsable", f"--job-name={job_name(request)}",
            f"--reservation={reservation_name(request.node)}", f"--nodelist={slurm}", "--nodes=1",
            "--no-requeue", f"--time={minutes}",
            f"--output={out / job_name(request)}.out", str(script))
        return int(submitted.strip().split(";")[0])

    def _wait(self, request: BurnIn, job_id: int, held_for: str) -> BurnInResult:
        deadline = time.monotonic() + request.deadline_s
        fields: dict[str, str] = {}
        while time.monotonic() < deadline:
            fields = self._show(job_id)
            if fields.get("JobState") in ENDED:
                break
            activity.heartbeat({"job_id": job_id, "state": fields.get("JobState", ""), "held_for": held_for})
            time.sleep(POLL_S)
        else:
            self.cli.run("scancel", str(job_id))
            return BurnInResult(passed=False, job_id=job_id, state="TIMEOUT", output=self._output(request),
                                detail=f"burn-in job {job_id} did not end within {request.deadline_s:g}s")
        state = fields["JobState"]
        code = int(fields.get("ExitCode", "0:0").split(":")[0] or 0)
        output = self._output(request)
        passed = state == "COMPLETED" and code == 0
        why = f"job {job_id} {state.lower()}, exit code {code}"
        if passed and request.pass_pattern and not re.search(request.pass_pattern, output):
            passed, why = False, f"{why}, but its output does not match {request.pass_pattern!r}"
        return BurnInResult(passed=passed, job_id=job_id, exit_code=code, state=state, output=output, detail=why)

    def _show(self, job_id: int) -> dict[str, str]:
        return scontrol_fields(self.cli.run("scontrol", "show", "job", "-o", str(job_id)))

    def _output(self, request: BurnIn) -> str:
        path = Path(request.output_dir) / f"{job_name(request)}.out"
        try:
            return path.read_text(errors="replace")[-OUTPUT_TAIL:]
        except OSError:
            return ""  # not written (yet), or not shared with this worker

    def activities(self) -> list[Callable[..., Any]]:
        return [self.burn_in]
