"""Back in service, the second half of the skeleton: wait for Ready and validate → return to
service → release the lease → confirm the jobs resumed → record the outcome."""

from __future__ import annotations

from datetime import datetime

from temporalio import workflow

from workflows.node_base import POLL
from workflows.node_replacement import ReplacementSteps

with workflow.unsafe.imports_passed_through():
    from fleetmedic import activity_refs as refs
    from fleetmedic.listing import first_few
    from fleetmedic.models import (
        NodeInfo,
        SlurmJob,
        Taint,
        Validate,
        WaitNodeReady,
    )


class ReturnSteps(ReplacementSteps):
    """Ready, validated, burnt in, returned, jobs resumed."""

    async def return_when_healthy(self, jobs: list[SlurmJob], requested_at: datetime, summary: str, *,
                                  rejoined: bool = True, taint: Taint | None = None) -> str:
        """Follow a replacement to its new node → wait for Ready and validate → burn in → return to
        service → release the lease → confirm the jobs resumed → record the outcome. A node that does
        not come back healthy stays quarantined; one that fails its burn-in goes back to the provider."""
        assert self.policy is not None
        round = 1
        while True:
            if not await self.follow_replacement():
                return await self.stay_out(f"no replacement for {self.node} after {summary}")
            if not await self.wait_back_and_validate(requested_at, self.node_gpus or None, rejoined=rejoined):
                return await self.stay_out(f"not back in service after {summary}")
            if await self.burn_in_passes(round):
                break
            if round >= self.policy.burn_in.rounds:
                return await self.stay_out(f"failed its burn-in {round} time(s) after {summary}")
            round += 1
            self.replaced_signal = None  # a person doing it by hand says so again for this round
            requested_at, rejoined = workflow.now(), True
            await self.ask_provider("replace", f"{self.node} failed its burn-in after {summary}", round=round)
        if self.replaced_from is not None:
            summary += f"; {self.replaced_from} replaced by {self.node}"
            taint = None  # the taint was the old node's; the new one was cordoned
        await self.return_to_service(resume_slurm=True, taint=taint)
        await self.release_lease()
        await self.retire_replaced()
        stuck = await self.confirm_jobs_resumed(jobs)
        summary += "; node back in service"
        if jobs:
            summary += f"; {len(jobs) - len(stuck)}/{len(jobs)} job(s) resumed"
        if self.left_past_pdb:
            summary += (f" ({len(self.left_past_pdb)} pod(s) left on the node past their PodDisruptionBudget: "
                        f"{', '.join(self.left_past_pdb)})")
        return await self.record_outcome("remediated", summary, warning=bool(stuck or self.left_past_pdb))

    async def stay_out(self, why: str) -> str:
        await self.leave_quarantined(f"{why}: see {self.workflow_id}")
        await self.release_lease()
        await self.retire_replaced()
        return await self.record_outcome("quarantined", f"node {self.node} did not come back healthy; left out of "
                                                        f"service ({why})", warning=True)

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
            window = deadline - workflow.now()
            after = since if rejoined and not self.replaced_signal and not self.new_machine else None
            back = await self.call(
                "wait for node Ready", refs.WAIT_NODE_READY,
                WaitNodeReady(node=self.node, since=after, timeout_s=max(window.total_seconds(), 1)),
                timeout=window + self.call_timeout(), heartbeat=self.wait_heartbeat(),
                summary="wait for node Ready: watch", task_queue=self.context.wait_queue,
                until=self.repaired_in_place if after is not None else None)
            self.check_abort()
        if back is None:
            self.decide("wait for node Ready", f"node {self.node} did not come back Ready within "
                                               f"{self.policy.grace.node_ready_deadline}")
            return False
        self.decide("wait for node Ready", f"node {self.node} Ready since {back.ready_since}")
        await self.hold_replacement()
        self.enter("validate")
        verdict = await self.call("validate", refs.AGENT_VALIDATE,
                                  Validate(node=self.node, since=requested_at, expected_gpus=expected_gpus))
        if verdict is None or not verdict.available:
            self.decide("validate", "skipped: " + (verdict.detail if verdict else "skipped by an operator"))
            return True
        failed = [f"{c.name}={c.value}" for c in verdict.checks if not c.passed]
        self.decide("validate", "passed" if verdict.passed else f"failed: {', '.join(failed)}")
        return verdict.passed

    def repaired_in_place(self) -> bool:
        """A person says the node was repaired (`replaced`, no new name) while the run waits for a
        Ready after its request: the node's present Ready counts, so the wait starts again without
        `since` (an in-place repair may never have taken the node NotReady)."""
        return self.replaced_signal is not None

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
                    self.decide("confirm jobs resumed", f"job {job_id} runs again on {first_few(job.nodes, 8)} "
                                                        f"(restart {job.restart_count})")
                    del pending[job_id]
            if pending:
                self.waiting_for = f"job(s) {sorted(pending)} running again"
                await self.sleep(POLL, summary="confirm jobs resumed: poll")
        for job_id in pending:
            self.decide("confirm jobs resumed", f"job {job_id} did not run again within "
                                                f"{self.policy.grace.job_resume_deadline}")
        return sorted(pending)

