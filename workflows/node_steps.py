"""The shared steps of node runbooks, in the order of the skeleton:

classify → notify start → lease → re-check opt-out → quarantine in Slurm → grace for checkpoints
→ ensure requeue → cordon → drain → remediate → wait for Ready and validate → return to service
→ release lease → verify the job resumed → record outcome.

xid-recovery, hot-gpu-pull and nvlink-fault-replace compose these; none copies them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from datetime import datetime, timedelta
from typing import Any

from temporalio import workflow
from temporalio.common import MetricMeter, SearchAttributeUpdate
from temporalio.exceptions import ActivityError

from workflows.runbook import DryRunEnded, Runbook, RunbookAborted, execute, input_error, local

with workflow.unsafe.imports_passed_through():
    from fleetmedic import activity_refs as refs
    from fleetmedic import ids
    from fleetmedic.lemon import count_since, lemon_count
    from fleetmedic.models import (
        ActionResult,
        Checkpoint,
        CheckpointQuery,
        EvictionReport,
        EvictRequest,
        GpuResetRequest,
        LeaseRequest,
        NodeInfo,
        NodeRunbookInput,
        NodeTarget,
        OptOut,
        ProviderRequest,
        ProviderResult,
        RequeueJob,
        RunbookStatus,
        RunContext,
        SetSlurmNodeState,
        SignalJob,
        SlurmJob,
        SlurmNodeState,
        Taint,
        TaintRequest,
        Validate,
        WaitNodeReady,
    )
    from fleetmedic.policy import Policy
    from fleetmedic.trust import node_name_error

POLL = timedelta(seconds=2)
# How a job that got the checkpoint signal may have ended by itself (it counts as having left).
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED")
# A fault confirmed before a lease that took longer than this to come is confirmed again.
RECHECK_AFTER = timedelta(minutes=1)


async def _nothing() -> None:
    return None


class Rejected(RunbookAborted):
    """An operator rejected a step that needed approval."""


class NothingToDo(Exception):
    """The fault went away before anything was changed (a GPU cooled down): the run ends there."""

    def __init__(self, outcome: str, reason: str) -> None:
        super().__init__(reason)
        self.outcome, self.reason = outcome, reason


class OptedOut(Exception):
    def __init__(self, step: str, reasons: list[str]) -> None:
        super().__init__(f"opted out before {step}: {'; '.join(reasons)}")
        self.step, self.reasons = step, reasons


class NodeRunbook(Runbook):
    """A runbook that takes one node out of service, repairs it and puts it back."""

    context: RunContext
    mutated = False  # any destructive step done (or, in shadow mode, would have been)
    out_since: datetime | None = None  # when the node left service (Slurm DOWN/DRAIN and cordon)
    back_at: datetime | None = None  # when it returned
    node_gpus = 0
    lease_held = False
    # Pods still on the node past the eviction deadline that the run went on without (drain.on_blocked).
    left_past_pdb: tuple[str, ...] = ()

    # --- start ----------------------------------------------------------------------------------

    def _init_run(self, raw: dict[str, Any]) -> NodeRunbookInput:
        """State from the start input. The input arrives as plain JSON (the UI's Start Workflow form,
        the CLI, the webhook) and is validated here, so a bad one fails the run with the reason
        instead of a stuck workflow task."""
        self.invalid = input_error(raw, NodeRunbookInput)
        if self.invalid is None:
            # The node name reaches the Kubernetes API, Slurm and visibility queries: the same rule
            # as the webhook's (fleetmedic/trust.py), whoever started the run.
            self.invalid = node_name_error(str(raw.get("node", "")))
        input = NodeRunbookInput.model_validate(raw) if self.invalid is None else NodeRunbookInput(
            cluster=str(raw.get("cluster") or "?"), node=str(raw.get("node") or "?"))
        self._init_state(input.cluster, input.node, workflow.info().workflow_id, input.dry_run)
        self.input = input
        if input.alert is not None:
            self.remember_alert(input.alert)
        return input

    async def run_to_outcome(self, body: Callable[[], Awaitable[Any]]) -> RunbookStatus:
        """Run the runbook's body; every way out (done, opted out, rejected, aborted) records an
        outcome and gives the lease back. Returns the run's report."""
        self.fail_if_invalid(self.invalid)
        try:
            await body()
        except NothingToDo as nothing:
            await self.release_lease()
            await self.record_outcome(nothing.outcome, nothing.reason)
        except OptedOut as opted:
            await self.stop_for_opt_out(opted)
        except DryRunEnded as ended:
            await self.end_dry_run(ended)
        except Rejected as rejected:
            if self.mutated:
                await self.leave_quarantined(f"{self.step_name} rejected by {rejected.by}: {rejected.reason}")
            await self.record_outcome("rejected", f"rejected by {rejected.by}: {rejected.reason}", warning=True)
        except RunbookAborted as aborted:
            if self.mutated:
                await self.leave_quarantined(f"run aborted by {aborted.by}: {aborted.reason}")
            await self.record_outcome("aborted", f"aborted by {aborted.by}: {aborted.reason}", warning=True)
        await self.release_lease()  # every way out gives the lease back
        return self.status()

    async def stop_for_opt_out(self, opted: OptedOut) -> str:
        assert self.policy is not None
        text = f"opted out before {opted.step}: {'; '.join(opted.reasons)}"
        if self.mutated:
            # Something was already done: leave it as it is, say so, and ask a human.
            await self.say(f":warning: {text}. Steps already taken are left in place.",
                           mention=self.policy.escalation.slack_mention)
        return await self.record_outcome("opted-out", text, warning=self.mutated)

    async def load(self, xid: int | None = None) -> Policy:
        self.enter("load policy")
        # Local activities: the worker's own configuration, no round trip through the task queue.
        policy, context = await asyncio.gather(
            local(refs.CONFIG_POLICY, ()), local(refs.CONFIG_CONTEXT, ()))
        self.policy, self.context = Policy.model_validate(policy), RunContext.model_validate(context)
        served = self.policy.routing.served_clusters
        # Patched: runs recorded before the check existed replay without it.
        if self.cluster not in served and workflow.patched("served-cluster-check"):
            # Each cluster has its own fleet guard: a run for a cluster this deployment does not
            # serve would create a guard of its own and bypass every budget.
            raise NothingToDo("invalid-input", f"cluster {self.cluster!r} is not served by this FleetMedic "
                                               f"(configured: {', '.join(served)})")
        if self.policy.shadow.enabled_for(self.runbook) and not self.dry_run:
            self.dry_run = True
            self.decide("load policy", f"shadow mode for {self.runbook} (policy): nothing will be changed")
        attributes: list[SearchAttributeUpdate[Any]] = [
            ids.FLEET_RUNBOOK.value_set(self.runbook), ids.FLEET_CLUSTER.value_set(self.cluster),
            ids.FLEET_NODE.value_set(self.node), ids.FLEET_DRY_RUN.value_set(self.dry_run)]
        if xid is not None:
            attributes.append(ids.FLEET_XID.value_set(xid))
        workflow.upsert_search_attributes(attributes)
        return self.policy

    def target(self, reason: str = "") -> NodeTarget:
        return NodeTarget(node=self.node, workflow_id=self.workflow_id, reason=reason, dry_run=self.dry_run)

    def taint_request(self, taint: Taint, reason: str = "") -> TaintRequest:
        # The taint holds the node for this run like a cordon does (the same annotations).
        return TaintRequest(node=self.node, taint=taint, dry_run=self.dry_run, workflow_id=self.workflow_id,
                            reason=reason)

    def hears_fleet_pause(self) -> bool:
        return self.lease_held  # the guard tells lease holders (and those in line) of its pause

    async def before_destructive(self, step: str) -> OptOut:
        """The runbook base's gate with the node's opt-out: its label, or a pod's on it, read now."""
        async def node_opt_out() -> OptOut:
            opt_out = await self.call(f"{step}: opt-out check", refs.CHECK_OPT_OUT, self.node)
            if opt_out is None:  # the operator skipped the check: treat as opted out, to be safe
                return OptOut(opted_out=True, reasons=["opt-out check skipped by an operator"])
            return opt_out

        return await self.hold_before_destructive(step, node_opt_out)

    async def gate(self, step: str, kinds: tuple[str, ...] = ()) -> None:
        """The safety gate of a destructive step: pause, approval when policy asks, then the
        opt-out, checked right now. `kinds`: the policy's names for what the step does."""
        self.enter(step)
        await self.approval_for(step, kinds or (step,))
        opt_out = await self.before_destructive(step)
        if opt_out.missing:
            raise NothingToDo("unknown-node", f"node {self.node} does not exist in Kubernetes (before {step})")
        if opt_out.opted_out:
            raise OptedOut(step, opt_out.reasons)
        self.mutated = True

    async def approval_for(self, step: str, kinds: tuple[str, ...]) -> None:
        """Wait for an `approve` Update when policy names the step, or when the fleet is already
        past the policy's level of nodes out of service. Rejection ends the run."""
        assert self.policy is not None
        rules = self.policy.approvals
        out = self.lease_answer.out_fraction if self.lease_answer else 0.0
        why = ("policy asks approval for " + "/".join(k for k in kinds if k in rules.steps)
               if any(k in rules.steps for k in kinds) else
               f"{out:.0%} of GPU nodes are out, above the approval level {rules.above_unavailable_fraction:.0%}"
               if rules.above_unavailable_fraction is not None and out > rules.above_unavailable_fraction else None)
        if why is None or self.dry_run:
            if why:
                self.decide(step, f"would ask for approval: {why}")
            return
        self.awaiting_approval = step
        self.approval = None
        self.decide(step, f"waiting for approval: {why}")
        await self.say(f":raised_hand: *{step}* of `{self.node}` needs approval ({why}): "
                       f"`fleetmedic approve {self.workflow_id}` or `fleetmedic reject {self.workflow_id} --reason …`",
                       mention=self.policy.escalation.slack_mention)
        while not await self.wait(f"approval of {step}", lambda: self.approval is not None, timeout=rules.timeout):
            if rules.on_timeout == "abort":
                self.awaiting_approval = None
                raise RunbookAborted("fleetmedic", f"no approval for {step} within {rules.timeout}")
            await self.say(f":hourglass: *{step}* of `{self.node}` still waits for approval after {rules.timeout}",
                           mention=self.policy.escalation.slack_mention)
            self.decide(step, f"escalated: no approval within {rules.timeout}")
        self.awaiting_approval = None
        assert self.approval is not None
        verdict, approval = self.approval
        self.decide(step, f"{verdict}d by {approval.by}" + (f": {approval.reason}" if approval.reason else ""))
        if verdict == "reject":
            raise Rejected(approval.by, approval.reason)

    # --- disruption lease -------------------------------------------------------------------------

    async def take_lease(self) -> None:
        """Ask the cluster's fleet guard (fleet-guard/<cluster>) and wait for the grant, FIFO."""
        assert self.policy is not None
        self.enter("take disruption lease")
        if self.dry_run:
            self.decide("take disruption lease", "would take a disruption lease (shadow runs hold none)")
            return
        skipped = self.skipped
        node = await self.call("take disruption lease", refs.GET_NODE, self.node)
        if node is None and self.skipped == skipped:
            raise NothingToDo("unknown-node", f"node {self.node} does not exist in Kubernetes: nothing to remediate")
        label = self.policy.budget.topology_label
        domain = node.labels.get(label, "") if node and label else ""
        request = LeaseRequest(workflow_id=self.workflow_id, node=self.node, domain=domain)
        await self.call("take disruption lease", refs.GUARD_REQUEST, (self.cluster, request))
        self.lease_held = True  # from here on, every way out releases it
        timeout = self.policy.budget.lease_timeout if workflow.patched("lease-wait-escalates") else None
        while not await self.wait("lease from the fleet guard",
                                  lambda: self.lease_answer is not None and self.lease_answer.granted, timeout=timeout):
            # Still in line (the budget is in use, the fleet paused, or the guard cannot count the
            # fleet): a person decides — wait again, go on without the lease, or abort.
            told = self.lease_answer
            where = f"position {told.position}, {told.reason}" if told else "no answer from the guard"
            answer = await self.escalate("take disruption lease", f"no disruption lease from fleet-guard/"
                                                                  f"{self.cluster} within {timeout} ({where})")
            if answer.action == "abort":
                raise RunbookAborted(answer.by, answer.reason or "no disruption lease")
            if answer.action == "skip":
                self.decide("take disruption lease", f"{answer.by} overrode the disruption budget: going on "
                                                     "without a lease")
                return
        self.decide("take disruption lease", f"granted by fleet-guard/{self.cluster}"
                    + (f" (domain {domain})" if domain else ""))

    async def release_lease(self) -> None:
        """Never waits for anything but the signal itself: releasing is a recovery step."""
        if not self.lease_held:
            return
        self.enter("release disruption lease")
        try:
            await execute(refs.GUARD_RELEASE, (self.cluster, self.workflow_id),
                          start_to_close_timeout=self.call_timeout(), retry_policy=self.retry(),
                          summary="release disruption lease")
            self.lease_held = False
            self.decide("release disruption lease", "released")
        except ActivityError:
            # The guard reclaims a closed run's lease by itself; say so rather than block.
            self.decide("release disruption lease", "could not signal the guard; it reclaims the lease when this "
                                                    "run closes")

    # --- the skeleton's two halves, shared by every node runbook -----------------------------------

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
        asked = workflow.now()
        await self.take_lease()
        if recheck is not None and workflow.now() - asked > RECHECK_AFTER:
            await recheck()
        signalled_at = workflow.now()
        # Patched: runs recorded before it went DOWN at once and let Slurm's SIGTERM be the signal.
        signal_first = (state is SlurmNodeState.DOWN and self.context.slurm_enabled
                        and workflow.patched("signal-before-down"))
        jobs = await self.take_out_of_service(state, reason, taint, drain_while_jobs=signal_first)
        if signal_first and jobs:
            signalled_at = await self.signal_jobs(jobs)
            await self.grace_for_checkpoints(jobs, signalled_at, grace, ended_counts=True)
            await self.slurm_down(reason)
        else:
            await self.grace_for_checkpoints(jobs, signalled_at, grace)
        await self.ensure_requeued(jobs, signalled=signal_first)
        await self.drain(drain_selector)
        return jobs

    async def return_when_healthy(self, jobs: list[SlurmJob], requested_at: datetime, summary: str, *,
                                  rejoined: bool = True, taint: Taint | None = None) -> str:
        """Wait for Ready and validate → return to service → release the lease → confirm the jobs
        resumed → record the outcome. A node that does not come back healthy stays quarantined."""
        if not await self.wait_back_and_validate(requested_at, self.node_gpus or None, rejoined=rejoined):
            await self.leave_quarantined(f"not back in service after {summary}: see {self.workflow_id}")
            await self.release_lease()
            return await self.record_outcome("quarantined", f"node {self.node} did not come back healthy; "
                                                            "left out of service", warning=True)
        await self.return_to_service(resume_slurm=True, taint=taint)
        await self.release_lease()
        stuck = await self.confirm_jobs_resumed(jobs)
        summary += "; node back in service"
        if jobs:
            summary += f"; {len(jobs) - len(stuck)}/{len(jobs)} job(s) resumed"
        if self.left_past_pdb:
            summary += (f" ({len(self.left_past_pdb)} pod(s) left on the node past their PodDisruptionBudget: "
                        f"{', '.join(self.left_past_pdb)})")
        return await self.record_outcome("remediated", summary, warning=bool(stuck or self.left_past_pdb))

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
            jobs: list[SlurmJob] | None = await self.call("take out of service", refs.JOBS_ON_NODE, self.node)
            return jobs

        def read() -> Any:
            return asyncio.gather(jobs_on_node(), self.call("take out of service", refs.GET_NODE, self.node))

        if workflow.patched("read-jobs-after-the-gate"):
            # The gate may wait hours (a pause, an approval): read the node's jobs after it, so the
            # jobs we wait for and requeue are the ones SIGTERM actually reaches.
            await self.gate("take out of service", ("cordon", "slurm_down"))
            jobs, node = await read()
        else:  # runs recorded before the patch read and gated together
            (jobs, node), _ = await asyncio.gather(read(), self.gate("take out of service",
                                                                      ("cordon", "slurm_down")))
        self.node_gpus = node.gpu_allocatable if node else 0
        self.out_since = workflow.now()
        if not slurm:
            self.decide("take out of service", "Slurm: skipped, not enabled on this worker")
        if drain_while_jobs and jobs:
            state = SlurmNodeState.DRAIN
        await asyncio.gather(
            self.act("take out of service", refs.SET_SLURM_STATE,
                     SetSlurmNodeState(node=self.node, state=state, reason=reason, dry_run=self.dry_run))
            if slurm else _nothing(),
            self.act("take out of service", refs.CORDON, self.target(reason)) if taint is None
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
                if checkpoint is not None and checkpoint.modified >= signalled_at:
                    fresh[job_id] = checkpoint
                    del pending[job_id]
                    self.decide("grace for checkpoints", f"job {job_id} checkpointed at step {checkpoint.step} "
                                                         f"({checkpoint.path})")
                    continue
                now_job = await self.call("grace for checkpoints", refs.GET_JOB, job_id)
                if now_job is not None and (self.node not in now_job.nodes or now_job.state == "PENDING"
                                            or ended_counts and now_job.state in ENDED):
                    del pending[job_id]
                    self.decide("grace for checkpoints", f"job {job_id} left the node ({now_job.state.lower()})")
            if pending:
                self.waiting_for = f"checkpoints of job(s) {sorted(pending)} until {deadline.isoformat()}"
                await workflow.sleep(POLL, summary="grace for checkpoints: poll")
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
            if workflow.patched("requeue-gated"):
                # A requeue kills a training run: the gate again right before it (a pause or an
                # opt-out set during the grace counts), and only where the job still runs on this node.
                opt_out = await self.before_destructive("ensure requeue")
                if opt_out.opted_out:
                    raise OptedOut("ensure requeue", opt_out.reasons)
                request = RequeueJob(job_id=job.job_id, dry_run=self.dry_run, node=self.node, signalled=signalled)
            else:
                request = RequeueJob(job_id=job.job_id, dry_run=self.dry_run)
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
        while True:
            report = await self.call(
                "drain", refs.EVICT_PODS,
                EvictRequest(node=self.node, deadline_s=deadline.total_seconds(), dry_run=self.dry_run,
                             workflow_id=self.workflow_id, selector=selector),
                timeout=deadline + timedelta(minutes=1), heartbeat=self.call_timeout(),
                retry=self.retry("writes"))
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
            if not report.failed or report.dry_run or not workflow.patched("drain-on-blocked"):
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

    # --- remediation ------------------------------------------------------------------------------

    def idempotency_key(self, action: str) -> str:
        return f"{self.workflow_id}/{workflow.info().first_execution_run_id}/{action}"

    async def ask_provider(self, action: str, reason: str) -> ProviderResult | None:
        """One provider request per action and run (the idempotency key makes retries the same request);
        a provider that needs a person makes the run wait for `replaced`."""
        assert self.policy is not None
        await self.gate(action, (action,))
        result = await self.call(action, refs.PROVIDER_REQUEST, ProviderRequest(
            cluster=self.cluster, node=self.node, action=action, reason=reason,
            idempotency_key=self.idempotency_key(action), dry_run=self.dry_run), retry=self.retry("writes"))
        if result is None:
            return None
        self.actions.append(ActionResult(system="provider", action=f"ask {result.provider} to {action}",
                                         target=f"node {self.node}", changed=not result.dry_run,
                                         dry_run=result.dry_run, detail=result.reference))
        self.decide(action, f"{result.provider}: {result.detail or 'accepted'}"
                    + (f" (ref {result.reference})" if result.reference else ""))
        if result.needs_human and action == "rma":
            await self.say(f":package: RMA of `{self.node}` needs a person: {result.detail}",
                           mention=self.policy.escalation.slack_mention)
        elif result.needs_human and not self.dry_run:
            await self.say(f":wrench: {action} of `{self.node}` needs a person: {result.detail}",
                           mention=self.policy.escalation.slack_mention)
            deadline = self.policy.grace.node_ready_deadline
            if not await self.wait(f"signal `replaced` from the person doing the {action}",
                                   lambda: self.replaced_signal is not None, timeout=deadline):
                answer = await self.escalate(action, f"nobody signalled `replaced` within {deadline}")
                if answer.action == "retry":
                    await self.wait("signal `replaced`", lambda: self.replaced_signal is not None)
            if self.replaced_signal is not None:
                self.decide(action, f"{self.replaced_signal.by} says the node was {action}d"
                            + (f" as {self.replaced_signal.new_node}" if self.replaced_signal.new_node else ""))
                if self.replaced_signal.new_node:
                    self.node = self.replaced_signal.new_node
        return result

    async def reset_gpu(self, gpu: int, reason: str) -> str:
        """Reset through the node agent when it can; otherwise the policy's fallback. Returns what ran."""
        assert self.policy is not None
        if self.context.agent_configured and await self.call("reset", refs.AGENT_AVAILABLE, self.node):
            await self.gate("reset")
            result = await self.act("reset", refs.AGENT_RESET_GPU, GpuResetRequest(node=self.node, gpu=gpu,
                                                                                    dry_run=self.dry_run))
            if result is not None:
                return "reset"
        fallback = self.policy.xid.reset_fallback
        self.decide("reset", f"no node agent can reset GPU {gpu}: falling back to {fallback} (policy)")
        await self.ask_provider(fallback, reason)
        return fallback

    # --- lemon nodes ---------------------------------------------------------------------------

    async def is_lemon(self) -> int:
        """How many times this node was taken out within the lemon window, this run included, when
        that reaches the policy's count (0 otherwise)."""
        assert self.policy is not None
        since = workflow.now() - self.policy.lemon.window
        before = await self.call("lemon check", refs.COUNT_REMEDIATIONS, (self.cluster, self.node, since)) or 0
        if workflow.patched("lemon-count-on-node"):
            # The node's own record outlives Temporal's retention of closed runs.
            node = await self.call("lemon check", refs.GET_NODE, self.node)
            on_node = count_since(node.annotations.get(self.policy.labels.remediations_annotation), since,
                                  exclude_run=workflow.info().run_id) if node else 0
            before = lemon_count(before, on_node)
        count = before + 1
        if count >= self.policy.lemon.count:
            self.decide("lemon check", f"remediation #{count} of {self.node} within {self.policy.lemon.window}: "
                                       f"a lemon node, it goes out for RMA instead of another round")
            return count
        self.decide("lemon check", f"remediation #{count} within {self.policy.lemon.window} "
                                   f"(lemon at {self.policy.lemon.count})")
        return 0

    async def retire_lemon(self, count: int, state: SlurmNodeState, why: str) -> str:
        """Out of service for good: drained, RMA requested, left quarantined and annotated."""
        assert self.policy is not None
        reason = f"fleetmedic: lemon node, {count} remediations in {self.policy.lemon.window} ({self.workflow_id})"
        await self.take_out_and_drain(state, reason, self.policy.grace.checkpoint)
        await self.ask_provider("rma", f"{why}; {count} remediations within {self.policy.lemon.window}")
        await self.leave_quarantined(f"lemon node: {count} remediations within {self.policy.lemon.window}; "
                                     "RMA requested")
        await self.release_lease()
        return await self.record_outcome("lemon", f"{self.node} retired for RMA after {count} remediations",
                                         warning=True)

    # --- back in service ----------------------------------------------------------------------

    async def wait_back_and_validate(self, requested_at: datetime, expected_gpus: int | None,
                                     rejoined: bool = True) -> bool:
        """Durable wait for the node to be Ready, then the agent's verdict.

        `rejoined`: the node was replaced or rebooted, so only a Ready transition after
        `requested_at` counts (the old Ready status is stale). An in-place GPU reset keeps the
        node Ready; there the agent's validation (no XID since the reset) is the proof.
        """
        assert self.policy is not None
        self.enter("wait for node Ready")
        if self.dry_run:
            self.decide("wait for node Ready", "would wait for the node to come back Ready and validate it")
            return True
        deadline = workflow.now() + self.policy.grace.node_ready_deadline
        since = requested_at.replace(microsecond=0)  # Ready transitions have second precision
        back: NodeInfo | None = None
        while back is None and workflow.now() < deadline:
            self.waiting_for = f"node {self.node} Ready after {requested_at.isoformat()} (until {deadline.isoformat()})"
            window = min(deadline - workflow.now(), timedelta(minutes=5))
            back = await self.call(
                "wait for node Ready", refs.WAIT_NODE_READY,
                WaitNodeReady(node=self.node, since=since if rejoined and not self.replaced_signal else None,
                              timeout_s=max(window.total_seconds(), 1)),
                timeout=window + self.call_timeout(), heartbeat=self.call_timeout(),
                summary="wait for node Ready: watch")
            self.check_abort()
        if back is None:
            self.decide("wait for node Ready", f"node {self.node} did not come back Ready within "
                                               f"{self.policy.grace.node_ready_deadline}")
            return False
        self.decide("wait for node Ready", f"node {self.node} Ready since {back.ready_since}")
        self.enter("validate")
        verdict = await self.call("validate", refs.AGENT_VALIDATE,
                                  Validate(node=self.node, since=requested_at, expected_gpus=expected_gpus))
        if verdict is None or not verdict.available:
            self.decide("validate", "skipped: " + (verdict.detail if verdict else "skipped by an operator"))
            return True
        failed = [f"{c.name}={c.value}" for c in verdict.checks if not c.passed]
        self.decide("validate", "passed" if verdict.passed else f"failed: {', '.join(failed)}")
        return verdict.passed

    async def return_to_service(self, resume_slurm: bool, taint: Taint | None = None) -> None:
        """Recovery steps: never gated by a pause or a lease (a paused fleet must still heal)."""
        self.enter("return to service")
        self.back_at = workflow.now()
        if taint is not None:
            await self.act("return to service", refs.REMOVE_TAINT, self.taint_request(taint))
        await self.act("return to service", refs.UNCORDON, self.target())
        if resume_slurm and self.context.slurm_enabled:
            await self.act("return to service", refs.SET_SLURM_STATE,
                           SetSlurmNodeState(node=self.node, state=SlurmNodeState.RESUME, dry_run=self.dry_run))
        await self.request_quota_sync("return to service")

    async def request_quota_sync(self, step: str) -> None:
        """The node's GPUs left or rejoined the fleet: Kueue's quotas follow (kueue-quota-sync).
        Never holds the runbook up: the Schedule catches up if this cannot start it."""
        assert self.policy is not None
        if self.dry_run or not self.policy.kueue.enabled or not workflow.patched("kueue-sync-on-node-change"):
            return
        try:
            await execute(refs.REQUEST_QUOTA_SYNC, self.cluster, start_to_close_timeout=self.call_timeout(),
                          retry_policy=self.retry(), summary=f"{step}: sync Kueue quotas")
            self.decide(step, f"Kueue quota sync asked (kueue-quota-sync/{self.cluster})")
        except ActivityError:
            self.decide(step, "could not start the Kueue quota sync; its schedule catches up")

    async def confirm_jobs_resumed(self, jobs: list[SlurmJob]) -> list[int]:
        """The requeued jobs run again (RUNNING, restart count up). Returns those that did not."""
        assert self.policy is not None
        self.enter("confirm jobs resumed")
        if self.dry_run or not jobs:
            return []
        deadline = workflow.now() + self.policy.grace.job_resume_deadline
        pending = {j.job_id: j for j in jobs if j.requeue}
        while pending and workflow.now() < deadline:
            for job_id, before in list(pending.items()):
                job = await self.call("confirm jobs resumed", refs.GET_JOB, job_id)
                if job is not None and job.state == "RUNNING" and job.restart_count > before.restart_count:
                    self.decide("confirm jobs resumed", f"job {job_id} runs again on {', '.join(job.nodes)} "
                                                        f"(restart {job.restart_count})")
                    del pending[job_id]
            if pending:
                self.waiting_for = f"job(s) {sorted(pending)} running again"
                await workflow.sleep(POLL, summary="confirm jobs resumed: poll")
        for job_id in pending:
            self.decide("confirm jobs resumed", f"job {job_id} did not run again within "
                                                f"{self.policy.grace.job_resume_deadline}")
        return sorted(pending)

    async def leave_quarantined(self, why: str) -> None:
        """The node stays out, and says why: never cordoned without an open run or an annotation."""
        assert self.policy is not None
        self.enter("leave quarantined")
        await self.act("leave quarantined", refs.ANNOTATE_QUARANTINE, self.target(f"fleetmedic: {why} "
                                                                                   f"({self.workflow_id})"))
        await self.say(f":warning: `{self.node}` stays out of service: {why}",
                       mention=self.policy.escalation.slack_mention)

    def record_metrics(self, outcome: str) -> MetricMeter:
        """Also time to repair and GPU-hours lost."""
        meter = super().record_metrics(outcome)
        meter.create_histogram_timedelta("fleetmedic_time_to_repair", "alert to outcome").record(
            workflow.now() - workflow.info().start_time)
        if self.out_since is not None and not self.dry_run:
            out_for = ((self.back_at or workflow.now()) - self.out_since).total_seconds()
            meter.create_histogram_float("fleetmedic_gpu_hours_lost", "GPU-hours out of service per run",
                                         "h").record(self.node_gpus * out_for / 3600)
        return meter


def gpu_name(gpu: int | None) -> str:
    return "?" if gpu is None else str(gpu)
