"""The node runbook: the shared steps of xid-recovery, hot-gpu-pull and nvlink-fault-replace, in
the order of the skeleton:

classify → notify start → lease → re-check opt-out → quarantine in Slurm → grace for checkpoints
→ ensure requeue → cordon → drain → remediate → wait for Ready and validate → return to service
→ release lease → verify the job resumed → record outcome.

Each runbook composes these; none copies them.
"""

from __future__ import annotations

from temporalio import workflow

from workflows.node_base import NodeRunbookBase, NothingToDo, OptedOut, Rejected, gpu_name
from workflows.node_return import ReturnSteps
from workflows.node_take_out import TakeOutSteps

with workflow.unsafe.imports_passed_through():
    from fleetmedic.models import Alert, SlurmNodeState, Taint
    from fleetmedic.routing import alert_facts
    from fleetmedic.trust import UntrustedValue

__all__ = ["NodeRunbook", "NodeRunbookBase", "NothingToDo", "OptedOut", "Rejected", "gpu_name"]


class NodeRunbook(TakeOutSteps, ReturnSteps):
    """A runbook that takes one node out of service, repairs it and puts it back."""

    def alert_xid_gpu(self, alert: Alert) -> tuple[int | None, int | None]:
        """An attached alert's XID and GPU, read as the webhook reads them (labels, then the dcgm
        rule's annotation); a label that is not a number reads as none."""
        assert self.policy is not None
        try:
            facts = alert_facts(alert, self.policy.routing)
        except UntrustedValue:
            return None, None  # attached all the same: counted as no XID, and no GPU of its own
        return facts.xid, facts.gpu

    async def protect_then_count(self, reason: str, taint: Taint | None = None) -> int:
        """The protective step, then the lemon count: bookkeeping may wait, the bad node may not.
        Returns the count when the node is a lemon (0 otherwise)."""
        await self.protect(reason, taint)
        self.open_held_thread()  # the Slack thread, once the node is out of service (`open_thread`)
        return await self.is_lemon()

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

