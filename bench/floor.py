"""The floors the benchmarks report FleetMedic against: trivial workflows on the same server, in the
same run, run by a worker polling as FleetMedic's does (workers/worker.py), started the way the
case being compared starts its runs. A ratio to one of these is what FleetMedic itself costs.

- `latencies`: one-activity workflows, one after another or all at once: start request → the
  activity ran (its side effect, as the node's cordon is FleetMedic's);
- `effects_latencies`: one-activity workflows, one after another or all at once, whose activity
  does what the protective step does, directly (read the node, then cordon it and DRAIN it with
  scontrol side by side): start request → the node seen out of service in both systems, as
  FleetMedic's are; and
  `effects_alone`, the same effects called directly, without Temporal: the part of an alert's
  latency that is the API server and slurmctld, not Temporal and not FleetMedic;
- `in_flight`: as many trivial runs kept open as FleetMedic has in flight (each waits for a signal,
  as each FleetMedic run waits for its replacement), while `latencies` measures new ones (and,
  given nodes, `effects_latencies` all at once);
- `starts_per_s`: N one-activity workflows started at once from one client (given nodes, each run's
  first step reads its node from the API server, as every protective step does on its own);
- `signal_with_start_per_s`: a storm's alerts sent as raw signal-with-start calls from one client,
  each to a trivial run per node that takes signals.

The last two also take `steps`: each run makes that many activities in all (those that do nothing
first, one after another), as a runbook's run makes its steps while the alerts still arrive. Each step costs the
server what any activity does (scheduled in a workflow task, handed out, completed, the next task),
and nothing else: given a runbook's own count, the floor is like for like in what the runs ask of
the server, and a ratio to it is what FleetMedic costs beyond the steps its runbook takes.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import os
import subprocess
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

from kubernetes import client as k8s_client
from temporalio import activity, workflow
from temporalio.client import Client
from temporalio.worker import PollerBehaviorSimpleMaximum, Worker

from fleetmedic.settings import Settings
from workers.worker import SHARED_QUEUE_POLLS, WORKFLOW_POLLS

QUEUE = "bench-floor"
DONE: dict[str, float] = {}


@activity.defn(name="bench.touch")
def touch(key: str) -> None:
    DONE[key] = time.time()


@activity.defn(name="bench.step")
def step(n: int) -> int:
    """A runbook step that does nothing: all it costs is Temporal's part of an activity."""
    return n


async def make_steps(count: int) -> None:
    """`count` do-nothing activities one after another, as a runbook makes its steps."""
    for n in range(count):
        await workflow.execute_activity("bench.step", n, start_to_close_timeout=timedelta(seconds=60))


@workflow.defn(name="bench-floor", sandboxed=False)  # no sandbox: benchmarks import the world
class Floor:
    @workflow.run
    async def run(self, key: str, before: int = 0, node: str = "") -> None:
        if node:  # its first step reads the node, as a runbook's protective step does
            await workflow.execute_activity("bench.read_node", node, start_to_close_timeout=timedelta(seconds=30))
            before = max(before - 1, 0)
        await make_steps(before)
        await workflow.execute_activity("bench.touch", key, start_to_close_timeout=timedelta(seconds=10))


@workflow.defn(name="bench-floor-effects", sandboxed=False)
class EffectsFloor:
    @workflow.run
    async def run(self, node: str) -> None:
        await workflow.execute_activity("bench.protect", node, start_to_close_timeout=timedelta(seconds=30))


class Protect:
    """The protective step's effects with nothing around them: the node read, then the cordon (a
    merge patch) and the DRAIN (`scontrol update`, as the worker's SlurmCli does) side by side, on
    the API server and slurmctld FleetMedic uses."""

    def __init__(self, api: k8s_client.ApiClient, slurm_env: dict[str, str]) -> None:
        # Made as the worker makes its calls (activities/kubernetes.py, kube_client.py): a client of
        # its own whose pool holds a connection for each of the floor's threads, the node read as
        # JSON, the patch's answer read to its end unparsed. Each answer left unread (both were once)
        # or each connection past a small pool is a new TLS handshake, which slowed the floor.
        configuration = copy.deepcopy(api.configuration)
        configuration.connection_pool_maxsize = SLOTS
        self.core, self.slurm_env = k8s_client.CoreV1Api(k8s_client.ApiClient(configuration)), slurm_env

    @activity.defn(name="bench.read_node")
    def read(self, node: str) -> None:
        """The node, read as the protective step reads it (KubernetesActivities.find_node): a
        consistent GET, its JSON parsed."""
        json.loads(self.core.read_node(node, _preload_content=False, _request_timeout=15).data)

    @activity.defn(name="bench.protect")
    def protect(self, node: str) -> None:
        self.read(node)
        # The two writes side by side, as the protective step makes them.
        drain = subprocess.Popen(["scontrol", "update", f"nodename={node}", "state=drain", "reason=bench floor"],
                                 env={**os.environ, **self.slurm_env}, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.PIPE)
        patched = self.core.patch_node(node, {"spec": {"unschedulable": True}}, _preload_content=False,
                                       _request_timeout=15)
        patched.drain_conn()
        patched.release_conn()
        _, err = drain.communicate(timeout=15)
        if drain.returncode:
            raise RuntimeError(f"scontrol update nodename={node} state=drain: {err.decode(errors='replace').strip()}")


@workflow.defn(name="bench-floor-open", sandboxed=False)
class OpenRun:
    """A trivial run that stays open until told, as a FleetMedic run waits for its replacement; with
    a key, it first runs one activity (so that a caller can tell when it has got to its wait); given
    `before`, that many do-nothing steps first."""

    def __init__(self) -> None:
        self.done = False
        self.signals = 0

    @workflow.run
    async def run(self, key: str = "", before: int = 0) -> int:
        await make_steps(before)
        if key:
            await workflow.execute_activity("bench.touch", key, start_to_close_timeout=timedelta(seconds=60))
        await workflow.wait_condition(lambda: self.done)
        return self.signals

    @workflow.signal
    def alert(self, _: Any) -> None:
        self.signals += 1

    @workflow.signal
    def finish(self) -> None:
        self.done = True


# The floor's activities at once: as many as FleetMedic's protective steps (fleetmedic/settings.py),
# so that 50 effects at once are not held to a few at a time where FleetMedic runs them all.
SLOTS = Settings.model_fields["protective_slots"].default


@contextlib.asynccontextmanager
async def floor_worker(client: Client, protect: Protect | None = None) -> AsyncIterator[Worker]:
    """The floor's worker, in this process, polling as FleetMedic's worker does."""
    activities: list[Callable[..., Any]] = [touch, step, *([protect.protect, protect.read] if protect else [])]
    with ThreadPoolExecutor(SLOTS) as pool:
        async with Worker(client, task_queue=QUEUE, workflows=[Floor, EffectsFloor, OpenRun], activities=activities,
                          activity_executor=pool, max_concurrent_activities=SLOTS,
                          workflow_task_poller_behavior=PollerBehaviorSimpleMaximum(WORKFLOW_POLLS),
                          nonsticky_to_sticky_poll_ratio=SHARED_QUEUE_POLLS,
                          activity_task_poller_behavior=PollerBehaviorSimpleMaximum(8)) as worker:
            yield worker


async def _one(client: Client, i: int) -> float:
    key = f"floor-{i}-{time.time_ns()}"
    began = time.time()
    await client.start_workflow("bench-floor", key, id=key, task_queue=QUEUE)
    while key not in DONE:
        await asyncio.sleep(0.002)
    return DONE[key] - began


async def latencies(client: Client, runs: int, at_once: bool = False) -> list[float]:
    """Latencies of `runs` one-activity workflows, one after another or all started together."""
    async with floor_worker(client):
        if at_once:
            return list(await asyncio.gather(*(_one(client, i) for i in range(runs))))
        return [await _one(client, i) for i in range(runs)]


async def effects_latencies(client: Client, nodes: Sequence[str], protect: Protect,
                            observed: Callable[[list[str]], Awaitable[dict[str, float]]],
                            at_once: bool = False) -> list[float]:
    """One `bench-floor-effects` run per node, one after another or all started together: start
    request → the node seen out of service in the API and in slurmctld's log (`observed`:
    bench/world.py's Observed.wait)."""
    async with floor_worker(client, protect):
        return await _effects(client, nodes, observed, at_once)


async def _effects(client: Client, nodes: Sequence[str],
                   observed: Callable[[list[str]], Awaitable[dict[str, float]]], at_once: bool) -> list[float]:
    def start(node: str) -> Awaitable[Any]:
        return client.start_workflow("bench-floor-effects", node, id=f"floor-effects-{node}-{time.time_ns()}",
                                     task_queue=QUEUE)
    return await (_all_out if at_once else _until_out)(nodes, start, observed)


async def effects_alone(nodes: Sequence[str], protect: Protect,
                        observed: Callable[[list[str]], Awaitable[dict[str, float]]]) -> list[float]:
    """The same effects called directly, one node after another, no Temporal: what the API server
    and slurmctld take by themselves, until the node is seen out of service in both."""
    return await _until_out(nodes, lambda node: asyncio.to_thread(protect.protect, node), observed)


async def _until_out(nodes: Sequence[str], act: Callable[[str], Awaitable[Any]],
                     observed: Callable[[list[str]], Awaitable[dict[str, float]]]) -> list[float]:
    """For each node in turn: `act` on it, and how long until it was seen out of service."""
    latencies = []
    for node in nodes:
        began = time.time()
        await act(node)
        latencies.append((await observed([node]))[node] - began)
    return latencies


async def _all_out(nodes: Sequence[str], act: Callable[[str], Awaitable[Any]],
                   observed: Callable[[list[str]], Awaitable[dict[str, float]]]) -> list[float]:
    """`act` on every node at once, and for each how long until it was seen out of service."""
    async def timed(node: str) -> float:
        began = time.time()
        await act(node)
        return began
    began = await asyncio.gather(*(timed(node) for node in nodes))
    seen = await observed(list(nodes))
    return [seen[node] - at for node, at in zip(nodes, began, strict=True)]


async def in_flight(client: Client, open_runs: int, runs: int, effects: Sequence[str] = (),
                    protect: Protect | None = None,
                    observed: Callable[[list[str]], Awaitable[dict[str, float]]] | None = None) -> dict[str, Any]:
    """`runs` one-activity workflows started together while `open_runs` trivial runs are in flight
    (each got to its wait: its activity ran, as FleetMedic's runs are waiting for their replacement
    when its case is measured), then, given `effects` nodes (with `protect` and `observed`), an
    effects run for each of them started together, with the same runs in flight; the open ones are
    finished afterwards (they leave the server as they found it)."""
    ids = [f"floor-open-{i}-{time.time_ns()}" for i in range(open_runs)]
    async with floor_worker(client, protect):
        began = time.monotonic()
        for start in range(0, open_runs, 100):
            await asyncio.gather(*(client.start_workflow("bench-floor-open", i, id=i, task_queue=QUEUE)
                                   for i in ids[start:start + 100]))
        while not all(i in DONE for i in ids):
            await asyncio.sleep(0.1)
        ramp_s = time.monotonic() - began
        measured = list(await asyncio.gather(*(_one(client, i) for i in range(runs))))
        with_effects = await _effects(client, effects, observed, True) if effects and observed else []
        for start in range(0, open_runs, 100):
            await asyncio.gather(*(client.get_workflow_handle(i).signal("finish") for i in ids[start:start + 100]))
    return {"latencies": measured, "effects": with_effects, "ramp_s": round(ramp_s, 1)}


async def starts_per_s(client: Client, count: int, steps: int = 1,
                       around: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
                       reads: tuple[Protect, Sequence[str]] | None = None) -> float:
    """`count` workflows of `steps` activities (one, or do-nothing steps before it) started at once
    from one client, a worker running them: the rate of the start calls, as the burst's is of its 202s.
    `around()` is entered for the start calls alone (what the machine spent while they were answered).
    `reads`: (`protect`, a node per run): each run's first step reads its node (`Protect.read`)
    instead of doing nothing, as each runbook's protective step reads its own."""
    protect, nodes = reads if reads is not None else (None, [""] * count)
    async with floor_worker(client, protect):
        keys = [f"floor-burst-{n}-{time.time_ns()}" for n in range(count)]
        with around():
            began = time.monotonic()
            await asyncio.gather(*(client.start_workflow(
                "bench-floor", args=[k, max(steps - 1, 0), *([node] if node else [])], id=k, task_queue=QUEUE)
                for k, node in zip(keys, nodes, strict=True)))
            rate = count / (time.monotonic() - began)
        while not all(k in DONE for k in keys):  # let them finish before the worker goes
            await asyncio.sleep(0.05)
    return round(rate, 1)


async def signal_with_start_per_s(client: Client, batches: Sequence[Sequence[str]], senders: int,
                                  steps: int = 0) -> dict[str, Any]:
    """Each batch's alerts (a node name per alert) as signal-with-start calls of that node's trivial
    run (making `steps` activities that do nothing as it starts), batches taken by `senders` concurrent senders
    as the storm's HTTP senders take them; the rate of alerts, and how many runs and signals the
    server holds afterwards."""
    prefix = f"floor-storm-{time.time_ns()}"
    queue: asyncio.Queue[Sequence[str]] = asyncio.Queue()
    for batch in batches:
        queue.put_nowait(batch)
    sent = 0

    async def sender() -> None:
        nonlocal sent
        while not queue.empty():
            batch = queue.get_nowait()
            await asyncio.gather(*(client.start_workflow("bench-floor-open", args=["", steps], id=f"{prefix}-{node}",
                                                         task_queue=QUEUE, start_signal="alert",
                                                         start_signal_args=[node])
                                   for node in batch))
            sent += len(batch)

    async with floor_worker(client):
        began = time.monotonic()
        await asyncio.gather(*(sender() for _ in range(senders)))
        wall = time.monotonic() - began
        nodes = sorted({node for batch in batches for node in batch})
        signals = 0
        for node in nodes:
            handle = client.get_workflow_handle(f"{prefix}-{node}")
            await handle.signal("finish")
            signals += await handle.result()
    return {"alerts": sent, "alerts_per_s": round(sent / wall, 1), "runs": len(nodes), "signals": signals,
            "steps_per_run": steps, "wall_s": round(wall, 1)}
