"""A replacement under a new name, and burn-in before the node returns to training.

Cluster API and Karpenter replace a machine with a new one under a new node name; an `http`
provider may say so too, and an operator's `replaced --new-node` does. The run follows the
replacement to the node that will serve:

1. find it (the provider's new Machine or NodeClaim, its answer, or the operator's name), up to
   `grace.node_ready_deadline` — none by then is an escalation;
2. hold it out at once: Slurm DRAIN (before its slurmd registers, where the scheduler would start
   the waiting jobs on it), then cordon when it is Ready — no remediation counted on a new machine;
3. validate and burn it in like any node coming back (node_return.py);
4. retire what the old node left behind: its Node object when the provider did not delete it
   (still Ready: left cordoned and annotated instead), its Slurm node DOWN with "replaced by …".

The Slurm node is the one named like the Kubernetes node (a slurm.conf that lists the provider's
names, dynamic nodes), or with `slurm.mapping: slinky` the one of the slurmd pod that Slinky's
NodeSet starts on it (activities/slurm_names.py): the replacement is a Slurm node of its own,
registered by its slurmd, and held again once it has.
"""

from __future__ import annotations

from temporalio import workflow
from temporalio.exceptions import ActivityError

from workflows.node_base import POLL
from workflows.node_remediate import RemediateSteps
from workflows.runbook import In, RunbookAborted, abort_alone

with workflow.unsafe.imports_passed_through():
    from fleetmedic import activity_refs as refs
    from fleetmedic.activity_refs import Activity
    from fleetmedic.models import (
        ActionResult,
        BurnIn,
        FindReplacement,
        Follow,
        NodeTarget,
        SetSlurmNodeState,
        SlurmNodeState,
    )

class ReplacementSteps(RemediateSteps):
    """Follow a replacement to its new node; burn a node in before it returns."""

    replaced_nodes: tuple[str, ...] = ()  # every node the run replaced (a failed burn-in replaces again)
    new_machine = False  # `self.node` is a new machine: its first Ready counts, however old
    held_replacement = False

    @property
    def replaced_from(self) -> str | None:
        """The node this run first replaced (`self.node` serves instead)."""
        return self.replaced_nodes[0] if self.replaced_nodes else None

    async def follow_replacement(self) -> bool:
        """After the provider's request: switch the run to the node that will serve, when it is a
        new one. False when no replacement came (the operator answered the escalation `skip`)."""
        result = self.provider_result
        self.new_machine = False
        if result is None or self.dry_run:
            return True
        new = result.new_node or (self.replaced_signal.new_node if self.replaced_signal else None)
        if new is None and result.follow is not None:
            new = await self.find_replacement(result.follow)
            if new is None:
                return False
        if new is not None and new != self.node:
            await self.take_in(new)
        return True

    async def find_replacement(self, follow: Follow) -> str | None:
        assert self.policy is not None
        step = "find replacement"
        self.enter(step)
        limit = self.policy.grace.node_ready_deadline
        while True:
            deadline = workflow.now() + limit
            why = f"no replacement of {follow.old_node} from {follow.provider} within {limit}"
            while workflow.now() < deadline:
                where = f" in {follow.group}" if follow.group else ""
                self.waiting_for = (f"{follow.provider} to bring the replacement of {follow.old_node}{where} "
                                    f"(until {deadline.isoformat()})")
                window = deadline - workflow.now()
                found = await self.call(step, refs.FIND_REPLACEMENT,
                                        FindReplacement(follow=follow, timeout_s=max(window.total_seconds(), 1)),
                                        timeout=window + self.call_timeout(), heartbeat=self.wait_heartbeat(),
                                        task_queue=self.waits_queue(),
                                        until=self.operator_named_replacement)
                signal = self.replaced_signal
                if signal is not None and signal.new_node is not None:
                    self.decide(step, f"{signal.by} named the replacement: {signal.new_node}")
                    return signal.new_node
                if found is None:
                    return None  # skipped by an operator: nothing to follow
                if found.node is not None:
                    self.decide(step, found.detail)
                    return found.node
                if found.failed:
                    why = found.detail
                    break
            answer = await self.escalate(step, why)
            if answer.action == "abort":
                raise RunbookAborted(answer.by, answer.reason or "no replacement")
            if answer.action == "skip":
                self.decide(step, f"{answer.by} gave up on the replacement")
                return None

    def operator_named_replacement(self) -> bool:
        """An operator named the new node (`replaced --new-node`) while the run searched: it ends
        the search, as a provider's answer would (the machine came some other way)."""
        return self.replaced_signal is not None and self.replaced_signal.new_node is not None

    async def take_in(self, new: str) -> None:
        """The run goes on with the new node; it stays out of Slurm until it has passed everything."""
        assert self.policy is not None
        old = self.node
        self.enter("take in replacement")
        self.decide("take in replacement", f"{old} replaced by {new}")
        await self.say(f":arrows_counterclockwise: `{old}` replaced by `{new}`")
        self.replaced_nodes, self.node = (*self.replaced_nodes, old), new
        self.new_machine, self.held_replacement = True, False
        if self.context.slurm_enabled:
            await self.hold_in_slurm()

    async def hold_in_slurm(self) -> None:
        """The replacement DRAINed in Slurm until it has passed everything."""
        await self.act("take in replacement", refs.SET_SLURM_STATE, SetSlurmNodeState(
            node=self.node, state=SlurmNodeState.DRAIN, dry_run=self.dry_run,
            reason=f"fleetmedic: replaces {self.replaced_nodes[-1]}, held until validated ({self.workflow_id})"))

    async def hold_replacement(self) -> None:
        """Cordon the new node as soon as it is Ready (a NotReady node takes no pods), and wait for
        its slurmd to register: a Slurm node never heard of cannot be resumed."""
        if not self.new_machine or self.held_replacement:
            return
        await self.act("take in replacement", refs.CORDON, self.target(
            f"fleetmedic: replaces {self.replaced_from}, held until validated").model_copy(
            update={"remediation": False}))
        self.held_replacement = True
        if self.context.slurm_enabled:
            await self.wait_slurm_registered()

    async def wait_slurm_registered(self) -> None:
        assert self.policy is not None
        step = "take in replacement"
        limit = self.policy.grace.node_ready_deadline
        deadline = workflow.now() + limit
        while True:
            self.waiting_for = f"slurmd of {self.node} to register with slurmctld (until {deadline.isoformat()})"
            node = await self.call(step, refs.SLURM_NODE, self.node)
            if node is None or (node.state not in ("unknown", "future") and "NOT_RESPONDING" not in node.flags):
                self.decide(step, f"Slurm node {node.name if node else self.node} registered "
                                  f"({node.state if node else 'check skipped'})")
                if node is not None and self.hold_registered:
                    # Slinky: the node's slurmd pod came after the node, so the hold at take-in found
                    # no Slurm node; the operator's drain of the cordoned node is not FleetMedic's.
                    await self.hold_in_slurm()
                return
            if workflow.now() >= deadline:
                why = f"{node.state}: {node.reason}" if node.reason else node.state
                answer = await self.escalate(step, f"Slurm node {self.node} did not register within {limit} "
                                                   f"(state {why}): is its slurmd running, and does "
                                                   "slurm.conf (or a dynamic node) name it?")
                if answer.action == "abort":
                    raise RunbookAborted(answer.by, answer.reason or "replacement not in Slurm")
                if answer.action == "skip":
                    return
                deadline = workflow.now() + limit
            await self.sleep(POLL, summary="take in replacement: wait for slurmd")

    async def retire_replaced(self) -> None:
        """Clean up after the replaced nodes: the Kubernetes object a provider left, the Slurm node's
        reason. Never escalates: the replacement's outcome does not depend on it."""
        step = "retire replaced node"
        for old in self.replaced_nodes:
            self.enter(step)
            target = NodeTarget(node=old, workflow_id=self.workflow_id, dry_run=self.dry_run,
                                reason=f"fleetmedic: replaced by {self.node} ({self.workflow_id})")
            await self.quietly(step, refs.RETIRE_NODE, target)
            if self.context.slurm_enabled:
                await self.quietly(step, refs.SET_SLURM_STATE, SetSlurmNodeState(
                    node=old, state=SlurmNodeState.DOWN, reason=target.reason, dry_run=self.dry_run))

    async def quietly(self, step: str, activity: Activity[In, ActionResult], arg: In) -> None:
        """A clean-up write: its failure is recorded, never escalated."""
        try:
            result = await self.call(step, activity, arg, retry=self.retry("writes"), escalate=False)
        except ActivityError as err:
            self.decide(step, f"left as it is: {err.cause or err}")
            return
        if result is not None:
            self.decide(step, result.summary)

    # --- burn-in ---------------------------------------------------------------------------------

    async def burn_in_passes(self, round: int) -> bool:
        """The policy's burn-in job on the node, in a reservation of its own (activities/burn_in.py)."""
        assert self.policy is not None
        policy = self.policy.burn_in
        step = "burn-in"
        if not policy.enabled:
            return True
        self.enter(step)
        if not self.context.slurm_enabled:
            self.decide(step, "skipped: the burn-in is a Slurm job and Slurm is not configured")
            return True
        self.waiting_for = f"the burn-in job on {self.node} (up to {policy.deadline})"
        result = await self.call(step, refs.BURN_IN, BurnIn(
            node=self.node, run_id=f"{workflow.info().run_id[:13]}-{round}", script=policy.script,
            deadline_s=policy.deadline.total_seconds(), output_dir=policy.output_dir,
            pass_pattern=policy.pass_pattern, dry_run=self.dry_run),
            timeout=policy.deadline + self.call_timeout() * 2, heartbeat=self.call_timeout(),
            retry=self.retry("writes"), until=abort_alone)
        if result is None:
            return True  # skipped by an operator
        tail = result.output.strip().splitlines()[-1:] if result.output.strip() else []
        self.decide(step, ("passed: " if result.passed else "failed: ") + result.detail
                    + (f" ({tail[0][:200]})" if tail else ""))
        return result.passed
