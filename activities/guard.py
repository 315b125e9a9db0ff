"""The fleet guard's activities: a runbook asks it for a disruption lease and gives the lease back;
a runbook without a lease (traffic, quota) asks whether the fleet is paused.

Async activities on the worker's own client (no thread): signal-with-start creates the guard of a
cluster the first time one of its runbooks asks. Requests and releases go in batches, one signal for
all this worker has for a guard at the moment (activities/guard_batches.py), to a guard whose memo
says it takes them; one signal each otherwise.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

from temporalio import activity
from temporalio.client import Client
from temporalio.service import RPCError, RPCStatusCode

from activities.breaker import GuardViews
from activities.errors import fail
from activities.guard_batches import Batch
from activities.start import attempt_deadline, signal_shared
from fleetmedic.details import guard_details
from fleetmedic.errors import ErrorKind
from fleetmedic.ids import guard_workflow_id, run_summary
from fleetmedic.models import FleetPause, GuardState, LeaseRequest

# The deadline of a batch's signal: it carries the items of many attempts, each of which gives up
# on its own within its attempt (attempt_deadline), and is asked again by its step's bounded retry.
BATCH_RPC_TIMEOUT = timedelta(seconds=10)
# What each batch signal carries, by the name of the signal that carries one.
BATCHED = {"request": "requests", "release": "releases"}


class GuardActivities:
    def __init__(self, client: Client, task_queue: str, views: GuardViews | None = None) -> None:
        self.client = client
        self.task_queue = task_queue
        self.views = views
        self.batches: dict[tuple[str, str], Batch[Any]] = {}

    async def signal_guard(self, cluster: str, signal: str, arg: Any, **options: Any) -> None:
        await signal_shared(self.client, "fleet-guard", GuardState(cluster=cluster),
                            refused=f"the fleet guard of {cluster} did not take the {signal}",
                            workflow_id=guard_workflow_id(cluster), task_queue=self.task_queue,
                            signal=signal, signal_args=[arg],
                            summary=run_summary("fleet-guard", cluster, why="disruption leases"),
                            details=guard_details(cluster), **options)

    async def send(self, cluster: str, signal: str, item: Any) -> None:
        """`item` to the guard: in the batch of its kind where the guard takes it, else alone."""
        batched = BATCHED[signal]
        if self.views is not None:
            self.views.start()  # read every second from here on; until the first read, one signal each
        if self.views is None or batched not in self.views.get(cluster).signals:
            await self.signal_guard(cluster, signal, item)
            return
        batch = self.batches.get((cluster, batched))
        if batch is None:
            batch = self.batches[cluster, batched] = Batch(lambda items: self.deliver(cluster, batched, items))
        deadline = attempt_deadline() or BATCH_RPC_TIMEOUT
        await batch.add(item, deadline.total_seconds(), f"the fleet guard of {cluster} did not take the {signal}")

    async def deliver(self, cluster: str, signal: str, items: list[Any]) -> None:
        """A batch to the guard's open run: a plain signal, never a start. A guard started by a batch
        could have its first task run by an older worker during a roll, which has no handler for it;
        the lone signals that start a guard are ones every release takes."""
        assert self.views is not None
        try:
            await self.client.get_workflow_handle(guard_workflow_id(cluster)).signal(
                signal, items, rpc_timeout=BATCH_RPC_TIMEOUT)
        except RPCError as exc:
            if exc.status == RPCStatusCode.NOT_FOUND:  # no open run (an operator terminated it)
                self.views.forget(cluster)
                raise fail(ErrorKind.UNAVAILABLE, f"the fleet guard of {cluster} is not running: asked "
                                                  "again alone, which starts it") from None
            raise fail(ErrorKind.UNAVAILABLE, f"the fleet guard of {cluster} did not take the {signal} "
                                              f"({exc.status.name}: {exc.message})") from None

    @activity.defn(name="guard.request")
    async def request_lease(self, cluster: str, request: LeaseRequest) -> None:
        await self.send(cluster, "request", request)

    @activity.defn(name="guard.kill")
    async def request_kill(self, cluster: str, request: LeaseRequest) -> None:
        """Ask for a protective kill (answered by the `protective_kill` signal)."""
        await self.signal_guard(cluster, "kill", request)

    @activity.defn(name="guard.release")
    async def release_lease(self, cluster: str, workflow_id: str) -> None:
        await self.send(cluster, "release", workflow_id)

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
