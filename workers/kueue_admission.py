"""Kueue's own decisions start the traffic runbooks, beside the alert routes (DESIGN, runbooks 4-5).

- traffic-flip/<cluster> when a Workload at or above `traffic.training_priority` is admitted, or is
  pending (active, not finished): Kueue preempts inference for it the moment it decides, so the
  overflow must open as soon as training wants the GPUs, not once it holds them. The flip itself
  confirms with its own numbers (a pending Workload counts only where it would fit without
  inference); a flip is started once per new training Workload, not at every look.
- migrate-back/<cluster> when no such Workload is left (every one finished, deleted or
  deactivated) and inference is still away or the overflow still open. One that answers
  `not-yet` (the GPUs are not free yet) is started again at the next look; any other outcome
  ends the attempt until training comes and goes again.

One run per cluster, as from alerts: the same workflow IDs, started or attached to
(activities/start.py), so several worker replicas doing this at once start one run.

A watch, not a Temporal Schedule over a list: Kueue preempts inference as it admits training, and
inference is short of replicas until the overflow opens; a watch starts the flip within a fraction
of a second of Kueue's decision, where a Schedule would add up to its period (and a history write
per period, forever, for a decision that changes a few times a day). What a Schedule would have
given for free is kept: the first look is a full list, made when the worker starts (a restart
misses nothing: a training that ended meanwhile starts migrate-back then), and again every
`traffic.kueue_resync` (a watch that broke, an event lost).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

from kubernetes import watch
from temporalio.client import Client, WorkflowHandle

from activities.kueue import GROUP, KueueActivities, training_workloads
from activities.start import RUNBOOK_TASK_TIMEOUT, start_or_attach
from activities.traffic import TrafficActivities
from fleetmedic.details import run_details
from fleetmedic.ids import cluster_workflow_id, run_summary, start_attributes
from fleetmedic.models import RunbookStatus
from fleetmedic.traffic import TrafficInput, TrainingWorkload

log = logging.getLogger(__name__)

WATCH_S = 300  # one watch request's window, renewed after
# Events come in bursts (Kueue writes a Workload several times as it admits it): looked at together.
SETTLE_S = 0.2
REQUESTED_BY = "kueue"


class KueueAdmission:
    """One per worker: watches Kueue's Workloads and starts traffic-flip / migrate-back."""

    def __init__(self, client: Client, traffic: TrafficActivities, *, cluster: str, task_queue: str) -> None:
        self.client, self.traffic, self.cluster, self.task_queue = client, traffic, cluster, task_queue
        self.kueue: KueueActivities = traffic.kueue
        self.policy = traffic.traffic
        # The training Workloads (UIDs) flips were started for since training last came; None: this
        # worker has not looked yet.
        self.flipped_for: set[str] | None = None
        self.home_wanted = False
        self.migrating: asyncio.Task[None] | None = None
        self._stopped = threading.Event()
        self._task: asyncio.Task[None] | None = None

    # --- lifecycle ---------------------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="kueue-admission")

    async def stop(self) -> None:
        self._stopped.set()
        for task in (self._task, self.migrating):
            if task is not None and not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        wake = asyncio.Event()
        threading.Thread(target=self._watch, args=(loop, wake), name="fleetmedic-kueue-watch", daemon=True).start()
        resync = self.policy.kueue_resync.total_seconds()
        while not self._stopped.is_set():
            wake.clear()
            try:
                await self.look()
            except Exception as exc:  # the API or Temporal unreachable: said, and tried again
                log.warning("Kueue admission for %s: %s; looking again within %.0f s", self.cluster, exc, resync)
            try:
                await asyncio.wait_for(wake.wait(), resync)
                await asyncio.sleep(SETTLE_S)
            except TimeoutError:
                pass

    def _watch(self, loop: asyncio.AbstractEventLoop, wake: asyncio.Event) -> None:
        """Wakes the loop at every change of a Workload (in this thread: the client blocks)."""
        while not self._stopped.is_set():
            try:
                version = self.kueue.version()
                if version is None:  # Kueue not installed (yet): the resync looks again
                    self._stopped.wait(self.policy.kueue_resync.total_seconds())
                    continue
                k8s = self.kueue.k8s
                for _event in watch.Watch().stream(k8s.custom.list_cluster_custom_object, GROUP, version, "workloads",
                                                   timeout_seconds=WATCH_S, _request_timeout=WATCH_S + k8s.timeout):
                    if self._stopped.is_set():
                        return
                    loop.call_soon_threadsafe(wake.set)
            except Exception as exc:  # a broken watch, the API down: the resync covers the gap
                log.debug("Kueue Workload watch: %s; watching again", exc)
                self._stopped.wait(1)

    # --- deciding ----------------------------------------------------------------------------------

    async def look(self) -> None:
        workloads = await asyncio.to_thread(self.kueue.objects, "workloads")
        if workloads is None:
            return  # no Kueue here: alerts alone start the traffic runbooks
        gpu = self.traffic.k8s.policy.labels.gpu_resource
        training = training_workloads(workloads, gpu, self.policy.training_priority)
        first = self.flipped_for is None
        flipped = self.flipped_for or set()
        if training:
            self.home_wanted = False
            new = [w for w in training if (w.uid or w.ref) not in flipped]
            if new:
                await self._start("traffic-flip", "Kueue: " + _named(new))
            # Only once started: a start Temporal refused is tried again at the next look.
            self.flipped_for = flipped | {w.uid or w.ref for w in training}
            return
        # No training: it ended while we watched, or this worker has just started.
        if flipped or first:
            self.home_wanted = True
        self.flipped_for = set()
        if not self.home_wanted or (self.migrating is not None and not self.migrating.done()):
            return
        snapshot = await asyncio.to_thread(self.traffic.read, True)
        if not snapshot.on_virtual and not snapshot.virtual_open:
            self.home_wanted = False  # nothing away, the overflow closed: nothing to bring home
            return
        handle = await self._start("migrate-back", "Kueue: no training Workload at or above priority "
                                                   f"{self.policy.training_priority} is left")
        self.migrating = asyncio.get_running_loop().create_task(self._until_done(handle))

    async def _until_done(self, handle: WorkflowHandle[Any, RunbookStatus]) -> None:
        try:
            status = await handle.result()
        except Exception as exc:  # failed, terminated, Temporal gone: a person sees the run; try no more
            log.warning("migrate-back/%s ended without an outcome: %s", self.cluster, exc)
            self.home_wanted = False
            return
        if status.outcome != "not-yet":
            self.home_wanted = False

    async def _start(self, runbook: str, why: str) -> WorkflowHandle[Any, RunbookStatus]:
        workflow_id = cluster_workflow_id(runbook, self.cluster)
        handle = await start_or_attach(
            self.client, runbook, TrafficInput(cluster=self.cluster, requested_by=REQUESTED_BY),
            workflow_id=workflow_id, task_queue=self.task_queue, result_type=RunbookStatus,
            task_timeout=RUNBOOK_TASK_TIMEOUT, search_attributes=start_attributes(runbook, self.cluster),
            summary=run_summary(runbook, self.cluster, why=why),
            details=run_details(workflow_id, runbook, self.cluster, started_by=why))
        log.info("%s (run %s) started or attached: %s", workflow_id, handle.result_run_id, why)
        return handle


def _named(training: list[TrainingWorkload]) -> str:
    shown = ", ".join(f"{w.ref} ({w.gpus} GPUs, priority {w.priority})" for w in training[:3])
    return shown + (f" and {len(training) - 3} more" if len(training) > 3 else "")
