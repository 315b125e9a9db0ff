"""What every node runbook stands on: its state, its start, the safety gate with the policy's
approvals, the disruption lease, and its ways out (outcome, quarantine, metrics).

The stages that act on the node live in their own modules, in the order of the skeleton —
take out (`node_take_out.py`), remediate (`node_remediate.py`), back in service
(`node_return.py`) — and `node_runbook.py` puts them together.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from datetime import datetime, timedelta
from typing import Any

from temporalio import workflow
from temporalio.common import MetricMeter, SearchAttributeUpdate
from temporalio.exceptions import ActivityError

from workflows.runbook import DryRunEnded, Runbook, RunbookAborted, configuration, execute, input_error

with workflow.unsafe.imports_passed_through():
    from fleetmedic import activity_refs as refs
    from fleetmedic import ids
    from fleetmedic.decisions import approval_reason
    from fleetmedic.models import (
        BreakerTrip,
        KillAnswer,
        LeaseRequest,
        NodeInfo,
        NodeRunbookInput,
        NodeTarget,
        OptOut,
        Protection,
        RunbookStatus,
        RunContext,
        SetSlurmNodeState,
        SlurmJob,
        SlurmNodeState,
        Taint,
        TaintRequest,
    )
    from fleetmedic.policy import Policy, shared
    from fleetmedic.trust import node_name_error

POLL = timedelta(seconds=2)
# 0.2.0's changes to a node run's steps, behind one patch decided at the top of the run, before its
# first local activity (docs/upgrading.md). One marker and one TemporalChangeVersion upsert a run
# rather than one per change, all in the first workflow task, the one an alert waits on:
# - the worker's policy and context read in one local activity (`config.run`): one activation of
#   that task fewer;
# - the protective step's retries in the workflow, each failure said in the run's status;
# - a replacement's Slurm node held (DRAIN) again once its slurmd registered: with Slinky it did
#   not exist when the run took the new node in;
# - the gate's opt-out read inside the workflow task that then schedules the destructive step (a
#   local activity): one activity task and one workflow task fewer at each gate, the read as close
#   to the step as it can be;
# - the reads between two steps inside the workflow task that asks for them (local activities, each
#   failed try said in the status): the lemon count in the first task, right after the protective
#   step; the node's Slurm jobs in the task that takes it out of service, whose Kubernetes node is
#   the protective step's read (a node deleted since is the gate's `missing`). Each was an activity
#   task and a workflow task for its answer, while a storm's first tasks wait for the same cores.
# 0.1.0's runs keep their steps: two reads, the local activity's own retries, one DRAIN at take-in,
# `k8s.check_opt_out`, `temporal.count_remediations`, `slurm.jobs_on_node` and `k8s.get_node` on the
# task queue.
NODE_STEPS_0_2 = "node-steps-0.2.0"
# A fault confirmed before a lease that took longer than this to come is confirmed again.
RECHECK_AFTER = timedelta(minutes=1)


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


class NodeRunbookBase(Runbook):
    """A runbook about one node: its state, the gate, the lease and the ways out."""

    context: RunContext
    mutated = False  # any destructive step done (or, in shadow mode, would have been)
    # The protective step (cordon or taint + Slurm DRAIN, before the lease): what it read and did.
    protection: Protection | None = None
    protective_taint: Taint | None = None
    # The protective step held by the cordon breaker (no lease while it is tripped), and the counts
    # when this run's step was the one that found its bound reached (the guard trips on them).
    breaker_held = False
    breaker_trip: BreakerTrip | None = None
    # 0.2.0's steps (NODE_STEPS_0_2, decided in `load`), by what each changes.
    protect_retries_said = False
    hold_registered = False
    reads_in_task = False  # the gate's opt-out, the lemon count and the take-out's jobs: local activities
    watches_early_alerts = False  # xid-recovery's watch looks at alerts that came before it began
    confirms_alerted_gpus = False  # hot-gpu-pull reads every GPU its alerts name, not the first's alone
    kill_answer: KillAnswer | None = None  # the fleet guard's answer to a protective kill
    killed: tuple[SlurmJob, ...] = ()  # jobs requeued by the protective kill (their XID had killed them)
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
            if self.protected and not self.mutated and not self.dry_run:
                # The fault went away before anything destructive: the protective step comes off.
                await self.return_to_service(resume_slurm=True, taint=self.protective_taint)
            await self.record_outcome(nothing.outcome, nothing.reason)
        except OptedOut as opted:
            await self.stop_for_opt_out(opted)
        except DryRunEnded as ended:
            await self.end_dry_run(ended)
        except Rejected as rejected:
            if self.mutated or self.protected:
                await self.leave_quarantined(f"{self.step_name} rejected by {rejected.by}: {rejected.reason}")
            await self.record_outcome("rejected", f"rejected by {rejected.by}: {rejected.reason}", warning=True)
        except RunbookAborted as aborted:
            if self.mutated or self.protected:
                await self.leave_quarantined(f"run aborted by {aborted.by}: {aborted.reason}")
            await self.record_outcome("aborted", f"aborted by {aborted.by}: {aborted.reason}", warning=True)
        await self.release_lease()  # every way out gives the lease back
        return self.status()

    async def stop_for_opt_out(self, opted: OptedOut) -> str:
        assert self.policy is not None
        text = f"opted out before {opted.step}: {'; '.join(opted.reasons)}"
        changed = self.mutated or self.protected
        if changed:
            # Something was already done: leave it as it is, say so, and ask a human.
            await self.say(f":warning: {text}. Steps already taken are left in place.",
                           mention=self.policy.escalation.slack_mention)
        return await self.record_outcome("opted-out", text, warning=changed)

    async def load(self, xid: int | None = None) -> Policy:
        self.enter("load policy")
        steps_0_2 = workflow.patched(NODE_STEPS_0_2)
        self.protect_retries_said = self.hold_registered = self.reads_in_task = steps_0_2
        self.watches_early_alerts = self.confirms_alerted_gpus = steps_0_2
        # Local activities: the worker's own configuration, no round trip through the task queue.
        if steps_0_2:
            config = await configuration(refs.CONFIG_RUN)
            policy, context = config.policy, config.context
        else:
            policy, context = await asyncio.gather(
                configuration(refs.CONFIG_POLICY), configuration(refs.CONFIG_CONTEXT))
        self.policy, self.context = shared(Policy.model_validate(policy)), RunContext.model_validate(context)
        served = self.policy.routing.served_clusters
        if self.cluster not in served:
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
        self.show(*attributes)
        return self.policy

    @property
    def protected(self) -> bool:
        """The protective step took the node out (cordon or taint, Slurm DRAIN), or would have."""
        return self.protection is not None and self.protection.node is not None \
            and not self.protection.opt_out.opted_out and self.protection.held is None

    async def read_node(self, step: str) -> NodeInfo | None:
        """The node as the protective step read it (its labels, annotations and GPUs do not change with
        a cordon), or read now when that step did not read it: a storm's runs read each node once."""
        if self.protection is not None and self.protection.node is not None:
            return self.protection.node
        node: NodeInfo | None = await self.call(step, refs.GET_NODE, self.node)
        return node

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
            # In the task (0.2.0): each failed try said in the run's status, as the protective step's.
            opt_out = await self.call(f"{step}: opt-out check", refs.CHECK_OPT_OUT, self.node,
                                      in_task=self.reads_in_task, retries_said=True)
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
        why = approval_reason(rules, kinds, out)
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

    @workflow.signal(name="protective_kill", description="Internal (the fleet guard): a protective kill granted or not")
    def protective_kill(self, answer: KillAnswer) -> None:
        self.kill_answer = answer

    # --- disruption lease -------------------------------------------------------------------------

    async def take_lease(self) -> None:
        """Ask the cluster's fleet guard (fleet-guard/<cluster>) and wait for the grant, FIFO."""
        assert self.policy is not None
        self.enter("take disruption lease")
        if self.dry_run:
            self.decide("take disruption lease", "would take a disruption lease (shadow runs hold none)")
            return
        skipped = self.skipped
        node = await self.read_node("take disruption lease")
        if node is None and self.skipped == skipped:
            raise NothingToDo("unknown-node", f"node {self.node} does not exist in Kubernetes: nothing to remediate")
        label = self.policy.budget.topology_label
        domain = node.labels.get(label, "") if node and label else ""
        request = LeaseRequest(workflow_id=self.workflow_id, node=self.node, domain=domain,
                               breaker_held=self.breaker_held, trip=self.breaker_trip)
        await self.call("take disruption lease", refs.GUARD_REQUEST, (self.cluster, request))
        self.lease_held = True  # from here on, every way out releases it
        timeout = self.policy.budget.lease_timeout
        while not await self.wait(self.lease_wait(),
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

    def lease_wait(self) -> str:
        """What the run waits for at its lease. The guard's first answer can be here before the run
        waits: in a workflow task that also completes the request, signals are handled first: the
        run says its place in line then."""
        told = self.lease_answer
        if told is None or told.granted:
            return "lease from the fleet guard"
        return self.place_in_line(told)

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

    # --- ways out, shared by every stage ---------------------------------------------------------

    def idempotency_key(self, action: str) -> str:
        return f"{self.workflow_id}/{workflow.info().first_execution_run_id}/{action}"

    async def request_quota_sync(self, step: str) -> None:
        """The node's GPUs left or rejoined the fleet: Kueue's quotas follow (kueue-quota-sync).
        Never holds the runbook up: the Schedule catches up if this cannot start it."""
        assert self.policy is not None
        if self.dry_run or not self.policy.kueue.enabled:
            return
        try:
            await execute(refs.REQUEST_QUOTA_SYNC, self.cluster, start_to_close_timeout=self.call_timeout(),
                          retry_policy=self.retry(), summary=f"{step}: sync Kueue quotas")
            self.decide(step, f"Kueue quota sync asked (kueue-quota-sync/{self.cluster})")
        except ActivityError:
            self.decide(step, "could not start the Kueue quota sync; its schedule catches up")

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
        if self.out_since is None or self.dry_run:
            return meter  # a watch that touched nothing, or a shadow run: no repair to time
        meter.create_histogram_timedelta("fleetmedic_time_to_repair", "alert to outcome of a run that took the "
                                         "node out").record(workflow.now() - workflow.info().start_time)
        out_for = ((self.back_at or workflow.now()) - self.out_since).total_seconds()
        meter.create_histogram_float("fleetmedic_gpu_hours_lost", "GPU-hours out of service per run",
                                     "h").record(self.node_gpus * out_for / 3600)
        return meter



def gpu_name(gpu: int | None) -> str:
    return "?" if gpu is None else str(gpu)
