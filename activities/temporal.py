"""Temporal itself as a system: asking the fleet guard for a lease, and who still runs.

Async activities on the worker's own client (no thread): signal-with-start creates the guard of a
cluster the first time one of its runbooks asks.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import datetime
from typing import Any

from temporalio import activity
from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError, RPCStatusCode

from activities.start import start_or_attach
from fleetmedic.ids import cluster_workflow_id, guard_workflow_id, start_attributes
from fleetmedic.models import FleetPause, GuardState, LeaseRequest, Operator
from fleetmedic.quota import QuotaSyncInput
from fleetmedic.trust import UntrustedValue, visibility_literal


class TemporalActivities:
    def __init__(self, client: Client, task_queue: str) -> None:
        self.client = client
        self.task_queue = task_queue

    async def signal_guard(self, cluster: str, signal: str, arg: Any) -> None:
        await start_or_attach(self.client, "fleet-guard", GuardState(cluster=cluster),
                              workflow_id=guard_workflow_id(cluster), task_queue=self.task_queue, signal=signal,
                              signal_args=[arg])

    @activity.defn(name="guard.request")
    async def request_lease(self, cluster: str, request: LeaseRequest) -> None:
        await self.signal_guard(cluster, "request", request)

    @activity.defn(name="guard.release")
    async def release_lease(self, cluster: str, workflow_id: str) -> None:
        await self.signal_guard(cluster, "release", workflow_id)

    @activity.defn(name="guard.paused")
    async def fleet_paused(self, cluster: str) -> FleetPause:
        """The fleet guard's pause, for runbooks that hold no lease. No guard yet: nothing paused
        (an operator's `fleetmedic pause` starts the guard, so a pause always has one)."""
        handle = self.client.get_workflow_handle(guard_workflow_id(cluster))
        try:
            state = await handle.query("state", result_type=GuardState)
        except RPCError as exc:
            if exc.status == RPCStatusCode.NOT_FOUND:
                return FleetPause()
            raise
        return FleetPause(paused=state.paused)

    @activity.defn(name="kueue.request_sync")
    async def request_quota_sync(self, cluster: str) -> None:
        """A node left or returned: start kueue-quota-sync/<cluster>, or tell the running one to
        make another pass."""
        workflow_id = cluster_workflow_id("kueue-quota-sync", cluster)
        await start_or_attach(self.client, "kueue-quota-sync", QuotaSyncInput(cluster=cluster,
                                                                              requested_by="node runbook"),
                              workflow_id=workflow_id, task_queue=self.task_queue, signal="sync",
                              search_attributes=start_attributes("kueue-quota-sync", cluster))

    @activity.defn(name="traffic.stop_runbook")
    async def stop_runbook(self, workflow_id: str, operator: Operator) -> bool:
        """Signal `stop` to a running traffic runbook and wait until it has closed. False: none ran."""
        handle = self.client.get_workflow_handle(workflow_id)
        try:
            await handle.signal("stop", operator)
        except RPCError as exc:
            if exc.status == RPCStatusCode.NOT_FOUND:
                return False
            raise
        while True:
            description = await handle.describe()
            if description.status != WorkflowExecutionStatus.RUNNING:
                return True
            activity.heartbeat(f"waiting for {workflow_id} to stop")
            await asyncio.sleep(0.5)

    @activity.defn(name="temporal.running")
    async def running(self, workflow_ids: list[str]) -> list[str]:
        alive = []
        for workflow_id in workflow_ids:
            try:
                description = await self.client.get_workflow_handle(workflow_id).describe()
            except RPCError as exc:
                if exc.status == RPCStatusCode.NOT_FOUND:
                    continue
                raise
            if description.status == WorkflowExecutionStatus.RUNNING:
                alive.append(workflow_id)
        return alive

    @activity.defn(name="temporal.count_remediations")
    async def count_remediations(self, cluster: str, node: str, since: datetime) -> int:
        """Live runs that took this node out of service since `since`: the lemon-node rule counts
        them. Shadow (dry-run) runs never count: rolling a policy out in shadow first must not send
        a node to RMA on its first live failure."""
        try:
            query = (f"FleetCluster = {visibility_literal(cluster)} AND FleetNode = {visibility_literal(node)} "
                     'AND ExecutionStatus != "Running" AND FleetOutcome IN ("remediated", "quarantined", "lemon") '
                     f'AND FleetDryRun = false AND StartTime > "{since.isoformat().replace("+00:00", "Z")}"')
            return (await self.client.count_workflows(query)).count
        except UntrustedValue as exc:
            raise ApplicationError(str(exc), type="InvalidInput", non_retryable=True) from None
        except RPCError as exc:
            if exc.status == RPCStatusCode.INVALID_ARGUMENT:
                # Retrying a query the server refuses cannot succeed: fail the step so it escalates.
                raise ApplicationError(f"visibility refused the query: {exc.message}", type="InvalidInput",
                                       non_retryable=True) from None
            raise

    def activities(self) -> list[Callable[..., Any]]:
        return [self.request_lease, self.release_lease, self.fleet_paused, self.request_quota_sync, self.stop_runbook,
                self.running, self.count_remediations]
