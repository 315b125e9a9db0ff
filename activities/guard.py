"""The fleet guard's activities: a runbook asks it for a disruption lease and gives the lease back;
a runbook without a lease (traffic, quota) asks whether the fleet is paused.

Async activities on the worker's own client (no thread): signal-with-start creates the guard of a
cluster the first time one of its runbooks asks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from temporalio import activity
from temporalio.client import Client
from temporalio.service import RPCError, RPCStatusCode

from activities.start import signal_shared
from fleetmedic.details import guard_details
from fleetmedic.ids import guard_workflow_id, run_summary
from fleetmedic.models import FleetPause, GuardState, LeaseRequest


class GuardActivities:
    def __init__(self, client: Client, task_queue: str) -> None:
        self.client = client
        self.task_queue = task_queue

    async def signal_guard(self, cluster: str, signal: str, arg: Any) -> None:
        await signal_shared(self.client, "fleet-guard", GuardState(cluster=cluster),
                            refused=f"the fleet guard of {cluster} did not take the {signal}",
                            workflow_id=guard_workflow_id(cluster), task_queue=self.task_queue,
                            signal=signal, signal_args=[arg],
                            summary=run_summary("fleet-guard", cluster, why="disruption leases"),
                            details=guard_details(cluster))

    @activity.defn(name="guard.request")
    async def request_lease(self, cluster: str, request: LeaseRequest) -> None:
        await self.signal_guard(cluster, "request", request)

    @activity.defn(name="guard.kill")
    async def request_kill(self, cluster: str, request: LeaseRequest) -> None:
        """Ask for a protective kill (answered by the `protective_kill` signal)."""
        await self.signal_guard(cluster, "kill", request)

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

    def activities(self) -> list[Callable[..., Any]]:
        return [self.request_lease, self.request_kill, self.release_lease, self.fleet_paused]
