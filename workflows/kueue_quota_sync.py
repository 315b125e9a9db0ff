"""kueue-quota-sync/<cluster>: ClusterQueue GPU quotas equal to the healthy GPUs that exist.

Kueue's quotas are numbers someone typed; FleetMedic takes nodes out and puts them back all day,
so it keeps them true. Run by a Temporal Schedule (policy `kueue.interval`, overlapping runs
skipped, pausable from the UI or `temporal schedule toggle`), and started by every node runbook
step that takes a node out of service or returns one. One pass:

1. read the flavors, the ClusterQueues' GPU quotas, what admitted workloads hold, the GPU nodes;
2. per queue and flavor: healthy GPUs → the policy's target → the guards (fleetmedic/quota.py);
3. a cut below what admitted workloads use waits for approval (`approvals.steps: [quota_cut]`)
   or is held at that use, and the run says why;
4. patch each queue that differs (optimistic concurrency), record an Event on it, say it on
   Slack, and report each flavor's drift (configured minus healthy) as a metric.

A dry run (or shadow mode) reports the diff and changes nothing. A `sync` signal that arrives
during a pass makes it run one more pass: a node that changed meanwhile is never missed.
"""

from __future__ import annotations

from temporalio import workflow

from workflows.runbook import DryRunEnded, Runbook, RunbookAborted

with workflow.unsafe.imports_passed_through():
    from fleetmedic import activity_refs as refs
    from fleetmedic.models import EventRequest, RunbookStatus
    from fleetmedic.policy import Policy
    from fleetmedic.quota import (
        QuotaChange,
        QuotaSlot,
        QuotaSyncInput,
        QuotaUpdate,
        healthy_gpus,
        plan,
    )

MAX_PASSES = 20  # a storm of triggers still ends the run; the next one picks up


@workflow.defn(name="kueue-quota-sync")
class KueueQuotaSync(Runbook):
    runbook = "kueue-quota-sync"

    @workflow.init
    def __init__(self, input: QuotaSyncInput) -> None:
        self._init_state(input.cluster, "", workflow.info().workflow_id, input.dry_run)
        self.again = False
        self.changed: list[QuotaChange] = []

    @workflow.signal(description="Internal (node runbooks): a node left or returned; run one more pass")
    def sync(self) -> None:
        """Something changed (a node left or returned): run one more pass after this one."""
        self.again = True

    @workflow.run
    async def run(self, input: QuotaSyncInput) -> RunbookStatus:
        policy = await self.load_policy()
        passes = 0
        try:
            while True:
                self.again = False
                await self.sync_once(policy)
                passes += 1
                if not self.again or passes >= MAX_PASSES:
                    break
                self.decide("sync", "a node changed during the pass: once more")
        except RunbookAborted as aborted:
            self.finish("aborted")
            self.decide("sync", f"aborted by {aborted.by}: {aborted.reason}")
            return self.status()
        except DryRunEnded as ended:
            self.decide("sync", f"would have escalated {ended.step} to a person: {ended.error}")
            self.finish("dry-run")
            return self.status()
        held = [c for c in self.changed if c.needs_approval and c.new > c.target]
        applied = [c for c in self.changed if c.new != c.current]
        outcome = "held" if held else "synced" if applied else "in-sync"
        if self.thread_task is not None:  # a change was posted: close the thread with the outcome
            await self.say(f"*{outcome}*" + (f": held by admitted workloads: {', '.join(c.queue for c in held)}"
                                             if held else ""))
        self.finish(outcome)
        return self.status()

    async def sync_once(self, policy: Policy) -> None:
        self.enter("read")
        snapshot = await self.call("read", refs.KUEUE_SNAPSHOT, ())
        if snapshot is None:
            return
        if not snapshot.installed:
            self.decide("read", "Kueue is not installed here (no ResourceFlavor API): nothing to sync")
            return
        flavors = {f.name: f for f in snapshot.flavors}
        labels = policy.labels
        degraded_key = policy.nvlink.degraded_taint.partition("=")[0].partition(":")[0]
        self.enter("compare")
        for queue in snapshot.queues:
            changes: list[QuotaChange] = []
            for slot in queue.slots:
                flavor = flavors.get(slot.flavor)
                if flavor is None:
                    self.decide("compare", f"{queue.name}: flavor {slot.flavor} does not exist; left alone")
                    continue
                healthy, left_out = healthy_gpus(
                    flavor, snapshot.nodes, gpu_node_selector=labels.gpu_node_selector,
                    hold_annotations=(labels.workflow_annotation, labels.reason_annotation),
                    degraded_taint_key=degraded_key, count_degraded=policy.kueue.count_degraded)
                change = plan(queue, slot, healthy, policy.kueue.share_for(queue.name),
                              policy.kueue.max_change_fraction)
                self.record_drift(change)
                if change.new == change.current and not change.needs_approval:
                    continue
                self.decide("compare", f"{queue.name}/{slot.flavor}: {change.current} → {change.new} GPUs "
                                       f"({change.reason})" + (f"; out: {', '.join(left_out)}" if left_out else ""))
                if change.needs_approval and change.target < change.new:
                    change = await self.approve_cut(change)
                changes.append(change)
            await self.apply(queue.name, queue.slots, [c for c in changes if c.new != c.current])
            self.changed.extend(changes)

    async def approve_cut(self, change: QuotaChange) -> QuotaChange:
        """A cut below what admitted workloads hold: only with an approval (`quota_cut`)."""
        assert self.policy is not None
        rules = self.policy.approvals
        what = f"{change.queue}/{change.flavor} to {change.target} (admitted workloads use {change.used})"
        if "quota_cut" not in rules.steps or self.dry_run:
            self.decide("compare", f"held at {change.new}: cutting {what} needs approval "
                                   "(add quota_cut to approvals.steps to allow it)")
            return change
        self.awaiting_approval, self.approval = "quota_cut", None
        self.open_thread(f":scales: Kueue quota cut of {what} needs approval")
        await self.say(f"`fleetmedic approve {self.workflow_id}` or `fleetmedic reject {self.workflow_id} "
                       "--reason …`", mention=self.policy.escalation.slack_mention)
        answered = await self.wait(f"approval of the quota cut of {what}", lambda: self.approval is not None,
                                   timeout=rules.timeout)
        self.awaiting_approval = None
        if not answered or self.approval is None:
            self.decide("compare", f"held at {change.new}: no approval of the cut within {rules.timeout}")
            return change
        verdict, approval = self.approval
        self.approval = None
        self.decide("compare", f"quota cut {verdict}d by {approval.by}" + (f": {approval.reason}"
                                                                           if approval.reason else ""))
        return change.model_copy(update={"new": change.target}) if verdict == "approve" else change

    async def apply(self, queue: str, slots: list[QuotaSlot], changes: list[QuotaChange]) -> None:
        if not changes:
            return
        assert self.policy is not None
        self.enter("apply")
        await self.hold_before_destructive("apply")  # abort, this run's pause, the fleet's pause
        new = {c.flavor: c.new for c in changes}
        update = QuotaUpdate(queue=queue, dry_run=self.dry_run,
                             slots=[s.model_copy(update={"nominal": new[s.flavor]}) for s in slots if s.flavor in new])
        result = await self.act("apply", refs.SET_QUOTA, update)
        if result is None or not result.changed:
            return
        diff = ", ".join(f"{c.flavor} {c.current} → {c.new}" for c in changes)
        await self.call("apply", refs.RECORD_EVENT, EventRequest(
            kind="ClusterQueue", api_version="kueue.x-k8s.io/v1beta1", name=queue, namespace="default",
            reason="FleetMedicQuotaSynced", message=f"GPU quota {diff}: {changes[0].reason} ({self.workflow_id})",
            type="Normal"), escalate=False)
        if self.thread_task is None:
            self.open_thread(f":bar_chart: Kueue quota of `{queue}`: {diff}")
        else:
            await self.say(f":bar_chart: Kueue quota of `{queue}`: {diff}")

    def record_drift(self, change: QuotaChange) -> None:
        meter = workflow.metric_meter().with_additional_attributes(
            {"cluster": self.cluster, "queue": change.queue, "flavor": change.flavor})
        meter.create_gauge("fleetmedic_kueue_quota_drift", "configured minus healthy GPUs").set(change.drift)
        meter.create_gauge("fleetmedic_kueue_healthy_gpus", "healthy GPUs behind the flavor").set(change.healthy)

