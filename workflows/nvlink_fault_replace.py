"""nvlink-fault-replace: NVLink errors climb (CRC, replay, recovery) or a link is down — the
single-node failures where the GPUs "seem to be fine". XID 74 routes here too.

1. open the run's Slack thread, check the lemon rule;
2. take a disruption lease;
3. quarantine from training at once: Slurm DOWN (jobs get SIGTERM, grace for checkpoints,
   requeue) and, when policy keeps the node serving inference ("whatever GPU works"), the
   degraded taint that inference tolerates and training does not, with only the training pods
   evicted; otherwise the cordon and a full drain;
4. ask the provider to replace it (approval when policy asks);
5. when the node is back Ready and validated: the degraded taint comes off, Slurm RESUMEs,
   the lease goes back, the requeued jobs are confirmed running, the outcome recorded.
"""

from __future__ import annotations

from typing import Any

from temporalio import workflow

from workflows.node_runbook import NodeRunbook, gpu_name

with workflow.unsafe.imports_passed_through():
    from fleetmedic.models import RunbookStatus, SlurmNodeState, Taint
    from fleetmedic.selectors import negate_equality


@workflow.defn(name="nvlink-fault-replace")
class NvlinkFaultReplace(NodeRunbook):
    runbook = "nvlink-fault-replace"

    @workflow.init
    def __init__(self, raw: dict[str, Any]) -> None:
        self._init_run(raw)

    @workflow.run
    async def run(self, raw: dict[str, Any]) -> RunbookStatus:
        """Returns the run's report: outcome, every decision with its reason, every change made."""
        return await self.run_to_outcome(self.replace)

    async def replace(self) -> str:
        policy = await self.load(self.input.xid)
        fault = self.fault()
        self.enter("notify")
        self.open_thread(f":link: {fault} on `{self.node}`: out of training"
                         + (", still serving inference," if policy.nvlink.keep_serving_inference else ",")
                         + " and replaced", after_protect=True)
        why = f"{fault} on {self.node}"
        reason = f"fleetmedic: {fault} ({self.workflow_id})"
        taint: Taint | None = None
        training_only: str | None = None
        if policy.nvlink.keep_serving_inference:
            taint = Taint.parse(policy.nvlink.degraded_taint)
            training_only = negate_equality(policy.nvlink.inference_selector)
        if lemon := await self.protect_then_count(reason, taint):
            return await self.retire_lemon(lemon, SlurmNodeState.DOWN, why)

        if taint is not None:
            self.decide("classify", f"{why}: out of training, kept for inference behind the taint {taint} "
                                    "(policy nvlink.keep_serving_inference)")
        else:
            self.decide("classify", f"{why}: full drain (policy nvlink.keep_serving_inference is off)")
        jobs = await self.take_out_and_drain(SlurmNodeState.DOWN, reason, policy.grace.checkpoint,
                                             taint=taint, drain_selector=training_only)

        requested_at = workflow.now()
        await self.ask_provider("replace", why)
        return await self.return_when_healthy(jobs, requested_at, f"{fault}: replaced", taint=taint)

    def fault(self) -> str:
        gpu = f" on GPU {gpu_name(self.input.gpu)}" if self.input.gpu is not None else ""
        if self.input.xid is not None:
            return f"XID {self.input.xid} (NVLink){gpu}"
        alertname = self.input.alert.labels.get("alertname", "") if self.input.alert else ""
        if alertname.endswith("Down"):
            return f"NVLink link down{gpu}"
        return f"NVLink errors{gpu}"
