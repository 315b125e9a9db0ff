"""suspect-node: a node the job failures point at gets a trial, not a sentence.

The job-failures runbook starts it with the evidence ("gpu-node-7 was in 3 of the last 3 failed
allocations of job 4412 (NCCL timeout); the other 15 nodes varied"); a person may start it from the
UI with evidence of their own. On the shared node steps, behind the fleet guard, the gate, the
opt-outs and approvals like any destructive runbook:

1. the protective step (cordon + Slurm DRAIN, under the cordon breaker), the lemon count;
2. the lease; jobs on the node get the checkpoint signal and grace, Slurm DOWN, requeue; drain;
3. the burn-in (policy `burn_in`: a Slurm job alone on the node in a reservation of its own —
   NCCL all-reduce across its GPUs, `dcgmi diag -r 3`, or the site's script);
4. passed → the node returns to service, and its suspicion is cleared (the job-failures runbook no
   longer counts the failures before the trial); failed → the provider replaces it and the
   replacement is validated and burnt in like any (node_return.py), which the lemon rule counts.
   No burn-in possible (policy `burn_in` off, or no Slurm) → it stays out, and a person decides.
"""

from __future__ import annotations

from typing import Any

from temporalio import workflow

from workflows.node_runbook import NodeRunbook

with workflow.unsafe.imports_passed_through():
    from fleetmedic.job_failures import SuspectNodeInput
    from fleetmedic.models import RunbookStatus, SlurmNodeState


@workflow.defn(name="suspect-node")
class SuspectNode(NodeRunbook):
    runbook = "suspect-node"

    @workflow.init
    def __init__(self, raw: dict[str, Any]) -> None:
        # The node steps take the node runbook's input; the evidence is this runbook's own. Started like
        # any node runbook (`fleetmedic run suspect-node --node N`, an alert's route), the node runbook's
        # other fields come empty and are left out.
        given = {k: v for k, v in (raw if isinstance(raw, dict) else {}).items()
                 if not (k in NODE_RUNBOOK_ONLY and v is None)}
        self.evidence = str(given.get("evidence") or "")[:2000]
        self._init_run({k: v for k, v in given.items() if k in ("cluster", "node", "dry_run", "requested_by", "alert")})
        if self.invalid is None and (error := _input_error({k: v for k, v in given.items() if k != "alert"})):
            self.invalid = error

    @workflow.run
    async def run(self, raw: dict[str, Any]) -> RunbookStatus:
        """Returns the run's report: outcome, every decision with its reason, every change made."""
        return await self.run_to_outcome(self.try_node)

    async def try_node(self) -> str:
        policy = await self.load()
        evidence = self.evidence or f"named by {self.input.requested_by}"
        self.enter("notify")
        self.open_thread(f":mag: `{self.node}` is a suspect: {evidence}. Trial: drain and burn-in; it comes back if "
                         "it passes, and is replaced if it fails.", after_protect=True)
        self.decide("classify", f"suspect: {evidence}")
        reason = f"fleetmedic: suspect, job failures ({self.workflow_id})"
        if lemon := await self.protect_then_count(reason):
            return await self.retire_lemon(lemon, SlurmNodeState.DOWN, f"suspect: {evidence}")
        jobs = await self.take_out_and_drain(SlurmNodeState.DOWN, reason, policy.grace.checkpoint)

        # A trial, not a sentence: only a failed burn-in sends the node to the provider. Where no burn-in
        # can run, nothing clears it and nothing convicts it: it stays out and a person decides.
        if not policy.burn_in.enabled or not self.context.slurm_enabled:
            why = ("policy burn_in is off" if not policy.burn_in.enabled
                   else "the burn-in is a Slurm job and Slurm is not configured")
            self.decide("burn-in", f"no trial possible: {why}; the node stays out for a person to test")
            await self.leave_quarantined(f"suspect ({evidence}), and no burn-in can try it ({why}): a person tests it")
            await self.release_lease()
            return await self.record_outcome("quarantined", f"{self.node} left out of service for a person to test: "
                                                            f"{why}", warning=True)
        if await self.burn_in_passes(1):
            await self.return_to_service(resume_slurm=True)
            await self.release_lease()
            stuck = await self.confirm_jobs_resumed(jobs)
            return await self.record_outcome("recovered", f"{self.node} passed its burn-in: back in service and "
                                                          "cleared of suspicion", warning=bool(stuck))
        requested_at = workflow.now()
        await self.ask_provider("replace", f"suspect ({evidence}) failed its burn-in")
        return await self.return_when_healthy(jobs, requested_at, "suspect failed its burn-in: replaced")


NODE_RUNBOOK_ONLY = ("gpu", "xid", "linked_xid", "temperature_c", "alert")


def _input_error(raw: dict[str, Any]) -> str | None:
    try:
        SuspectNodeInput.model_validate(raw)
    except ValueError as exc:
        return str(exc).splitlines()[0]
    return None
