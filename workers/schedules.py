"""The Temporal Schedules the worker keeps: kueue-quota-sync every `kueue.interval`.

Created when missing, brought up to date (interval, action) when present, never un-paused: an
operator's pause from the UI or `temporal schedule toggle --pause` outlives worker restarts.
"""

from __future__ import annotations

import logging

from temporalio.client import (
    Client,
    Schedule,
    ScheduleActionStartWorkflow,
    ScheduleAlreadyRunningError,
    ScheduleIntervalSpec,
    ScheduleOverlapPolicy,
    SchedulePolicy,
    ScheduleSpec,
    ScheduleState,
    ScheduleUpdate,
    ScheduleUpdateInput,
)

from activities.start import RUNBOOK_TASK_TIMEOUT, start_or_attach
from fleetmedic.details import run_details
from fleetmedic.ids import cluster_workflow_id, run_summary, start_attributes
from fleetmedic.policy import Policy
from fleetmedic.quota import QuotaSyncInput
from fleetmedic.settings import Settings

log = logging.getLogger(__name__)
QUOTA_SYNC = "kueue-quota-sync"


def quota_schedule_id(cluster: str) -> str:
    return cluster_workflow_id(QUOTA_SYNC, cluster)


async def ensure_quota_schedule(client: Client, settings: Settings, policy: Policy) -> str | None:
    """The schedule's ID, or None when policy leaves Kueue sync off."""
    if not policy.kueue.enabled:
        return None
    schedule_id = quota_schedule_id(settings.cluster)
    action = ScheduleActionStartWorkflow(
        QUOTA_SYNC, QuotaSyncInput(cluster=settings.cluster, requested_by="schedule"),
        id=schedule_id, task_queue=settings.task_queue,  # Temporal appends the run's time to the ID
        task_timeout=RUNBOOK_TASK_TIMEOUT,
        typed_search_attributes=start_attributes(QUOTA_SYNC, settings.cluster),
        static_summary=run_summary(QUOTA_SYNC, settings.cluster, why=f"every {policy.kueue.interval}"),
        static_details=run_details(schedule_id, QUOTA_SYNC, settings.cluster,
                                   started_by=f"schedule {schedule_id} (pause it in the UI's Schedules)"))
    spec = ScheduleSpec(intervals=[ScheduleIntervalSpec(every=policy.kueue.interval)])
    rules = SchedulePolicy(overlap=ScheduleOverlapPolicy.SKIP)
    try:
        await client.create_schedule(schedule_id, Schedule(
            action=action, spec=spec, policy=rules,
            state=ScheduleState(note="FleetMedic: ClusterQueue GPU quotas follow the healthy GPUs")))
        log.info("schedule %s created: every %s", schedule_id, policy.kueue.interval)
    except ScheduleAlreadyRunningError:
        async def update(current: ScheduleUpdateInput) -> ScheduleUpdate:
            schedule = current.description.schedule
            schedule.action, schedule.spec, schedule.policy = action, spec, rules  # the state (paused) stays
            return ScheduleUpdate(schedule=schedule)

        await client.get_schedule_handle(schedule_id).update(update)
        log.info("schedule %s updated: every %s", schedule_id, policy.kueue.interval)
    return schedule_id


async def ensure_job_failures(client: Client, settings: Settings, policy: Policy) -> None:
    """The job-failures runbook of each served cluster runs from the worker's start: its
    reconciliation reads Slurm's ended jobs and Kubernetes' failed training pods, which post nothing
    (start-or-attach: an open run is left as it is)."""
    if not policy.crash.enabled:
        return
    for cluster in policy.routing.served_clusters:
        try:
            await start_or_attach(client, "job-failures", {"cluster": cluster},
                                  workflow_id=cluster_workflow_id("job-failures", cluster),
                                  task_queue=settings.task_queue, summary=f"job-failures {cluster}",
                                  details="training-job failures: let it crash; if it persists, find the node")
        except Exception as exc:  # the webhook's first job end starts it anyway
            log.warning("could not start job-failures/%s (%s); the first job end reported starts it", cluster, exc)
