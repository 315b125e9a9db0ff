"""Taking a node out, the first half of the skeleton: protective step (cordon + Slurm DRAIN, before
the lease) → lease → out of service → the checkpoint signal and grace → DOWN → requeue → drain."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from datetime import datetime, timedelta
from typing import Any

from temporalio import workflow
from temporalio.exceptions import ActivityError

from workflows.node_base import POLL, RECHECK_AFTER, NodeRunbookBase, NothingToDo, OptedOut
from workflows.runbook import RunbookAborted, abort_alone

with workflow.unsafe.imports_passed_through():
    from fleetmedic import activity_refs as refs
    from fleetmedic.decisions import approval_reason, fresh_checkpoint, left_node
    from fleetmedic.models import (
        ActionResult,
        Checkpoint,
        CheckpointQuery,
        EvictionReport,
        EvictRequest,
        LeaseRequest,
        NodeInfo,
        Protection,
        ProtectRequest,
        RequeueJob,
        SetSlurmNodeState,
        SignalJob,
        SlurmJob,
        SlurmNodeState,
        Taint,
    )


# How long a runbook waits for the fleet guard's answer to a protective kill, and for the killed
# jobs to leave the node, before it leaves them to the lease.
KILL_ANSWER_WAIT = timedelta(seconds=30)


async def _nothing() -> None:
    """The Slurm half of a step when Slurm is not enabled on this worker (gathered beside Kubernetes)."""
    return None


class TakeOutSteps(NodeRunbookBase):
    """Lease, out of service, checkpoints, requeue, drain."""

    async def take_out_and_drain(self, state: SlurmNodeState, reason: str, grace: timedelta, *,
                                 taint: Taint | None = None, drain_selector: str | None = None,
                                 recheck: Callable[[], Awaitable[Any]] | None = None) -> list[SlurmJob]:
        """Lease → out of service (Slurm and Kubernetes together) → grace for checkpoints → requeue
        → drain. `grace`: how long running jobs get to checkpoint. For DOWN, the node is set DRAIN
        first (nothing new lands), each job gets the policy's signal, and DOWN follows a fresh,
        complete checkpoint (or the grace): Slurm's own DOWN would SIGKILL the job KillWait seconds
        after its SIGTERM, whatever the policy's grace. For DRAIN, the grace runs until the jobs'
        next periodic checkpoint. `recheck`: confirms the fault again when the
        lease took long to come (it raises when there is nothing left to do). Returns the jobs
        that ran on the node."""
        await self.protect(reason, taint)
        asked = workflow.now()
        await self.take_lease()
        if recheck is not None and workflow.now() - asked > RECHECK_AFTER:
            await recheck()
        signalled_at = workflow.now()
        signal_first = state is SlurmNodeState.DOWN and self.context.slurm_enabled
        jobs = await self.take_out_of_service(state, reason, taint, drain_while_jobs=signal_first)
        if signal_first and jobs:
            signalled_at = await self.signal_jobs(jobs)
            await self.grace_for_checkpoints(jobs, signalled_at, grace, ended_counts=True)
            await self.slurm_down(reason)
        else:
            await self.grace_for_checkpoints(jobs, signalled_at, grace)
        await self.ensure_requeued(jobs, signalled=signal_first)
        await self.drain(drain_selector)
        killed = {job.job_id for job in self.killed}  # requeued by the protective kill, before the lease
        return [*self.killed, *(job for job in jobs if job.job_id not in killed)]

    # --- protective step ------------------------------------------------------------------------

    async def protect(self, reason: str, taint: Taint | None = None) -> None:
        """Protective first: one read of the node (its opt-out, its pods', its Slurm jobs), then the
        cordon (or `taint`) and Slurm DRAIN together, before the lease. Nothing new lands on the
        node; nothing running there is killed, so a storm of false alerts costs capacity for new
        work, never a job: the steps that kill (DOWN, requeue, drain, replace) still wait for the
        lease. It runs inside the run's workflow task, as a local activity on the worker that holds
        the run: no round trip through the server and no task queue to wait in, however many runs
        wait on drains and replacements. Once per run; an opted-out node is left as it is, a missing
        one ends the run."""
        assert self.policy is not None
        if self.protection is not None:
            return
        self.enter("protect")
        if (why := approval_reason(self.policy.approvals, ("cordon",), 0.0)) is not None and not self.dry_run:
            self.decide("protect", f"nothing before the lease: {why}")
            return
        request = ProtectRequest(node=self.node, workflow_id=self.workflow_id, reason=reason, taint=taint,
                                 slurm=self.context.slurm_enabled, dry_run=self.dry_run, cluster=self.cluster)
        protection = await self.call("protect", refs.PROTECT_NODE, request, retry=self.retry("writes"),
                                     in_task=True, retries_said=self.protect_retries_said)
        if protection is None:
            self.decide("protect", "skipped by an operator: the node stays in service until the lease")
            return
        self.protection, self.protective_taint = protection, taint
        if protection.node is None:
            raise NothingToDo("unknown-node", f"node {self.node} does not exist in Kubernetes: nothing to remediate")
        if protection.opt_out.opted_out:
            raise OptedOut("protect", protection.opt_out.reasons)
        if protection.held is not None:
            await self.held_from_protecting(protection)
            return
        self.out_since = workflow.now()
        self.node_gpus = protection.node.gpu_allocatable
        for action in protection.actions:
            self.actions.append(action)
            self.decide("protect", action.summary)
        if protection.jobs:
            self.decide("protect", "jobs on the node keep running until the lease: " + ", ".join(
                f"{j.job_id} ({j.name})" for j in protection.jobs))
        await self.request_quota_sync("protect")

    async def held_from_protecting(self, protection: Protection) -> None:
        """The cordon breaker (or the fleet pause) held the protective step: nothing was written. The
        run keeps the alert and waits in line for its lease like any destructive step; the steps
        after the lease take the node out."""
        assert self.policy is not None and protection.held is not None and protection.node is not None
        self.node_gpus = protection.node.gpu_allocatable
        self.breaker_held = protection.held_by == "breaker"
        self.breaker_trip = protection.trip
        self.decide("protect", f"nothing cordoned ahead of the lease: {protection.held}")
        if protection.trip is not None:  # this run found the bound: the guard trips on its request
            await self.say(f":no_entry: *cordon breaker tripped* on `{self.node}`: {protection.trip.reason}. "
                           "Runs that alert now wait for their lease, none of them cordoned ahead; a person resets "
                           "the breaker with `fleetmedic breaker reset --by NAME`.",
                           mention=self.policy.escalation.slack_mention)

    async def kill_lost_jobs(self, reason: str) -> None:
        """The XID already killed what ran on the GPU (catalog `job_lost`): the node goes DOWN and its
        jobs are requeued now, before the lease, so they restart elsewhere at once — if the fleet
        guard's storm limit allows (`budget.max_protective_kills_per_minute`); otherwise they wait
        for the lease like any destructive step. The gate of a destructive step applies all the same."""
        assert self.policy is not None
        jobs = self.protection.jobs if self.protection is not None else None
        if not self.protected or self.dry_run or not jobs or not self.context.slurm_enabled:
            return
        self.enter("protective kill")
        if (why := approval_reason(self.policy.approvals, ("slurm_down",), 0.0)) is not None:
            self.decide("protective kill", f"not before the lease: {why}")
            return
        self.kill_answer = None
        try:
            await self.call("protective kill", refs.GUARD_KILL,
                            (self.cluster, LeaseRequest(workflow_id=self.workflow_id, node=self.node)), escalate=False)
        except ActivityError:
            self.decide("protective kill", "could not ask the fleet guard: the jobs wait for the lease")
            return
        if not await self.wait("the fleet guard's answer to a protective kill", lambda: self.kill_answer is not None,
                               timeout=KILL_ANSWER_WAIT):
            self.decide("protective kill", f"no answer from the fleet guard within {KILL_ANSWER_WAIT}: the jobs "
                                           "wait for the lease")
            return
        assert self.kill_answer is not None
        if not self.kill_answer.granted:
            self.decide("protective kill", f"not before the lease: {self.kill_answer.reason}")
            return
        await self.gate("protective kill", ("slurm_down",))
        await self.act("protective kill", refs.SET_SLURM_STATE, SetSlurmNodeState(
            node=self.node, state=SlurmNodeState.DOWN, reason=reason, dry_run=self.dry_run))
        self.killed = tuple(jobs)
        self.decide("protective kill", "job(s) lost to the XID, requeued before the lease: "
                    + ", ".join(f"{j.job_id} ({j.name})" for j in jobs))
        # Slurm requeues them as the node goes DOWN; ours follows once they left the node.
        await self.grace_for_checkpoints(jobs, workflow.now(), KILL_ANSWER_WAIT, ended_counts=True)
        await self.ensure_requeued(jobs)

    # --- Slurm ------------------------------------------------------------------------------------

    async def take_out_of_service(self, state: SlurmNodeState, reason: str, taint: Taint | None = None, *,
                                  drain_while_jobs: bool = False) -> list[SlurmJob]:
        """Slurm DOWN/DRAIN (DOWN sends running jobs SIGTERM) and the Kubernetes cordon, at the same moment.

        The cordon only stops new pods from landing on a node that is going away, so it does not
        wait for the checkpoint grace (the drain does); doing both at once is what takes a bad
        node out of service within a second of the alert. With `taint`, the node is tainted
        instead of cordoned: out for whatever does not tolerate it (training), still open to
        what does (inference). `drain_while_jobs`: DRAIN instead of DOWN while jobs run there
        (they are signalled to checkpoint first). Returns the Slurm jobs that ran there.
        """
        slurm = self.context.slurm_enabled

        async def jobs_on_node() -> list[SlurmJob] | None:
            if not slurm:
                return None
            jobs: list[SlurmJob] | None = await self.call("take out of service", refs.JOBS_ON_NODE, self.node,
                                                          in_task=self.reads_in_task, retries_said=True)
            return jobs

        async def node_read() -> NodeInfo | None:
            # 0.2.0: the protective step's read of the node (its GPUs are what this read was for; a
            # node deleted since then is the gate's `missing`, which ended the run before this).
            if self.reads_in_task:
                return await self.read_node("take out of service")
            node: NodeInfo | None = await self.call("take out of service", refs.GET_NODE, self.node)
            return node

        def read() -> Any:
            return asyncio.gather(jobs_on_node(), node_read())

        # The gate may wait hours (a pause, an approval): read the node's jobs after it, so the
        # jobs we wait for and requeue are the ones SIGTERM actually reaches.
        await self.gate("take out of service", ("cordon", "slurm_down"))
        jobs, node = await read()
        self.node_gpus = node.gpu_allocatable if node else 0
        self.out_since = self.out_since or workflow.now()  # the protective step may have taken it out
        if not slurm:
            self.decide("take out of service", "Slurm: skipped, not enabled on this worker")
        if drain_while_jobs and jobs:
            state = SlurmNodeState.DRAIN
        await asyncio.gather(
            self.act("take out of service", refs.SET_SLURM_STATE,
                     SetSlurmNodeState(node=self.node, state=state, reason=reason, dry_run=self.dry_run))
            if slurm else _nothing(),
            _nothing() if self.protected and taint == self.protective_taint  # done by the protective step
            else self.act("take out of service", refs.CORDON, self.target(reason)) if taint is None
            else self.act("take out of service", refs.ADD_TAINT, self.taint_request(taint, reason)))
        await self.request_quota_sync("take out of service")
        if jobs:
            self.decide("take out of service", "jobs on the node: " + ", ".join(
                f"{j.job_id} ({j.name}, restarts {j.restart_count})" for j in jobs))
        return jobs or []

    async def signal_jobs(self, jobs: list[SlurmJob]) -> datetime:
        """Ask each job on the node to checkpoint (the policy's signal, SIGTERM by default). Returns
        the moment the signals went out: only a checkpoint written after it is fresh."""
        assert self.policy is not None
        self.enter("signal jobs to checkpoint")
        opt_out = await self.before_destructive("signal jobs to checkpoint")
        if opt_out.opted_out:
            raise OptedOut("signal jobs to checkpoint", opt_out.reasons)
        signalled_at = workflow.now()
        for job in jobs:
            await self.act("signal jobs to checkpoint", refs.SIGNAL_JOB, SignalJob(
                job_id=job.job_id, node=self.node, signal=self.policy.grace.signal, dry_run=self.dry_run))
        return signalled_at

    async def slurm_down(self, reason: str) -> None:
        """After the grace: the node DOWN in Slurm, which kills what still runs there (Slurm requeues it)."""
        self.enter("take the node DOWN")
        opt_out = await self.before_destructive("take the node DOWN")
        if opt_out.opted_out:
            raise OptedOut("take the node DOWN", opt_out.reasons)
        await self.act("take the node DOWN", refs.SET_SLURM_STATE,
                       SetSlurmNodeState(node=self.node, state=SlurmNodeState.DOWN, reason=reason,
                                         dry_run=self.dry_run))

    async def grace_for_checkpoints(self, jobs: list[SlurmJob], signalled_at: datetime, grace: timedelta, *,
                                    ended_counts: bool = False) -> dict[int, Checkpoint | None]:
        """Wait until each job wrote a complete checkpoint after the signal, or left the node, at most
        `grace`. `ended_counts`: a job that ended by itself after the signal has left too."""
        self.enter("grace for checkpoints")
        fresh: dict[int, Checkpoint | None] = {}
        if not jobs:
            return fresh
        if self.dry_run:
            self.decide("grace for checkpoints", f"would wait up to {grace} for checkpoints of "
                                                 f"{len(jobs)} job(s)")
            return fresh
        deadline = workflow.now() + grace
        pending = {j.job_id: j for j in jobs}
        while pending and workflow.now() < deadline:
            for job_id, job in list(pending.items()):
                checkpoint = await self.call("grace for checkpoints", refs.NEWEST_CHECKPOINT,
                                             CheckpointQuery(job_id=job_id, job_name=job.name))
                if fresh_checkpoint(checkpoint, signalled_at):
                    assert checkpoint is not None
                    fresh[job_id] = checkpoint
                    del pending[job_id]
                    self.decide("grace for checkpoints", f"job {job_id} checkpointed at step {checkpoint.step} "
                                                         f"({checkpoint.path})")
                    continue
                now_job = await self.call("grace for checkpoints", refs.GET_JOB, job_id)
                if now_job is not None and left_node(now_job, self.node, ended_counts=ended_counts):
                    del pending[job_id]
                    self.decide("grace for checkpoints", f"job {job_id} left the node ({now_job.state.lower()})")
            if pending:
                self.waiting_for = f"checkpoints of job(s) {sorted(pending)} until {deadline.isoformat()}"
                await self.sleep(POLL, summary="grace for checkpoints: poll")
                self.check_abort()
        if pending:
            self.decide("grace for checkpoints", f"grace of {grace} ended without a fresh checkpoint from "
                                                 f"job(s) {sorted(pending)}")
        return fresh

    async def ensure_requeued(self, jobs: list[SlurmJob], signalled: bool = False) -> dict[int, Checkpoint | None]:
        """Every affected job is requeued (by Slurm or by us); record where each resumes from."""
        self.enter("ensure requeue")
        resume_from: dict[int, Checkpoint | None] = {}
        for job in jobs:
            if not job.requeue:
                self.decide("ensure requeue", f"job {job.job_id} is not requeueable (--no-requeue): left to its owner")
                continue
            # A requeue kills a training run: the gate again right before it (a pause or an
            # opt-out set during the grace counts), and only where the job still runs on this node.
            opt_out = await self.before_destructive("ensure requeue")
            if opt_out.opted_out:
                raise OptedOut("ensure requeue", opt_out.reasons)
            request = RequeueJob(job_id=job.job_id, dry_run=self.dry_run, node=self.node, signalled=signalled)
            await self.act("ensure requeue", refs.REQUEUE_JOB, request)
            checkpoint = await self.call("ensure requeue", refs.NEWEST_CHECKPOINT,
                                         CheckpointQuery(job_id=job.job_id, job_name=job.name))
            resume_from[job.job_id] = checkpoint
            self.decide("ensure requeue", f"job {job.job_id} resumes from "
                                          + (f"step {checkpoint.step} ({checkpoint.path})" if checkpoint
                                             else "its start: no checkpoint found"))
        return resume_from

    # --- Kubernetes -----------------------------------------------------------------------------

    async def drain(self, selector: str | None = None) -> EvictionReport | None:
        """Evict the node's pods (PDBs honoured, DaemonSets skipped, a deadline), after the grace.
        Pods still there at the deadline are never passed over silently: the policy's
        `drain.on_blocked` escalates (retry / skip / abort) or proceeds, and the outcome says so."""
        assert self.policy is not None
        await self.gate("drain")
        deadline = self.policy.grace.eviction_deadline
        # Waiting out a PodDisruptionBudget, the drain evicts again whenever it allows, up to the
        # deadline: an operator's abort stops it then, not at the deadline.
        while True:
            report = await self.call(
                "drain", refs.EVICT_PODS,
                EvictRequest(node=self.node, deadline_s=deadline.total_seconds(), dry_run=self.dry_run,
                             workflow_id=self.workflow_id, selector=selector),
                timeout=deadline + timedelta(minutes=1), heartbeat=self.evicting_heartbeat(),
                retry=self.retry("writes"), task_queue=self.waits_queue(),
                until=abort_alone)
            if report is None:
                return None
            self.actions.append(ActionResult(
                system="kubernetes", action="evict", target=f"{len(report.evicted)} pod(s) from node {self.node}",
                changed=bool(report.evicted) and not report.dry_run, dry_run=report.dry_run,
                detail=", ".join(report.evicted)))
            verb = "would evict" if report.dry_run else "evicted"
            text = f"{verb} {len(report.evicted)} pod(s), skipped {len(report.skipped)}"
            if report.failed:
                text += "; could not evict: " + ", ".join(f"{p.pod} ({p.reason})" for p in report.failed)
            self.decide("drain", text)
            if not report.failed or report.dry_run:
                return report
            blocked = tuple(p.pod for p in report.failed)
            if self.policy.drain.on_blocked == "proceed":
                self.left_past_pdb = blocked
                self.decide("drain", f"going on with {len(blocked)} pod(s) still on the node past the eviction "
                                     f"deadline (policy drain.on_blocked: proceed): {', '.join(blocked)}")
                return report
            answer = await self.escalate("drain", f"{len(blocked)} pod(s) still on {self.node} after the eviction "
                                                  f"deadline of {deadline}: {', '.join(blocked)}. Answer retry (evict "
                                                  "again), skip (go on without them) or abort")
            if answer.action == "abort":
                raise RunbookAborted(answer.by, answer.reason or "drain blocked")
            if answer.action == "skip":
                self.left_past_pdb = blocked
                return report
            opt_out = await self.before_destructive("drain")  # retry: the gate again, then evict again
            if opt_out.opted_out:
                raise OptedOut("drain", opt_out.reasons)

