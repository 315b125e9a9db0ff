"""Benchmark: replacements under way together, each run searching for its new machine.

After a storm, every run whose node was replaced waits in `provider.find_replacement` until its new
machine joins — minutes on a real cloud. With the `cluster-api` provider each look reads the
MachineSet's Machines (the `karpenter` provider: the NodePool's NodeClaims) from the API server and
claims one new Machine for the run. Here `--searches` searches, each for its own new Machine of one
MachineSet of `--machines` Machines, on the real kube-apiserver (scripts/install-kube), in this
process, as the worker's waits queue runs them (ProviderActivities, its threads for blocking calls,
a 2-minute heartbeat timeout). For `--hold` seconds no new Machine has a node; then every one gets
its node at once, and each search's answer is timed from its Machine's nodeRef.

Cases, each on a MachineSet of its own in the same API server:
- `fleetmedic`: FleetMedic's search (the searches of a set share its lists; each search looks
  again after 2 s, then waits half as long again each time, up to 15 s);
- `before`: each search lists the set itself every 2 s (the search before, a loop here);
- `floor`: one loop listing the set every 2 s, whatever the number of searches: the least a
  worker can ask of the API server and still see a join within 2 s.

For each: the lists the API server served in the hold (its audit log) and their rate, the CPU of
this process (the worker's part) and of kube-apiserver + etcd in the hold, conflicting claims, and
how late each search saw its node. `vs_floor`: FleetMedic's lists and API server CPU over the
floor's. Target: at most 1.5× the floor's lists in the hold, and no conflicting claim.

    python bench/replacement_search.py [--searches 200] [--machines 500] [--hold 60]

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from kubernetes import client
from temporalio.testing import ActivityEnvironment

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from activities.kube_client import load_api_client
from activities.providers import LOOK_EVERY_S, ProviderActivities
from activities.providers.cluster_api import ClusterApiProvider
from activities.waits import BlockingCalls
from bench.stats import percentile
from bench.world import cpu_seconds
from devstack import fleet
from devstack.kube_world import AuditedRequest, RealKube, local_kube
from fleetmedic.models import FindReplacement, Follow
from fleetmedic.policy import ClusterApiProviderPolicy

GROUP, VERSION, NAMESPACE = "cluster.x-k8s.io", "v1beta2", "capi"
TARGET_RATIO = 1.5


def machines(kube: RealKube, name: str, count: int, new: int) -> tuple[list[str], datetime]:
    """MachineSet `name` with `count` Machines that have their nodes, then, a second later, `new`
    Machines with none yet. Returns the new ones' names and the time the searches ask from."""
    machine_set = kube.put(fleet.machine_set(name, namespace=NAMESPACE, replicas=count + new))
    custom = client.CustomObjectsApi(kube.api)

    def create(machine: str) -> None:
        custom.create_namespaced_custom_object(GROUP, VERSION, NAMESPACE, "machines",
                                               fleet.machine(machine, namespace=NAMESPACE, machine_set=machine_set))

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(create, [f"{name}-m{i:05}" for i in range(count)]))
        time.sleep(1.1)  # creation times have second precision: the new Machines come a second later
        since = datetime.now(UTC)
        fresh = [f"{name}-new{i:05}" for i in range(new)]
        list(pool.map(create, fresh))
    return fresh, since


def join(kube: RealKube, fresh: list[str]) -> dict[str, float]:
    """Every new Machine gets its node (its status.nodeRef, as Cluster API writes it once the node
    joined); when each was written."""
    custom = client.CustomObjectsApi(kube.api)
    written: dict[str, float] = {}

    def node_ref(machine: str) -> None:
        custom.patch_namespaced_custom_object_status(GROUP, VERSION, NAMESPACE, "machines", machine,
                                                     {"status": {"nodeRef": {"name": f"node-{machine}"}}})
        written[f"node-{machine}"] = time.monotonic()

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(node_ref, fresh))
    return written


def lists_of(requests: list[AuditedRequest], machine_set: str) -> list[datetime]:
    """When the API server received each list of `machine_set`'s Machines (its audit log)."""
    return [datetime.fromisoformat(r.event["requestReceivedTimestamp"]) for r in requests
            if r.verb == "list" and r.url.path.endswith("/machines")
            and r.params.get("labelSelector", "").endswith(f"={machine_set}")]


def conflicts_in(requests: list[AuditedRequest], machine_set: str) -> int:
    return sum(1 for r in requests if r.verb == "patch" and r.code == 409
               and r.url.path.rsplit("/", 1)[-1].startswith(f"{machine_set}-"))


class Cpu:
    def __init__(self, kube: RealKube) -> None:
        self.pids = {p.name: p.popen.pid for p in kube.cluster.processes if p.name in ("kube-apiserver", "etcd")}

    def now(self) -> dict[str, float]:
        return {"worker": time.process_time(), **{name: cpu_seconds(pid) for name, pid in self.pids.items()}}


async def fleetmedic_searches(provider: ClusterApiProvider, follows: list[Follow], deadline_s: float,
                              found: dict[str, float]) -> None:
    activities = ProviderActivities(provider, blocking=BlockingCalls())

    async def search(follow: Follow) -> None:
        env = ActivityEnvironment()
        env.info = replace(env.info, heartbeat_timeout=timedelta(minutes=2))  # the policy's wait heartbeat
        result = await env.run(activities.find_replacement, FindReplacement(follow=follow, timeout_s=deadline_s))
        if result.node is not None:
            found[result.node] = time.monotonic()

    await asyncio.gather(*(search(f) for f in follows))


async def searches_before(provider: ClusterApiProvider, follows: list[Follow], deadline_s: float,
                          found: dict[str, float]) -> None:
    blocking, end = BlockingCalls(), time.monotonic() + deadline_s

    async def search(follow: Follow) -> None:
        while time.monotonic() < end:
            result = await blocking(provider.find_replacement, follow)
            if result.node is not None:
                found[result.node] = time.monotonic()
                return
            await asyncio.sleep(LOOK_EVERY_S)

    await asyncio.gather(*(search(f) for f in follows))


async def floor_loop(provider: ClusterApiProvider, follows: list[Follow], deadline_s: float,
                     found: dict[str, float]) -> None:
    blocking, end, group = BlockingCalls(), time.monotonic() + deadline_s, follows[0].group
    while time.monotonic() < end and len(found) < len(follows):
        for member in await blocking(provider.members_of, group):
            node = provider.node_of(member)
            if node is not None and "-new" in member["metadata"]["name"]:
                found.setdefault(node, time.monotonic())
        await asyncio.sleep(LOOK_EVERY_S)


Runner = Callable[[ClusterApiProvider, list[Follow], float, dict[str, float]], Awaitable[None]]


async def case(kube: RealKube, name: str, runner: Runner, searches: int, members: int, hold_s: float) -> dict[str, Any]:
    fresh, since = machines(kube, name, members, searches)
    provider = ClusterApiProvider(lambda: load_api_client(str(kube.kubeconfig)), ClusterApiProviderPolicy(), 10)
    follows = [Follow(provider="cluster-api", old_node=f"{name}-old{i:05}", reference=f"{NAMESPACE}/{name}-gone{i:05}",
                      group=f"{NAMESPACE}/{name}", since=since) for i in range(searches)]
    cpu = Cpu(kube)
    found: dict[str, float] = {}
    began, c0 = datetime.now(UTC), cpu.now()
    running = asyncio.ensure_future(runner(provider, follows, hold_s + 120, found))
    await asyncio.sleep(hold_s)
    c1, held_until = cpu.now(), datetime.now(UTC)
    assert not running.done() or running.exception() is None, running.exception()
    written = await asyncio.to_thread(join, kube, fresh)
    await asyncio.wait_for(running, 180)
    late = [found[node] - at for node, at in written.items() if node in found]
    requests = kube.requests()  # the whole audit log, read once
    lists = [t for t in lists_of(requests, name) if began <= t <= held_until]
    return {
        "searches": searches, "machines_in_set": members + searches, "hold_s": hold_s,
        "lists_in_hold": len(lists), "lists_per_s": round(len(lists) / hold_s, 2),
        "cpu_share_in_hold": {k: round((c1[k] - c0[k]) / hold_s, 3) for k in c0},
        "conflicting_claims": conflicts_in(requests, name),
        "found": len(late), "late_s": {"p50": round(percentile(late, 50), 2), "p99": round(percentile(late, 99), 2),
                                       "max": round(max(late), 2)} if late else None,
    }


async def main(searches: int, members: int, hold_s: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="fleetmedic-bench-") as tmp, local_kube(Path(tmp)) as kube:
        kube.put(fleet.capi_cluster(namespace=NAMESPACE))
        out: dict[str, Any] = {"searches": searches, "machines_in_set": members + searches, "hold_s": hold_s}
        for name, runner in (("floor", floor_loop), ("before", searches_before), ("fleetmedic", fleetmedic_searches)):
            out[name] = await case(kube, f"md-{name}", runner, 1 if name == "floor" else searches, members
                                   + (searches - 1 if name == "floor" else 0), hold_s)
            print(f"{name}: {json.dumps(out[name])}", file=sys.stderr)
        fm, floor = out["fleetmedic"], out["floor"]
        api = ("kube-apiserver", "etcd")
        out["vs_floor"] = {
            "lists": round(fm["lists_in_hold"] / max(floor["lists_in_hold"], 1), 2),
            "api_server_cpu": round(sum(fm["cpu_share_in_hold"][k] for k in api)
                                    / max(sum(floor["cpu_share_in_hold"][k] for k in api), 1e-3), 2),
            "before_lists": round(out["before"]["lists_in_hold"] / max(floor["lists_in_hold"], 1), 2),
        }
        out["meets_target"] = out["vs_floor"]["lists"] <= TARGET_RATIO and fm["conflicting_claims"] == 0 \
            and fm["found"] == searches
        return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--searches", type=int, default=200)
    parser.add_argument("--machines", type=int, default=500, help="Machines of the set that have their nodes")
    parser.add_argument("--hold", type=float, default=60)
    args = parser.parse_args()
    print(json.dumps(asyncio.run(main(args.searches, args.machines, args.hold)), indent=2))
