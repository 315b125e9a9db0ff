"""The shared steps of node runbooks, in the order of the skeleton:

classify → notify start → lease → re-check opt-out → quarantine in Slurm → grace for checkpoints
→ ensure requeue → cordon → drain → remediate → wait for Ready and validate → return to service
→ release lease → verify the job resumed → record outcome.

xid-recovery, hot-gpu-pull and nvlink-fault-replace compose these; none copies them.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from temporalio import workflow
from temporalio.common import SearchAttributeUpdate
from temporalio.exceptions import ActivityError

from workflows.runbook import NO_ARG, Runbook

with workflow.unsafe.imports_passed_through():
    from fleetmedic import ids
    from fleetmedic.models import (
        ActionResult,
        Checkpoint,
        CheckpointQuery,
        EventRequest,
        EvictionReport,
        EvictRequest,
        GpuResetRequest,
        NodeInfo,
        NodeTarget,
        ProviderRequest,
        ProviderResult,
        RequeueJob,
        RunContext,
        SetSlurmNodeState,
        SlurmJob,
        SlurmNodeState,
        Validate,
        Validation,
    )
    from fleetmedic.policy import Policy

POLL = timedelta(seconds=2)
NODE_POLL = timedelta(seconds=5)


class OptedOut(Exception):
    def __init__(self, step: str, reasons: list[str]) -> None:
        super().__init__(f"opted out before {step}: {'; '.join(reasons)}")
        self.step, self.reasons = step, reasons


class NodeRunbook(Runbook):
    """A runbook that takes one node out of service, repairs it and puts it back."""

    context: RunContext
    mutated = False  # any destructive step done (or, in shadow mode, would have been)

    # --- start ----------------------------------------------------------------------------------

    async def load(self, xid: int | None = None) -> Policy:
        self.enter("load policy")
        policy = await self.call("load policy", "config.policy", NO_ARG, Policy)
        context = await self.call("load policy", "config.context", NO_ARG, RunContext)
        assert policy is not None and context is not None, "policy and context cannot be skipped"
        self.policy, self.context = policy, context
        if policy.shadow.enabled_for(self.runbook) and not self.dry_run:
            self.dry_run = True
            self.decide("load policy", f"shadow mode for {self.runbook} (policy): nothing will be changed")
        attributes: list[SearchAttributeUpdate[Any]] = [
            ids.FLEET_RUNBOOK.value_set(self.runbook), ids.FLEET_CLUSTER.value_set(self.cluster),
            ids.FLEET_NODE.value_set(self.node), ids.FLEET_DRY_RUN.value_set(self.dry_run)]
        if xid is not None:
            attributes.append(ids.FLEET_XID.value_set(xid))
        workflow.upsert_search_attributes(attributes)
        return policy

    def target(self, reason: str = "") -> NodeTarget:
        return NodeTarget(node=self.node, workflow_id=self.workflow_id, reason=reason, dry_run=self.dry_run)

    async def gate(self, step: str) -> None:
        """The safety gate of a destructive step: pause, then opt-out, checked right now."""
        self.enter(step)
        opt_out = await self.before_destructive(step)
        if opt_out.opted_out:
            raise OptedOut(step, opt_out.reasons)
        self.mutated = True

    # --- disruption lease -------------------------------------------------------------------------

    async def take_lease(self) -> None:
        self.enter("take disruption lease")
        # The fleet guard (fleet-safety issue) grants leases; until it runs, the step records
        # that it let the run through so the history shows where the lease will be taken.
        self.decide("take disruption lease", "granted: no fleet guard configured (pass-through)")

    async def release_lease(self) -> None:
        self.enter("release disruption lease")
        self.decide("release disruption lease", "released (pass-through)")

    # --- Slurm ------------------------------------------------------------------------------------

    async def quarantine_in_slurm(self, state: SlurmNodeState, reason: str) -> list[SlurmJob]:
        """Take the node out of Slurm (running jobs get SIGTERM); return the jobs that ran there."""
        if not self.context.slurm_enabled:
            self.decide("quarantine in Slurm", "skipped: Slurm is not enabled on this worker")
            return []
        jobs = await self.call("quarantine in Slurm", "slurm.jobs_on_node", self.node, list[SlurmJob]) or []
        await self.gate("quarantine in Slurm")
        await self.act("quarantine in Slurm", "slurm.set_node_state",
                       SetSlurmNodeState(node=self.node, state=state, reason=reason, dry_run=self.dry_run))
        if jobs:
            self.decide("quarantine in Slurm", "jobs on the node: " + ", ".join(
                f"{j.job_id} ({j.name}, restarts {j.restart_count})" for j in jobs))
        return jobs

    async def grace_for_checkpoints(self, jobs: list[SlurmJob], signalled_at: datetime,
                                    grace: timedelta) -> dict[int, Checkpoint | None]:
        """Wait until each job wrote a checkpoint after SIGTERM or left the node, at most `grace`."""
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
                checkpoint = await self.call("grace for checkpoints", "storage.newest_checkpoint",
                                             CheckpointQuery(job_id=job_id, job_name=job.name), Checkpoint)
                if checkpoint is not None and checkpoint.modified >= signalled_at:
                    fresh[job_id] = checkpoint
                    del pending[job_id]
                    self.decide("grace for checkpoints", f"job {job_id} checkpointed at step {checkpoint.step} "
                                                         f"({checkpoint.path})")
                    continue
                now_job = await self.call("grace for checkpoints", "slurm.get_job", job_id, SlurmJob)
                if now_job is not None and (self.node not in now_job.nodes or now_job.state == "PENDING"):
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

    async def ensure_requeued(self, jobs: list[SlurmJob]) -> dict[int, Checkpoint | None]:
        """Every affected job is requeued (by Slurm or by us); record where each resumes from."""
        self.enter("ensure requeue")
        resume_from: dict[int, Checkpoint | None] = {}
        for job in jobs:
            if not job.requeue:
                self.decide("ensure requeue", f"job {job.job_id} is not requeueable (--no-requeue): left to its owner")
                continue
            await self.act("ensure requeue", "slurm.requeue_job", RequeueJob(job_id=job.job_id, dry_run=self.dry_run))
            checkpoint = await self.call("ensure requeue", "storage.newest_checkpoint",
                                         CheckpointQuery(job_id=job.job_id, job_name=job.name), Checkpoint)
            resume_from[job.job_id] = checkpoint
            self.decide("ensure requeue", f"job {job.job_id} resumes from "
                                          + (f"step {checkpoint.step} ({checkpoint.path})" if checkpoint
                                             else "its start: no checkpoint found"))
        return resume_from

    # --- Kubernetes -----------------------------------------------------------------------------

    async def cordon_and_drain(self, reason: str, selector: str | None = None) -> EvictionReport | None:
        assert self.policy is not None
        await self.gate("cordon")
        await self.act("cordon", "k8s.cordon_node", self.target(reason))
        await self.gate("drain")
        deadline = self.policy.grace.eviction_deadline
        report = await self.call(
            "drain", "k8s.evict_pods",
            EvictRequest(node=self.node, deadline_s=deadline.total_seconds(), dry_run=self.dry_run,
                         workflow_id=self.workflow_id, selector=selector),
            EvictionReport, timeout=deadline + timedelta(minutes=1), heartbeat=self.call_timeout(),
            retry=self.retry("writes"))
        if report is not None:
            self.actions.append(ActionResult(
                system="kubernetes", action="evict", target=f"{len(report.evicted)} pod(s) from node {self.node}",
                changed=bool(report.evicted) and not report.dry_run, dry_run=report.dry_run,
                detail=", ".join(report.evicted)))
            verb = "would evict" if report.dry_run else "evicted"
            text = f"{verb} {len(report.evicted)} pod(s), skipped {len(report.skipped)}"
            if report.failed:
                text += "; could not evict: " + ", ".join(f"{p.pod} ({p.reason})" for p in report.failed)
            self.decide("drain", text)
        return report

    # --- remediation ------------------------------------------------------------------------------

    def idempotency_key(self, action: str) -> str:
        return f"{self.workflow_id}/{workflow.info().first_execution_run_id}/{action}"

    async def ask_provider(self, action: str, reason: str) -> ProviderResult | None:
        """One provider request per action and run (the idempotency key makes retries the same request);
        a provider that needs a person makes the run wait for `replaced`."""
        assert self.policy is not None
        await self.gate(action)
        result = await self.call(action, "provider.request", ProviderRequest(
            cluster=self.cluster, node=self.node, action=action, reason=reason,
            idempotency_key=self.idempotency_key(action), dry_run=self.dry_run), ProviderResult,
            retry=self.retry("writes"))
        if result is None:
            return None
        self.actions.append(ActionResult(system="provider", action=f"ask {result.provider} to {action}",
                                         target=f"node {self.node}", changed=not result.dry_run,
                                         dry_run=result.dry_run, detail=result.reference))
        self.decide(action, f"{result.provider}: {result.detail or 'accepted'}"
                    + (f" (ref {result.reference})" if result.reference else ""))
        if result.needs_human and not self.dry_run:
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
        if self.context.agent_configured and await self.call("reset", "agent.available", self.node, bool):
            await self.gate("reset")
            result = await self.act("reset", "agent.reset_gpu", GpuResetRequest(node=self.node, gpu=gpu,
                                                                                  dry_run=self.dry_run))
            if result is not None:
                return "reset"
        fallback = self.policy.xid.reset_fallback
        self.decide("reset", f"no node agent can reset GPU {gpu}: falling back to {fallback} (policy)")
        await self.ask_provider(fallback, reason)
        return fallback

    # --- back in service ----------------------------------------------------------------------

    async def wait_back_and_validate(self, requested_at: datetime, expected_gpus: int | None) -> bool:
        """Durable wait for the node to be Ready again after `requested_at`, then the agent's verdict."""
        assert self.policy is not None
        self.enter("wait for node Ready")
        if self.dry_run:
            self.decide("wait for node Ready", "would wait for the node to come back Ready and validate it")
            return True
        deadline = workflow.now() + self.policy.grace.node_ready_deadline
        back: NodeInfo | None = None
        while workflow.now() < deadline:
            node = await self._read_node()
            if node is not None and node.ready and (
                    (node.ready_since is not None and node.ready_since >= requested_at.replace(microsecond=0))
                    or self.replaced_signal is not None):
                back = node
                break
            self.waiting_for = f"node {self.node} Ready after {requested_at.isoformat()} (until {deadline.isoformat()})"
            await workflow.sleep(NODE_POLL, summary="wait for node Ready: poll")
            self.check_abort()
        if back is None:
            self.decide("wait for node Ready", f"node {self.node} did not come back Ready within "
                                               f"{self.policy.grace.node_ready_deadline}")
            return False
        self.decide("wait for node Ready", f"node {self.node} Ready since {back.ready_since}")
        self.enter("validate")
        verdict = await self.call("validate", "agent.validate",
                                  Validate(node=self.node, since=requested_at, expected_gpus=expected_gpus), Validation)
        if verdict is None or not verdict.available:
            self.decide("validate", "skipped: " + (verdict.detail if verdict else "skipped by an operator"))
            return True
        failed = [f"{c.name}={c.value}" for c in verdict.checks if not c.passed]
        self.decide("validate", "passed" if verdict.passed else f"failed: {', '.join(failed)}")
        return verdict.passed

    async def _read_node(self) -> NodeInfo | None:
        try:
            node: NodeInfo = await workflow.execute_activity("k8s.get_node", self.node, result_type=NodeInfo,
                                                   start_to_close_timeout=self.call_timeout(),
                                                   retry_policy=self.retry(),
                                                   summary="wait for node Ready: k8s.get_node")
            return node
        except ActivityError:  # NotFound while a replacement registers: keep waiting
            return None

    async def return_to_service(self, resume_slurm: bool) -> None:
        """Recovery steps: never gated by a pause or a lease (a paused fleet must still heal)."""
        self.enter("return to service")
        await self.act("return to service", "k8s.uncordon_node", self.target())
        if resume_slurm and self.context.slurm_enabled:
            await self.act("return to service", "slurm.set_node_state",
                           SetSlurmNodeState(node=self.node, state=SlurmNodeState.RESUME, dry_run=self.dry_run))

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
                job = await self.call("confirm jobs resumed", "slurm.get_job", job_id, SlurmJob)
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
        await self.act("leave quarantined", "k8s.annotate_quarantine", self.target(f"fleetmedic: {why} "
                                                                                   f"({self.workflow_id})"))
        await self.say(f":warning: `{self.node}` stays out of service: {why}",
                       mention=self.policy.escalation.slack_mention)

    async def record_outcome(self, outcome: str, message: str, warning: bool = False) -> str:
        self.enter("record outcome")
        event = EventRequest(name=self.node, reason=f"FleetMedic{outcome.title().replace('-', '')}",
                             message=f"{self.runbook} ({self.workflow_id}): {message}",
                             type="Warning" if warning else "Normal", dry_run=self.dry_run)
        try:
            await self.call("record outcome", "k8s.record_event", event, ActionResult, escalate=False)
        except ActivityError:
            workflow.logger.warning("could not record the outcome Event; the history still has it")
        prefix = "shadow run: " if self.dry_run else ""
        await self.say(f"*{outcome}*: {prefix}{message}")
        self.decide("record outcome", f"{outcome}: {message}")
        return self.finish(outcome)
