"""migrate-back/<cluster>: training finished, inference comes home slowly so production never
notices — and no money is spent on rented GPUs once home has room.

1. confirm: GPUs free in-cluster for every pod away, and no training (admitted, or pending
   behind inference) to take them;
2. stop a running traffic-flip and wait for it (the two never act together);
3. close the virtual node(s): the overflow taint back as NoSchedule — never NoExecute, which
   would evict everything at once;
4. in batches (policy size and pacing; never more of a Deployment than its ready replicas above
   its minimum, whatever its PDB allows; opted-out Deployments and namespaces stay where they
   are): evict a batch from the virtual node (PDBs honoured), wait
   until the replacements are Ready in-cluster, check the SLO gate (ready replicas at or above
   the minimum; the policy's Prometheus query when it names one), then the next batch;
5. stop at once — taint off again, pods where they are — when training takes the GPUs again or
   traffic-flip starts (a batch's eviction and its wait for replacements end there too); wait when
   paused; a failed SLO gate pauses and escalates;
6. record: pods moved, time taken, the lowest ready/minimum ratio seen.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

from temporalio import workflow

from workflows.runbook import RunbookAborted, abort_alone
from workflows.traffic_steps import Stopped, TrafficRunbook

with workflow.unsafe.imports_passed_through():
    from fleetmedic import activity_refs as refs
    from fleetmedic.listing import first_few
    from fleetmedic.models import EvictionReport, RunbookStatus
    from fleetmedic.traffic import (
        EvictPods,
        HomeReport,
        SloCheck,
        WaitHome,
        home_free,
        next_batch,
    )


HEADROOM_POLL = timedelta(seconds=2)
# Since 0.2.0 a stop (traffic-flip starting: training wants the GPUs again) ends a batch's eviction
# and its wait for replacements at once, and never reaches the SLO gate's escalation; 0.1.0 runs
# finish the batch first (up to batch_timeout), then stop at the next gate (docs/upgrading.md).
STOP_ENDS_BATCH = "stop-ends-batch-wait"


@workflow.defn(name="migrate-back")
class MigrateBack(TrafficRunbook):
    runbook = "migrate-back"
    other = "traffic-flip"

    @workflow.init
    def __init__(self, raw: dict[str, Any]) -> None:
        self._init_run(raw)
        self.moved = 0
        self.lowest = float("inf")
        self.left_away: list[str] = []
        self.no_headroom_since: datetime | None = None
        self.stop_ends_batch = False

    @workflow.run
    async def run(self, raw: dict[str, Any]) -> RunbookStatus:
        return await self.run_to_end(self.migrate)

    async def migrate(self) -> RunbookStatus:
        self.stop_ends_batch = workflow.patched(STOP_ENDS_BATCH)  # before the policy's local activity
        snap = await self.begin()
        nodes = snap.virtual_nodes
        if not snap.on_virtual and not snap.virtual_open:
            return await self.record("nothing-to-move", "no inference pod is away and the virtual node is closed", [])
        ready, why = home_free(snap)
        self.decide("confirm", why)
        if not ready:
            return await self.record("not-yet", why, [])
        self.open_thread(f":house: training is done on `{self.cluster}`: {len(snap.on_virtual)} inference pod(s) "
                         "come home in batches.")
        started = workflow.now()
        try:
            await self.stop_other()
            await self.gate("close the virtual node")
            await self.set_overflow(nodes, closed=True, step="close the virtual node")
            await self.move_home()
        except Stopped as stopped:
            await self.set_overflow(nodes, closed=False, step="reopen the virtual node")
            return await self.record("stopped", f"stopped after {self.moved} pod(s): {stopped.why}; the virtual node "
                                                "is open again and pods stay where they are", nodes, warning=True)
        except RunbookAborted as aborted:
            return await self.record("aborted", f"aborted by {aborted.by} after {self.moved} pod(s): "
                                                f"{aborted.reason}", nodes, warning=True)
        took = workflow.now() - started
        lowest = "never below" if self.lowest >= 1 else f"{self.lowest:.0%} of"
        workflow.metric_meter().with_additional_attributes({"cluster": self.cluster}).create_histogram_timedelta(
            "fleetmedic_traffic_migrate_back_duration", "time to bring inference home").record(took)
        left = f"; left on the virtual node: {first_few(self.left_away, 5)}" if self.left_away else ""
        return await self.record("migrated", f"{self.moved} pod(s) home in {took}; ready replicas {lowest} "
                                             f"the minimum{left}", nodes, warning=bool(self.left_away))

    async def move_home(self) -> None:
        traffic = self.traffic
        planned: set[str] = set()  # a dry run's pods already counted as moved (nothing moves for real)
        while True:
            await self.gate("move a batch home")
            snap = await self.snapshot("move a batch home")
            if snap.training:
                raise Stopped("training took the GPUs again: "
                              + ", ".join(f"{w.namespace}/{w.name}" for w in snap.training))
            if planned:
                snap = snap.model_copy(update={"pods": [p for p in snap.pods if p.ref not in planned]})
            chosen = next_batch(snap, traffic.batch_size, traffic.min_ready_fraction)
            if not chosen.pods and not chosen.waiting:
                if chosen.left:
                    self.left_away = chosen.left
                    self.decide("move a batch home", "left on the virtual node: " + ", ".join(chosen.left))
                return
            if not chosen.pods:  # every Deployment at its minimum: wait for replacements to be Ready
                await self.wait_for_headroom()
                continue
            self.no_headroom_since = None
            batch, last = chosen.pods, not chosen.waiting
            home_before = sum(d.ready_in_cluster for d in snap.deployments)
            # Both steps of a batch wait up to batch_timeout (a PDB, replicas not Ready yet): an
            # operator's abort ends them then, not when the batch is done.
            report = await self.call("move a batch home", refs.TRAFFIC_EVICT, EvictPods(
                pods=[p.ref for p in batch], deadline_s=traffic.batch_timeout.total_seconds(),
                dry_run=self.dry_run), timeout=traffic.batch_timeout + timedelta(minutes=1),
                heartbeat=self.evicting_heartbeat(), task_queue=self.waits_queue(), until=self.batch_until())
            if report is None:
                continue  # skipped, or stopped: the gate says which
            self.decide("move a batch home", ("would evict " if report.dry_run else "evicted ")
                        + ", ".join(report.evicted) + (f"; not yet: {', '.join(p.pod for p in report.failed)}"
                                                       if report.failed else ""))
            if self.dry_run:
                self.moved += len(batch)
                planned.update(p.ref for p in batch)
                if last:
                    return
                continue
            home = await self.call("wait for replacements", refs.TRAFFIC_WAIT_HOME, WaitHome(
                in_cluster_ready=home_before + len(report.evicted), min_fraction=traffic.min_ready_fraction,
                timeout_s=traffic.batch_timeout.total_seconds()),
                timeout=traffic.batch_timeout + timedelta(minutes=1), heartbeat=self.wait_heartbeat(),
                task_queue=self.waits_queue(), until=self.batch_until())
            if home is not None:
                self.lowest = min(self.lowest, home.min_ready_ratio)
            self.moved += len(report.evicted)
            if self.stop_ends_batch:
                self.check_stop()  # training is back: these pods' replacements may never find room here
            await self.slo_gate(home, report)
            if traffic.batch_pause:
                await self.sleep(traffic.batch_pause, summary="pace between batches")

    def batch_until(self) -> Callable[[], bool]:
        return self.stopping if self.stop_ends_batch else abort_alone

    async def wait_for_headroom(self) -> None:
        """Every Deployment with pods away is at its minimum of ready replicas: wait for the last
        batch's replacements. Past the batch timeout a person is asked (the SLO gate's escalation)."""
        traffic = self.traffic
        if self.no_headroom_since is None:
            self.no_headroom_since = workflow.now()
        if workflow.now() - self.no_headroom_since > traffic.batch_timeout:
            self.no_headroom_since = None
            self.enter("SLO gate")
            answer = await self.escalate("SLO gate", "every Deployment with pods away has been at its minimum of "
                                                     f"ready replicas for {traffic.batch_timeout}: none can move "
                                                     "without going below it — the migration is paused")
            if answer.action == "abort":
                raise RunbookAborted(answer.by, answer.reason or "no headroom")
            return
        self.waiting_for = "a Deployment above its minimum of ready replicas (replacements starting)"
        await self.sleep(HEADROOM_POLL, summary="move a batch home: wait for headroom")

    async def slo_gate(self, home: HomeReport | None, report: EvictionReport) -> None:
        """Every pod of the batch left, replacements Ready at home with every Deployment at its minimum,
        the policy's query within bounds; else the migration pauses here and escalates."""
        traffic = self.traffic
        failures = []
        if report.failed:
            failures.append(f"could not evict {len(report.failed)} pod(s) within {traffic.batch_timeout}: "
                            + ", ".join(f"{p.pod} ({p.reason})" for p in report.failed[:5]))
        if home is not None and not home.done:
            failures.append("replacements not Ready in-cluster within "
                            f"{traffic.batch_timeout}" + (f"; below minimum: {', '.join(home.below_minimum)}"
                                                          if home.below_minimum else ""))
        if traffic.slo_query:
            slo = await self.call("SLO gate", refs.TRAFFIC_SLO,
                                  SloCheck(query=traffic.slo_query, max_value=traffic.slo_max))
            if slo is not None and slo.available and not slo.passed:
                failures.append(f"SLO: {slo.detail}")
            elif slo is not None:
                self.decide("SLO gate", slo.detail or "passed")
        if not failures:
            return
        if self.stop_ends_batch:
            self.check_stop()  # stopping anyway: nothing for a person to decide
        self.enter("SLO gate")
        answer = await self.escalate("SLO gate", "; ".join(failures) + " — the migration is paused")
        if answer.action == "abort":
            raise RunbookAborted(answer.by, answer.reason or "SLO gate failed")

