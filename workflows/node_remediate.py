"""Remediation: the provider's replace/reboot/RMA, a GPU reset through the node agent, and the
lemon rule that sends a node out for good instead of another round."""

from __future__ import annotations

from temporalio import workflow

from workflows.node_base import NodeRunbookBase

with workflow.unsafe.imports_passed_through():
    from fleetmedic import activity_refs as refs
    from fleetmedic.decisions import is_lemon
    from fleetmedic.lemon import count_since, lemon_count
    from fleetmedic.models import (
        ActionResult,
        GpuResetRequest,
        ProviderRequest,
        ProviderResult,
    )


class RemediateSteps(NodeRunbookBase):
    """Replace, reboot, reset, RMA; and the lemon count."""

    # What the last provider request yielded: the same node, or a new one to follow (node_replacement.py).
    provider_result: ProviderResult | None = None

    async def ask_provider(self, action: str, reason: str, round: int = 1) -> ProviderResult | None:
        """One provider request per action, round and run (the idempotency key makes retries the same
        request); a provider that needs a person makes the run wait for `replaced`."""
        assert self.policy is not None
        await self.gate(action, (action,))
        if round > 1:
            # The node failed its burn-in: one more remediation in its record, which the lemon rule reads.
            await self.act(action, refs.CORDON, self.target(f"fleetmedic: failed its burn-in, {action} again "
                                                            f"({self.workflow_id})"))
        key = self.idempotency_key(action if round == 1 else f"{action}-{round}")
        result = await self.call(action, refs.PROVIDER_REQUEST, ProviderRequest(
            cluster=self.cluster, node=self.node, action=action, reason=reason,
            idempotency_key=key, dry_run=self.dry_run), retry=self.retry("writes"))
        self.provider_result = result
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
        # In the task (0.2.0): right after the protective step, no activity task nor a workflow task
        # for its answer while a storm's first tasks wait for the same cores.
        before = await self.call("lemon check", refs.COUNT_REMEDIATIONS, (self.cluster, self.node, since),
                                 in_task=self.reads_in_task, retries_said=True) or 0
        # The node's own record outlives Temporal's retention of closed runs. The protective step
        # read it a moment ago (before its cordon added this run, which the count leaves out): a
        # storm's runs take one read of the node each, not two.
        node = await self.read_node("lemon check")
        on_node = count_since(node.annotations.get(self.policy.labels.remediations_annotation), since,
                              exclude_run=workflow.info().run_id) if node else 0
        before = lemon_count(before, on_node)
        count = before + 1
        if is_lemon(count, self.policy.lemon):
            self.decide("lemon check", f"remediation #{count} of {self.node} within {self.policy.lemon.window}: "
                                       f"a lemon node, it goes out for RMA instead of another round")
            return count
        self.decide("lemon check", f"remediation #{count} within {self.policy.lemon.window} "
                                   f"(lemon at {self.policy.lemon.count})")
        return 0

