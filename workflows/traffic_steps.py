"""What traffic-flip and migrate-back share: their input, the cluster snapshot, the overflow
taint on the virtual-kubelet node(s), stopping the other runbook, and recording the outcome.

The two never act at the same time: each asks the other to stop and waits until it has closed
before it changes anything.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any

from temporalio import workflow

from workflows.runbook import DryRunEnded, Runbook, abort_alone, input_error

with workflow.unsafe.imports_passed_through():
    from fleetmedic import activity_refs as refs
    from fleetmedic import ids
    from fleetmedic.models import Operator, RunbookStatus, Taint, TaintRequest
    from fleetmedic.traffic import TrafficInput, TrafficSnapshot


class Stopped(Exception):
    """The other traffic runbook (or an operator) asked this one to stop."""

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why


class TrafficRunbook(Runbook):
    other = ""  # the runbook this one must never act together with

    def _init_run(self, raw: dict[str, Any]) -> None:
        self.invalid = input_error(raw, TrafficInput)
        input = TrafficInput.model_validate(raw) if self.invalid is None else TrafficInput(
            cluster=str(raw.get("cluster") or "?") if isinstance(raw, dict) else "?")
        self._init_state(input.cluster, "", workflow.info().workflow_id, input.dry_run)
        self.input = input
        self.stop_request: Operator | None = None
        if input.alert is not None:
            self.remember_alert(input.alert)

    @workflow.signal(description='Stop before the next change (the other traffic runbook, or an operator): '
                                 '{"by": "alice", "reason": "..."}')
    def stop(self, operator: Operator) -> None:
        """The other traffic runbook starts (or an operator): stop before the next change."""
        self.stop_request = operator

    async def run_to_end(self, body: Callable[[], Awaitable[RunbookStatus]]) -> RunbookStatus:
        """The runbook's body; a dry run that would have paged a person ends `dry-run` instead."""
        try:
            return await body()
        except DryRunEnded as ended:
            await self.end_dry_run(ended, event_on="")
            return self.status()

    async def begin(self) -> TrafficSnapshot:
        """A valid input, the policy, and the cluster as it is now (the `confirm` step's reading)."""
        self.fail_if_invalid(self.invalid)
        await self.load_policy()
        self.enter("confirm")
        return await self.snapshot("confirm")

    @property
    def traffic(self) -> Any:
        assert self.policy is not None
        return self.policy.traffic

    async def snapshot(self, step: str) -> TrafficSnapshot:
        snap = await self.call(step, refs.TRAFFIC_SNAPSHOT, ())
        assert snap is not None, "an operator skipped the cluster read"
        return snap

    async def gate(self, step: str) -> None:
        """The gate of each change a traffic runbook makes: abort, this run's pause, the fleet's
        pause (asked of the fleet guard: no lease brings it here), and the other runbook's stop."""
        self.enter(step)
        await self.hold_before_destructive(step)
        self.check_stop()

    def stopping(self) -> bool:
        """`until` of a long step that a stop ends early (migrate-back's batch, since STOP_ENDS_BATCH)."""
        return self.stop_request is not None

    def check_stop(self) -> None:
        if self.stop_request is not None:
            raise Stopped(f"{self.stop_request.by}: {self.stop_request.reason}")

    async def stop_other(self) -> None:
        """Ask the other traffic runbook to stop, and wait until it has closed."""
        self.enter(f"stop {self.other}")
        other_id = ids.cluster_workflow_id(self.other, self.cluster)
        stopped = await self.call(f"stop {self.other}", refs.STOP_RUNBOOK,
                                  (other_id, Operator(by=self.workflow_id, reason=f"{self.runbook} starts")),
                                  timeout=timedelta(minutes=15), heartbeat=self.call_timeout(),
                                  until=abort_alone)
        if stopped:
            self.decide(f"stop {self.other}", f"{other_id} stopped: it never acts together with {self.runbook}")

    async def set_overflow(self, nodes: list[str], closed: bool, step: str) -> None:
        """Overflow taint on (closed: inference stays home) or off (open: it may spill out)."""
        taint = Taint.parse(self.traffic.overflow_taint)
        activity = refs.ADD_TAINT if closed else refs.REMOVE_TAINT
        for node in nodes:
            await self.act(step, activity, TaintRequest(node=node, taint=taint, dry_run=self.dry_run))

    async def record(self, outcome: str, message: str, nodes: list[str], warning: bool = False) -> RunbookStatus:
        # The virtual node carries the story, as a drained node does for node runbooks.
        await self.record_outcome(outcome, message, warning, event_on=nodes[0] if nodes else "")
        return self.status()
