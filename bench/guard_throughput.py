"""Benchmark: the fleet guard's lease round trips per second, the wait it adds uncontended, and
how fast it grants leases to a storm of runbooks that all ask at once.

The guard workflow and its activities on an in-process worker, the real control plane with 1,000
kwok GPU nodes for its capacity count, on the Temporal dev server or the production one
(bench/world.py). A probe workflow does what a runbook does: ask for a lease, wait for the grant
signal, hold it (`--hold`), release it.

- sequential and concurrent: `--probes` probes, one at a time, then `--concurrent` at once.
- storm: `--storm` probes started together, every one asking at once, as after a fleet-wide
  incident (bench/worker_scale's 5,000 runs): the seconds until every one was granted, held its
  lease and gave it back; the signals that reached the guard, and those it was too busy to take
  (each a retried attempt, one line). Beside it the floor, like for like: as many probes with the
  same steps whose lease needs no guard (each signalled by its own activity).
- reclaim: the guard's look, once a minute, at which of its lease holders still run (`--reclaim`
  holders, open runs that no worker runs, 1 in 100 closed): FleetMedic's read (temporal.running)
  beside the read before (a describe per holder) and beside the floor, the list queries of those
  IDs' open runs alone; wall time and the server's CPU, each the median of three.

    python bench/guard_throughput.py [--temporal dev|production|both] [--probes 200]
                                     [--concurrent 20] [--storm 3000] [--hold 5] [--reclaim 1000,5000]

Prints one JSON object, a section per server.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import yaml
from temporalio import activity, workflow
from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.common import RetryPolicy
from temporalio.worker import Worker

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from activities import guard as guard_activities
from activities.guard import GuardActivities
from activities.start import signal_shared
from activities.temporal import TemporalActivities
from bench.stats import percentile
from bench.world import SERVERS, count, cpu_seconds, on_each, tree_cpu_seconds
from devstack import fleet
from devstack.dev import DevOptions, connect_when_serving, start_temporal, stop_temporal
from devstack.kube_world import local_kube
from devstack.slurm_cluster import free_port
from devstack.temporal_production import ProductionTemporal
from fleetmedic.ids import guard_workflow_id
from fleetmedic.models import GuardState, LeaseAnswer, LeaseRequest
from fleetmedic.policy import parse_policy
from fleetmedic.settings import Settings
from workers.temporal_client import connect, ensure_search_attributes
from workers.worker import build_worker
from workflows.fleet_guard import FleetGuard

QUEUE = "bench"
# The floor's probes run on a worker of their own, in this process (build_worker's registers FleetMedic's).
FLOOR_QUEUE = "bench-floor"


@workflow.defn(name="lease-probe", sandboxed=False)
class LeaseProbe:
    """What a runbook does with the guard, and nothing else. `floor`: the same steps, signal and timer,
    whose lease needs no guard — each probe's own activity signals its grant (bench/floor.py's
    like-for-like rule): what the storm costs the server without the guard."""

    def __init__(self) -> None:
        self.answer: LeaseAnswer | None = None

    @workflow.signal
    def lease(self, answer: LeaseAnswer) -> None:
        self.answer = answer

    @workflow.run
    async def run(self, cluster: str, hold_s: float = 0, floor: bool = False) -> float:
        request, release = ("bench.grant_myself", "bench.release_myself") if floor else ("guard.request",
                                                                                          "guard.release")
        me = workflow.info().workflow_id
        asked = workflow.now()
        # As a runbook's step: a refused attempt is tried again, a bounded number of times.
        retry = RetryPolicy(maximum_attempts=20, maximum_interval=timedelta(seconds=10))
        await workflow.execute_activity(request, args=[cluster, LeaseRequest(workflow_id=me, node=me)],
                                        start_to_close_timeout=timedelta(seconds=30), retry_policy=retry)
        await workflow.wait_condition(lambda: self.answer is not None and self.answer.granted)
        waited = (workflow.now() - asked).total_seconds()
        if hold_s:
            await workflow.sleep(hold_s)
        await workflow.execute_activity(release, args=[cluster, me],
                                        start_to_close_timeout=timedelta(seconds=30), retry_policy=retry)
        return waited


@activity.defn(name="bench.grant_myself")
async def grant_myself(cluster: str, request: LeaseRequest) -> None:
    """The floor's "guard": the probe's own lease, signalled to it at once by its own activity."""
    await activity.client().get_workflow_handle(request.workflow_id).signal("lease", LeaseAnswer(granted=True))


@activity.defn(name="bench.release_myself")
async def release_myself(cluster: str, workflow_id: str) -> None:
    """The floor's release: nothing to give back."""


class Refusals:
    """The signals the guard activities send, by name — one each (activities/start.py `signal_shared`)
    or a worker's batch (`GuardActivities.deliver`) — and those the server refused (each fails its
    attempts with one line): counted where they happen, while `counting`."""

    def __init__(self) -> None:
        self.count = 0
        self.sent: Counter[str] = Counter()

    async def counted(self, signal: str, call: Awaitable[Any]) -> Any:
        self.sent[signal] += 1
        try:
            return await call
        except Exception:
            self.count += 1
            raise

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        async def single(*args: Any, **kwargs: Any) -> Any:
            return await self.counted(kwargs["signal"], signal_shared(*args, **kwargs))

        async def batch(guard: GuardActivities, cluster: str, signal: str, items: list[Any]) -> None:
            await self.counted(signal, deliver(guard, cluster, signal, items))

        deliver = GuardActivities.deliver
        guard_activities.signal_shared = single  # type: ignore[attr-defined]
        GuardActivities.deliver = batch  # type: ignore[method-assign,assignment]
        try:
            yield
        finally:
            guard_activities.signal_shared = signal_shared  # type: ignore[attr-defined]
            GuardActivities.deliver = deliver  # type: ignore[method-assign]


async def probes(client: Client, count_: int, concurrent: int, cluster: str,
                 name: str = "warmup") -> tuple[list[float], float]:
    semaphore = asyncio.Semaphore(concurrent)

    async def one(i: int) -> float:
        async with semaphore:
            return float(await client.execute_workflow("lease-probe", cluster, id=f"probe-{name}-{i}",
                                                       task_queue=QUEUE))

    began = time.monotonic()
    waits = await asyncio.gather(*(one(i) for i in range(count_)))
    return list(waits), time.monotonic() - began


async def storm_of(client: Client, floor: bool, cluster: str, size: int, hold_s: float,
                   deadline_s: float) -> dict[str, Any]:
    """`size` probes started together (`floor`: the probes that need no guard): seconds until every
    one has closed (asked, been granted, held and given back its lease), counted in visibility, as
    an operator would."""
    name, queue = ("floor", FLOOR_QUEUE) if floor else ("guard", QUEUE)
    began = time.monotonic()
    for first in range(0, size, 200):
        await asyncio.gather(*(client.start_workflow("lease-probe", args=[cluster, hold_s, floor],
                                                     id=f"{name}-storm-{i}", task_queue=queue)
                               for i in range(first, min(size, first + 200))))
    started_s = time.monotonic() - began
    query = f'WorkflowType = "lease-probe" AND WorkflowId STARTS_WITH "{name}-storm-" AND ExecutionStatus = "Completed"'
    done = 0
    while time.monotonic() - began < deadline_s:
        done = await count(client, query)
        if done >= size:
            break
        await asyncio.sleep(2)
    took = time.monotonic() - began
    return {"started_in_s": round(started_s, 1), "completed": done, "all_completed": done >= size,
            "seconds": round(took, 1), "probes_per_s": round(done / took, 2)}


async def storm(client: Client, cluster: str, size: int, hold_s: float, refusals: Refusals,
                deadline_s: float, server_cpu: Callable[[], float]) -> dict[str, Any]:
    """The floor's storm (no guard), then the guard's. The guard is there already, as a cluster's is
    after its first incident (it never ends)."""
    cpu = server_cpu()
    async with Worker(client, task_queue=FLOOR_QUEUE, workflows=[LeaseProbe],
                      activities=[grant_myself, release_myself]):
        floor = await storm_of(client, True, cluster, size, hold_s, deadline_s)
    floor["temporal_cpu_s"] = round(server_cpu() - cpu, 1)
    guard = client.get_workflow_handle(guard_workflow_id(cluster))
    grants = (await guard.query("state", result_type=GuardState)).grants
    refused, sent, cpu = refusals.count, dict(refusals.sent), server_cpu()
    fleetmedic = await storm_of(client, False, cluster, size, hold_s, deadline_s)
    fleetmedic["temporal_cpu_s"] = round(server_cpu() - cpu, 1)
    fleetmedic.update({
        "leases_granted": (await guard.query("state", result_type=GuardState)).grants - grants,
        "busy_refusals": refusals.count - refused,
        # Requests and releases to the guard: one signal each, or batches (activities/guard_batches.py).
        "signals_to_guard": {name: n - sent.get(name, 0) for name, n in refusals.sent.items()}})
    ratio = fleetmedic["probes_per_s"] / floor["probes_per_s"] if floor["probes_per_s"] else None
    return {"probes": size, "hold_s": hold_s, "fleetmedic": fleetmedic, "floor": floor,
            "ratio_to_floor": round(ratio, 2) if ratio else None}


async def reclaim(client: Client, holders: int, server_cpu: Callable[[], float]) -> dict[str, Any]:
    """Which of `holders` open runs, 1 in 100 closed, still run: FleetMedic's read, the read before
    and the floor, each three times (median wall time and server CPU), and whether each answered right."""
    tag = f"holder-{holders}-{time.time_ns()}"
    ids = [f"{tag}-{i}" for i in range(holders)]
    for first in range(0, holders, 200):  # nobody polls this queue: the runs stay open
        await asyncio.gather(*(client.start_workflow("bench-holder", id=i, task_queue="bench-nobody")
                               for i in ids[first:first + 200]))
    closed = set(ids[::100])
    for workflow_id in closed:
        await client.get_workflow_handle(workflow_id).terminate("closed without giving its lease back")
    query = f'WorkflowId STARTS_WITH "{tag}-" AND ExecutionStatus = "Running"'
    # Until visibility has every close: a run it still lists as running would be kept by FleetMedic's
    # read for a look more, as in a cluster, but here it would read as a wrong answer.
    settled_by = time.monotonic() + 120
    while await count(client, query) != holders - len(closed):
        if time.monotonic() > settled_by:
            raise RuntimeError(f"visibility did not show the {holders} holders' closes within 120 s")
        await asyncio.sleep(0.5)
    running = [i for i in ids if i not in closed]
    fleetmedic = TemporalActivities(client, QUEUE)

    async def describe_each(asked: list[str]) -> list[str]:
        return [i for i in asked if (await client.get_workflow_handle(i).describe()).status
                == WorkflowExecutionStatus.RUNNING]

    async def listed_only(asked: list[str]) -> list[str]:  # FleetMedic's visibility step alone
        found = await fleetmedic.listed_running(asked)
        return [i for i in asked if i in found]

    reads = {"fleetmedic": fleetmedic.running, "before": describe_each, "floor": listed_only}
    result: dict[str, Any] = {"holders": holders, "closed": len(closed)}
    for name, read in reads.items():
        walls, cpus, right = [], [], True
        for _ in range(3):
            cpu, began = server_cpu(), time.monotonic()
            answer = await read(ids)
            right = right and answer == running
            walls.append(time.monotonic() - began)
            cpus.append(server_cpu() - cpu)
        result[name] = {"wall_s": round(statistics.median(walls), 3),
                        "temporal_cpu_s": round(statistics.median(cpus), 3), "answered_right": right}
    ratio = result["fleetmedic"]["wall_s"] / result["floor"]["wall_s"]
    result.update({"wall_over_floor": round(ratio, 2), "target_ratio": 1.5,
                   "meets_target": ratio <= 1.5 and result["fleetmedic"]["answered_right"],
                   "before_over_fleetmedic": round(result["before"]["wall_s"] / result["fleetmedic"]["wall_s"], 1)})
    for first in range(0, len(running), 200):
        await asyncio.gather(*(client.get_workflow_handle(i).terminate("bench over")
                               for i in running[first:first + 200]))
    return result


@contextlib.asynccontextmanager
async def temporal(server: str, workdir: Path) -> AsyncIterator[tuple[Client, Callable[[], float]]]:
    """A client of the server, and its CPU seconds so far (temporal-server and PostgreSQL together)."""
    if server == "production":
        with ProductionTemporal(workdir / "temporal") as production:
            client = await connect(target_host=production.address, namespace=production.namespace)
            await ensure_search_attributes(client)
            yield client, lambda: tree_cpu_seconds(*(p.popen.pid for p in production.processes))
        return
    options = DevOptions(state_dir=workdir / "temporal", port=free_port(), ui_port=free_port())
    process = start_temporal(options, persist=False)
    try:
        yield await connect_when_serving(f"127.0.0.1:{options.port}"), lambda: cpu_seconds(process.pid)
    finally:
        stop_temporal(process)


async def on(server: str, count_: int, concurrent: int, storm_size: int, hold_s: float,
             deadline_s: float, reclaims: Sequence[int] = ()) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix="fleetmedic-guard-bench-"))
    refusals = Refusals()
    result: dict[str, Any] = {}
    with refusals.counting():
        return await on_counted(server, workdir, refusals, result, count_, concurrent, storm_size, hold_s,
                                deadline_s, reclaims)


async def on_counted(server: str, workdir: Path, refusals: Refusals, result: dict[str, Any], count_: int,
                     concurrent: int, storm_size: int, hold_s: float, deadline_s: float,
                     reclaims: Sequence[int]) -> dict[str, Any]:
    async with temporal(server, workdir) as (client, server_cpu):
        if reclaims:
            result["reclaim"] = [await reclaim(client, holders, server_cpu) for holders in reclaims]
        if not (count_ or storm_size):
            return result
        with local_kube(workdir) as kube:
            for i in range(1000):
                kube.put(fleet.node(f"gpu-{i:04d}"))
            policy = parse_policy(yaml.safe_dump({"budget": {"max_concurrent": 100000, "max_unavailable_fraction": 1.0,
                                                             "max_per_hour": 1000000, "topology_label": None}}))
            settings = Settings(kubeconfig=str(kube.write_kubeconfig(workdir / "kubeconfig")), slurm="off",
                                metrics_port=0, task_queue=QUEUE)
            async with build_worker(client, settings, policy, workflows=[FleetGuard, LeaseProbe]):
                cluster = policy.routing.default_cluster  # a cluster the worker serves: it reads its guard
                await probes(client, 5, 1, cluster)
                if count_:
                    sequential, _ = await probes(client, count_, 1, cluster, "sequential")
                    concurrent_waits, wall = await probes(client, count_, concurrent, cluster, "concurrent")
                    result.update({
                        "uncontended_wait_p50_s": round(statistics.median(sequential), 4),
                        "uncontended_wait_p99_s": round(percentile(sequential, 99), 4),
                        "round_trips_per_s": round(count_ / wall, 1), "concurrent_probes": concurrent,
                        "probes": count_, "concurrent_wait_p99_s": round(percentile(concurrent_waits, 99), 4)})
                if storm_size:
                    result["storm"] = await storm(client, cluster, storm_size, hold_s, refusals, deadline_s,
                                                  server_cpu)
    return result


async def main(server: str, count_: int, concurrent: int, storm_size: int, hold_s: float,
               deadline_s: float, reclaims: Sequence[int] = ()) -> dict[str, Any]:
    return {"benchmark": "guard_throughput", "temporal": await on_each(
        server, lambda s: on(s, count_, concurrent, storm_size, hold_s, deadline_s, reclaims))}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--temporal", choices=(*SERVERS, "both"), default="dev")
    parser.add_argument("--probes", type=int, default=200, help="0: no sequential and concurrent rounds")
    parser.add_argument("--concurrent", type=int, default=20)
    parser.add_argument("--storm", type=int, default=0, help="probes that ask at once (0: none)")
    parser.add_argument("--hold", type=float, default=5, help="seconds a storm probe holds its lease")
    parser.add_argument("--deadline", type=float, default=900, help="seconds the storm may take")
    parser.add_argument("--reclaim", default="", help="lease holders the reclaim's read is measured with, "
                                                      "comma-separated (none by default)")
    options = parser.parse_args()
    print(json.dumps(asyncio.run(main(options.temporal, options.probes, options.concurrent, options.storm,
                                      options.hold, options.deadline,
                                      [int(n) for n in options.reclaim.split(",") if n]))))
