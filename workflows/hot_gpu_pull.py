"""hot-gpu-pull: Krea's rule. "If there is any GPU above 78 °C, you remove it. Don't try to fix it."

1. confirm the GPU is still hot with a fresh reading from the node agent (a GPU that cooled
   down ends the run as `recovered`, nothing touched);
2. open the run's Slack thread, check the lemon rule (hot GPUs count like any remediation);
3. take a disruption lease (and confirm again if it took long to come);
4. out of service: `immediate` — Slurm DOWN (jobs get SIGTERM) and the grace for checkpoints;
   `at-checkpoint` — Slurm DRAIN (jobs keep running) until each job's next checkpoint or the
   policy's deadline; either way the node is cordoned at once and the jobs requeued after;
5. drain the Kubernetes node, ask the provider to replace the GPU;
6. wait for the node Ready and validated, return it to service, release the lease, confirm the
   jobs run again, record the outcome.
"""

from __future__ import annotations

from typing import Any

from temporalio import workflow

from workflows.node_runbook import NodeRunbook, NothingToDo, gpu_name

with workflow.unsafe.imports_passed_through():
    from fleetmedic import activity_refs as refs
    from fleetmedic.models import GpuReading, RunbookStatus, SlurmNodeState


@workflow.defn(name="hot-gpu-pull")
class HotGpuPull(NodeRunbook):
    runbook = "hot-gpu-pull"

    @workflow.init
    def __init__(self, raw: dict[str, Any]) -> None:
        self._init_run(raw)

    @workflow.run
    async def run(self, raw: dict[str, Any]) -> RunbookStatus:
        """Returns the run's report: outcome, every decision with its reason, every change made."""
        return await self.run_to_outcome(self.pull)

    async def pull(self) -> str:
        policy = await self.load()
        hot = await self.confirm_hot()

        self.enter("notify")
        self.open_thread(f":fire: GPU {gpu_name(hot.gpu)} of `{self.node}` runs hot: {self._heat(hot)}. "
                         "Pulling it, not fixing it.", after_protect=True)
        why = f"GPU {gpu_name(hot.gpu)} on {self.node} runs at {_temperature(hot)}"
        reason = f"fleetmedic: GPU {gpu_name(hot.gpu)} hot, {_temperature(hot)} ({self.workflow_id})"
        if lemon := await self.protect_then_count(reason):
            return await self.retire_lemon(lemon, SlurmNodeState.DOWN, why)

        thermal = policy.thermal
        if thermal.pull_mode == "immediate":
            state, grace = SlurmNodeState.DOWN, policy.grace.checkpoint
        else:
            # DRAIN: running jobs keep running (no SIGTERM) until their next periodic checkpoint.
            state, grace = SlurmNodeState.DRAIN, thermal.at_checkpoint_deadline
        self.decide("classify", f"{why}: pull {thermal.pull_mode} (policy thermal.pull_mode)")
        jobs = await self.take_out_and_drain(state, reason, grace, recheck=self.confirm_hot)

        requested_at = workflow.now()
        await self.ask_provider("replace", why)
        return await self.return_when_healthy(jobs, requested_at, f"hot GPU {gpu_name(hot.gpu)} "
                                                                  f"({_temperature(hot)}) replaced")

    async def confirm_hot(self) -> GpuReading:
        """A fresh reading: the hottest GPU the policy calls too hot among those the run's alerts
        name (every GPU when one names none). Raises NothingToDo when they cooled down. Without a
        node agent the alert, which held for the policy's `sustain`, is the evidence."""
        assert self.policy is not None
        thermal = self.policy.thermal
        self.enter("confirm still hot")
        readings = await self.call("confirm still hot", refs.AGENT_GPUS, self.node)
        if readings is None or not readings.available:
            self.decide("confirm still hot", "no fresh reading ("
                        + (readings.detail if readings else "skipped by an operator")
                        + f"): acting on the alert, which held for {thermal.sustain}")
            return GpuReading(gpu=self.input.gpu, temperature_c=self.input.temperature_c)
        alerted = self.alerted_gpus() if self.confirms_alerted_gpus else {self.input.gpu}
        candidates = [g for g in readings.gpus if None in alerted or g.gpu in alerted]
        hot = sorted((g for g in candidates if thermal.too_hot(g.temperature_c, g.thermal_margin_c)),
                     key=lambda g: -(g.temperature_c or 0))
        if not hot:
            now = ", ".join(f"GPU {g.gpu} {_temperature(g)}" for g in candidates) or "no such GPU"
            named = ", ".join(gpu_name(gpu) for gpu in sorted(alerted, key=lambda gpu: -1 if gpu is None else gpu))
            raise NothingToDo("recovered", f"GPU {named} cooled down before any action ({now}); nothing was changed")
        self.decide("confirm still hot", f"still hot: GPU {hot[0].gpu} {self._heat(hot[0])}")
        return hot[0]

    def alerted_gpus(self) -> set[int | None]:
        """The GPUs this run's firing alerts name: the one that started it, and each attached since
        (resends aside). Alertmanager groups a node's alerts (deploy/alertmanager: one group per node),
        so another GPU's hot alert comes to this run, answered `attached`, and is not sent again before
        the route's repeat_interval: a first GPU that cooled down must not end the run while another
        is still hot. None among them: an alert that names no GPU (every GPU is read then)."""
        gpus: set[int | None] = {self.input.gpu}
        for alert in self.new_alerts(1 if self.input.alert is not None else 0):
            if alert.status == "firing":
                gpus.add(self.alert_xid_gpu(alert)[1])  # a label that is no GPU number: None, every GPU
        return gpus

    def _heat(self, reading: GpuReading) -> str:
        assert self.policy is not None
        return self.policy.thermal.too_hot(reading.temperature_c, reading.thermal_margin_c) or _temperature(reading)


def _temperature(reading: GpuReading) -> str:
    return "? °C" if reading.temperature_c is None else f"{reading.temperature_c:g} °C"
