"""xid-recovery: from an XID alert to the node back in service and the job resumed.

The flow of the Crusoe AutoClusters talk. A GPU throws XID 79, nobody is paged:

1. classify the XID with the policy's catalog (bursts and repeats change the answer);
2. open the run's Slack thread ("no action required");
3. take a disruption lease;
4. out of service at once: Slurm node DOWN with a `fleetmedic:` reason (running jobs get SIGTERM)
   and the Kubernetes node cordoned;
5. grace: until each job checkpointed after the signal, or left, or the policy grace ends;
6. every affected job requeued, and where it resumes from recorded;
7. drain the Kubernetes node;
8. remediate: replace through the provider, or reset the GPU (agent, else reboot/replace);
9. wait for the node Ready again and validated by the node agent;
10. return to service (uncordon, Slurm RESUME), release the lease;
11. confirm the requeued jobs run again, and record the outcome.

Notify-class XIDs touch nothing: the run stays open for the burst window and counts repeats
on the GPU (a second alert attaches here), escalating to diagnosis on a burst, or going down
the remediation path if a destructive XID arrives meanwhile.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from temporalio import workflow

from workflows.node_runbook import NodeRunbook, NothingToDo, gpu_name

with workflow.unsafe.imports_passed_through():
    from fleetmedic.models import NodeRunbookInput, RunbookStatus, SlurmNodeState, missing_input
    from fleetmedic.xid import XidAction, XidClassification, classify_xid


@workflow.defn(name="xid-recovery")
class XidRecovery(NodeRunbook):
    runbook = "xid-recovery"

    @workflow.init
    def __init__(self, raw: dict[str, Any]) -> None:
        self._init_run(raw)
        # Every XID seen on this node during the run: (xid, gpu, when). Bursts and repeats count these.
        self.occurrences: list[tuple[int, int | None, datetime]] = []

    @workflow.run
    async def run(self, raw: dict[str, Any]) -> RunbookStatus:
        """Returns the run's report: outcome, every decision with its reason, every change made."""
        return await self.run_to_outcome(lambda: self.recover(self.input))

    async def recover(self, input: NodeRunbookInput) -> str:
        await self.load(input.xid)
        if (missing := missing_input(self.runbook, input)) is not None:
            raise NothingToDo("invalid-input", missing)  # before anything is touched
        assert input.xid is not None
        verdict = self.classify(input.xid, input.gpu, input.alert.starts_at if input.alert else None)

        self.enter("notify")
        self.open_thread(f"XID {input.xid} on GPU {gpu_name(input.gpu)} of `{self.node}`: {verdict.reason}",
                         after_protect=verdict.destructive)

        if not verdict.destructive:
            verdict = await self.watch_without_action(verdict)
            if not verdict.destructive:
                return self.outcome or "notified"
        return await self.remediate(verdict)

    # --- 1. classify ------------------------------------------------------------------------------

    def classify(self, xid: int, gpu: int | None, at: datetime | None = None) -> XidClassification:
        assert self.policy is not None
        self.enter("classify")
        earlier = [when for seen_xid, seen_gpu, when in self.occurrences if seen_xid == xid and seen_gpu == gpu]
        self.occurrences.append((xid, gpu, at or workflow.now()))
        verdict = classify_xid(
            xid, self.policy.xid.catalog, unknown_action=self.policy.xid.unknown_action,
            application_burst=self.policy.xid.application_burst, reset_repeat=self.policy.xid.reset_repeat,
            recent=earlier, now=workflow.now(), linked_xid=self.input.linked_xid)
        self.decide("classify", verdict.reason)
        return verdict

    # --- notify-only path ----------------------------------------------------------------------------

    async def watch_without_action(self, verdict: XidClassification) -> XidClassification:
        """Touch nothing. Keep the run open for the burst window so repeats are counted here."""
        assert self.policy is not None
        if verdict.action is XidAction.IGNORE:
            await self.record_outcome("ignored", verdict.reason)
            return verdict
        if verdict.action is XidAction.NVLINK:
            await self.record_outcome("notified", f"{verdict.reason}: the nvlink-fault-replace runbook owns "
                                                  "NVLink faults (alerts route there); no action here")
            return verdict
        if verdict.action is XidAction.DIAGNOSE:
            return await self._escalate_burst(verdict)

        window = self.policy.xid.application_burst.window
        deadline = workflow.now() + window
        # Alerts that came with the one that started the run are looked at too: Alertmanager groups a
        # node's alerts, so another GPU's XID (a 79 beside this 13) is signalled to the run before its
        # first task, answered `attached`, and not sent again before the route's repeat_interval.
        # (0.1.0 watched from the alerts already there: runs it started keep that.)
        first = 1 if self.input.alert is not None else 0  # the input's alert is the run's first
        seen = first if self.watches_early_alerts and self.new_alerts(first) else len(self.alerts)
        self.enter("watch for repeats")
        while await self.wait(f"repeats of XID {verdict.xid} until {deadline.isoformat()}",
                              lambda s=seen: len(self.alerts) > s,
                              timeout=max(deadline - workflow.now(), timedelta(seconds=1))):
            # A resend (same fingerprint and startsAt) is no new occurrence, and the XID and GPU
            # are read as the webhook reads them (labels, then the dcgm rule's annotation).
            fresh = self.new_alerts(seen)
            seen = len(self.alerts)
            for alert in fresh:
                xid, gpu = self.alert_xid_gpu(alert)
                self.decide("watch for repeats", f"alert attached: {alert.status} XID {xid} on GPU {gpu_name(gpu)}")
                if alert.status != "firing" or xid is None:
                    continue
                again = self.classify(xid, gpu, alert.starts_at)
                if again.action is XidAction.DIAGNOSE:
                    return await self._escalate_burst(again)
                if again.destructive:
                    self.input = self.input.model_copy(update={"xid": xid, "gpu": gpu})
                    return again
        await self.record_outcome("notified", f"{verdict.reason}; no burst within {window}")
        return verdict

    async def _escalate_burst(self, verdict: XidClassification) -> XidClassification:
        assert self.policy is not None
        await self.say(f":mag: {verdict.reason}. Please diagnose `{self.node}`.",
                       mention=self.policy.escalation.slack_mention)
        await self.record_outcome("escalated", verdict.reason, warning=True)
        return verdict

    # --- remediation path ---------------------------------------------------------------------------

    async def remediate(self, verdict: XidClassification) -> str:
        assert self.policy is not None
        xid, gpu = self.input.xid, self.input.gpu  # a destructive XID that arrived later may have replaced them
        reason = f"fleetmedic: XID {xid} on GPU {gpu_name(gpu)} ({self.workflow_id})"
        why = f"XID {xid} on GPU {gpu_name(gpu)} of {self.node}: {verdict.reason}"
        if lemon := await self.protect_then_count(reason):
            return await self.retire_lemon(lemon, SlurmNodeState.DOWN, why)
        if verdict.job_lost:
            await self.kill_lost_jobs(reason)

        jobs = await self.take_out_and_drain(SlurmNodeState.DOWN, reason, self.policy.grace.checkpoint)
        requested_at = workflow.now()
        if verdict.action is XidAction.REPLACE:
            await self.ask_provider("replace", why)
            done = "replace"
        else:
            done = await self.reset_gpu(gpu or 0, why)
        return await self.return_when_healthy(jobs, requested_at, f"XID {xid} on GPU {gpu_name(gpu)}: {verdict.action}",
                                              rejoined=done != "reset")
