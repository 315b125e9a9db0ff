"""Temporal itself as a system: which workflows still run, and how often a node was remediated
(visibility). Async activities on the worker's own client (no thread)."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Any

from temporalio import activity
from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError, RPCStatusCode

from fleetmedic.trust import UntrustedValue, visibility_literal


class TemporalActivities:
    def __init__(self, client: Client, task_queue: str) -> None:
        self.client = client
        self.task_queue = task_queue

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
        return [self.running, self.count_remediations]
