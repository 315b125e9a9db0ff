"""traffic-flip/<cluster>: training takes the cluster, inference moves out without dropping traffic.

1. confirm: training at or above the policy priority (admitted, or pending where it would fit
   without inference: Kueue is preempting for it) leaves inference short of GPUs;
2. stop a running migrate-back and wait for it (the two never act together);
3. optionally pre-warm external capacity through the provider, and wait for it;
4. open the virtual-kubelet node(s): remove the overflow taint (idempotent, optimistic concurrency);
5. watch inference: each selected Deployment keeps its minimum of ready replicas; below it for
   longer than the grace, escalate;
6. record the flip: Event, Slack, metrics (pods moved out, time below the minimum — target zero).
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from temporalio import workflow

from workflows.runbook import RunbookAborted
from workflows.traffic_steps import Stopped, TrafficRunbook

with workflow.unsafe.imports_passed_through():
    from fleetmedic import activity_refs as refs
    from fleetmedic.models import ProviderRequest, RunbookStatus
    from fleetmedic.traffic import flip_needed

WATCH_POLL = timedelta(seconds=2)


@workflow.defn(name="traffic-flip")
class TrafficFlip(TrafficRunbook):
    runbook = "traffic-flip"
    other = "migrate-back"

    @workflow.init
    def __init__(self, raw: dict[str, Any]) -> None:
        self._init_run(raw)

    @workflow.run
    async def run(self, raw: dict[str, Any]) -> RunbookStatus:
        return await self.run_to_end(self.flip)

    async def flip(self) -> RunbookStatus:
        snap = await self.begin()
        needed, why = flip_needed(snap)
        self.decide("confirm", why)
        if not needed:
            return await self.record("not-needed", why, [])
        self.open_thread(f":arrows_counterclockwise: training takes `{self.cluster}`: {why}. Inference moves to "
                         "external GPUs.")
        try:
            await self.stop_other()
            await self.prewarm(snap.inference_gpus, snap.virtual_gpus, snap.virtual_nodes)
            await self.gate("open the virtual node")
            await self.set_overflow(snap.virtual_nodes, closed=False, step="open the virtual node")
            below_s = await self.watch()
        except (Stopped, RunbookAborted) as stopped:
            why = stopped.why if isinstance(stopped, Stopped) else f"aborted by {stopped.by}: {stopped.reason}"
            return await self.record("stopped", f"stopped: {why}", snap.virtual_nodes, warning=True)
        final = await self.snapshot("record outcome")
        moved = len(final.on_virtual)
        meter = workflow.metric_meter().with_additional_attributes({"cluster": self.cluster})
        meter.create_histogram_float("fleetmedic_traffic_seconds_below_minimum",
                                     "seconds inference spent below its minimum ready replicas", "s").record(below_s)
        meter.create_gauge("fleetmedic_traffic_pods_away", "inference pods on virtual nodes").set(moved)
        return await self.record("flipped", f"{moved} inference pod(s) on {', '.join(snap.virtual_nodes)}; "
                                            f"{below_s:.0f} s below the minimum of ready replicas",
                                 snap.virtual_nodes, warning=below_s > 0)

    async def prewarm(self, need: int, have: int, nodes: list[str]) -> None:
        """Ask the provider for external capacity before inference needs it, and wait (bounded)."""
        traffic = self.traffic
        if not traffic.prewarm or not nodes:
            return
        self.enter("pre-warm")
        if have >= need:
            self.decide("pre-warm", f"external capacity {have} GPUs already covers inference's {need}")
            return
        await self.gate("pre-warm")  # rented GPUs cost money: the gate first
        result = await self.call("pre-warm", refs.PROVIDER_REQUEST, ProviderRequest(
            cluster=self.cluster, node=nodes[0], action="prewarm", reason=f"inference needs {need} GPUs outside",
            idempotency_key=f"{self.workflow_id}/{workflow.info().first_execution_run_id}/prewarm",
            dry_run=self.dry_run), retry=self.retry("writes"))
        if result is None or result.needs_human:
            # Waiting on a person here would leave inference without a home: flip without it.
            self.decide("pre-warm", f"{result.provider} cannot pre-warm ({result.detail}): flipping without it"
                        if result else "skipped by an operator")
            return
        self.decide("pre-warm", f"{result.provider}: {result.detail or 'accepted'}")
        if self.dry_run:
            return
        deadline = workflow.now() + traffic.prewarm_timeout
        while workflow.now() < deadline:
            snap = await self.snapshot("pre-warm")
            if snap.virtual_gpus >= need:
                self.decide("pre-warm", f"external capacity ready: {snap.virtual_gpus} GPUs")
                return
            self.waiting_for = f"external capacity of {need} GPUs (now {snap.virtual_gpus})"
            await self.sleep(WATCH_POLL, summary="pre-warm: poll")
        self.decide("pre-warm", f"external capacity not ready within {traffic.prewarm_timeout}: flipping anyway")

    async def watch(self) -> float:
        """Seconds inference spent below its minimum during the watch; escalates once past the grace."""
        traffic = self.traffic
        self.enter("watch inference")
        until = workflow.now() + traffic.watch_duration
        below_since: datetime | None = None
        below_total = 0.0
        escalated = False
        last = workflow.now()
        while workflow.now() < until and self.stop_request is None:
            snap = await self.snapshot("watch inference")
            now = workflow.now()
            below = snap.below_minimum(traffic.min_ready_fraction)
            if below:
                below_total += (now - last).total_seconds() if below_since else 0.0
                below_since = below_since or now
                if not escalated and now - below_since > traffic.below_minimum_grace:
                    escalated = True
                    assert self.policy is not None
                    self.decide("watch inference", f"below the minimum for over {traffic.below_minimum_grace}: "
                                                   + ", ".join(below))
                    await self.say(f":rotating_light: inference below its minimum ready replicas for over "
                                   f"{traffic.below_minimum_grace}: {', '.join(below)}",
                                   mention=self.policy.escalation.slack_mention)
            else:
                below_since = None
            last = now
            self.waiting_for = f"inference at its minimum until {until.isoformat()}"
            await self.sleep(WATCH_POLL, summary="watch inference: poll")
        self.decide("watch inference", "watch ended" + (" early: migrate-back started" if self.stop_request else ""))
        return below_total
