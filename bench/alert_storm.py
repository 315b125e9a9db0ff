"""Benchmark: an alert storm through the webhook into the real Temporal dev server.

Case `storm`: 5,000 alerts for 500 nodes — firing duplicates and resolutions mixed, sent by
concurrent senders in Alertmanager-sized batches over HTTP to `fleetmedic webhook` (uvicorn) —
must make exactly 500 runbooks and lose no alert: every alert is answered, and every alert
answered started/attached is a signal in its workflow's history.

Case `burst`: 500 distinct nodes fire within one second (one request each, all at once): the
runbooks started per second, from the first POST to the last 202 (target: at least 200/s), beside
the floor — the same server's rate for 500 plain starts from one client, without the webhook.

A worker runs throughout (shadow mode, on the real Kubernetes control plane when
scripts/install-kube has built it), so runbooks start, run and close while alerts arrive. Every
HTTP status is kept, including the 503s a sender retries after (as Alertmanager does): a retry never
hides a 5xx.

    python bench/alert_storm.py [--alerts 5000] [--nodes 500] [--senders 20] [--burst 500]

Prints one JSON object with both cases.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml
from temporalio.testing import WorkflowEnvironment

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.stats import percentile
from devstack import fleet
from devstack.dev import temporal_binary
from devstack.kube_cluster import LocalKubeCluster, install_rbac_and_crds, missing_binaries
from devstack.kube_world import RealKube
from devstack.webhook_thread import WebhookThread
from fleetmedic.converter import data_converter
from fleetmedic.ids import SEARCH_ATTRIBUTES
from fleetmedic.policy import RoutingPolicy, parse_policy
from fleetmedic.settings import Settings
from workers.worker import build_worker

TOKEN = "storm"


def batches(alerts: int, nodes: int) -> list[list[dict[str, object]]]:
    """Per node: firing copies, then resolutions, each batch in Alertmanager's shape; nodes interleaved."""
    per_node = alerts // nodes
    out: list[list[dict[str, object]]] = []
    for n in range(nodes):
        statuses = ["firing"] * (per_node - per_node // 5) + ["resolved"] * (per_node // 5)
        alerts_of_node: list[dict[str, object]] = [{"status": s, "fingerprint": f"n{n}-{i}",
                           "labels": {"alertname": "FleetMedicGpuXid", "node": f"gpu-{n}", "gpu": str(i % 8),
                                      "xid": "79", "cluster": "storm"}} for i, s in enumerate(statuses)]
        for start in range(0, len(alerts_of_node), 5):
            out.append(alerts_of_node[start:start + 5])
    # Keep each node's own order (firing before its resolution) but interleave the nodes.
    random.seed(7)
    by_node: dict[str, list[list[dict[str, object]]]] = {}
    for batch in out:
        by_node.setdefault(str(batch[0]["labels"]["node"]), []).append(batch)  # type: ignore[index]
    ordered: list[list[dict[str, object]]] = []
    queues = list(by_node.values())
    while queues:
        queue = random.choice(queues)
        ordered.append(queue.pop(0))
        if not queue:
            queues.remove(queue)
    return ordered


async def storm(env: WorkflowEnvironment, alerts: int, nodes: int, senders: int) -> dict[str, object]:
    work = batches(alerts, nodes)
    # One sender per node at a time keeps a node's firing before its resolution, as Alertmanager does.
    node_locks: dict[str, asyncio.Lock] = {}
    latencies: list[float] = []
    answers: list[dict[str, str]] = []
    statuses: dict[int, int] = {}
    address = env.client.service_client.config.target_host
    with WebhookThread(address, "storm", TOKEN) as webhook:
        queue: asyncio.Queue[list[dict[str, object]]] = asyncio.Queue()
        for batch in work:
            queue.put_nowait(batch)

        async def sender() -> None:
            async with httpx.AsyncClient(base_url=webhook.url, timeout=60,
                                         headers={"Authorization": f"Bearer {TOKEN}"}) as http:
                while not queue.empty():
                    batch = queue.get_nowait()
                    node = str(batch[0]["labels"]["node"])  # type: ignore[index]
                    async with node_locks.setdefault(node, asyncio.Lock()):
                        body = {"version": "4", "groupKey": node, "status": batch[0]["status"],
                                "receiver": "fleetmedic", "alerts": batch}
                        began = time.monotonic()
                        while True:  # Alertmanager retries a 5xx; so do we, and every answer is kept
                            response = await http.post("/v1/alerts/alertmanager", json=body)
                            statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
                            if response.status_code < 500:
                                break
                        latencies.append(time.monotonic() - began)
                        answers.extend(response.json()["alerts"])

        began = time.monotonic()
        await asyncio.gather(*(sender() for _ in range(senders)))
        wall = time.monotonic() - began
    runbooks = [w.id async for w in env.client.list_workflows('FleetCluster = "storm"')]
    delivered = sum(1 for a in answers if a["action"] in ("started", "attached"))
    # A signal that arrives while its run's workflow task is in flight is buffered by the server and
    # written to the history when that task completes: count until the histories hold them all, or
    # a minute has passed (what is still missing then is lost).
    counted_at = time.monotonic()
    while True:
        signalled = 0
        for workflow_id in runbooks:
            history = await env.client.get_workflow_handle(workflow_id).fetch_history()
            signalled += sum(1 for e in history.events if e.HasField("workflow_execution_signaled_event_attributes"))
        if signalled >= delivered or time.monotonic() - counted_at > 60:
            break
        await asyncio.sleep(2)
    return {
        "alerts": len(answers), "nodes": nodes, "senders": senders,
        "requests": len(latencies), "http_statuses": {str(k): v for k, v in sorted(statuses.items())},
        "runbooks": len(runbooks), "exactly_one_runbook_per_node": len(runbooks) == nodes,
        "started": sum(1 for a in answers if a["action"] == "started"),
        "attached": sum(1 for a in answers if a["action"] == "attached"),
        "ignored": sum(1 for a in answers if a["action"] == "ignored"),
        "refused": sum(1 for a in answers if a["action"] == "refused"),
        "signals_in_histories": signalled, "alerts_lost": alerts - len(answers) + (delivered - signalled),
        "histories_counted_after_s": round(time.monotonic() - counted_at, 1),
        "alerts_per_s": round(len(answers) / wall, 1),
        "request_p50_ms": round(statistics.median(latencies) * 1000, 1),
        "request_p99_ms": round(percentile(latencies, 99) * 1000, 1),
        "wall_s": round(wall, 1),
    }


async def burst(env: WorkflowEnvironment, nodes: int) -> dict[str, object]:
    """`nodes` distinct nodes fire at once, one request each: runbooks started per second."""
    statuses: dict[int, int] = {}
    started = 0
    address = env.client.service_client.config.target_host
    # Same task queue as the storm (the worker polls it), its own cluster (fresh workflow IDs).
    with WebhookThread(address, "storm", TOKEN, routing=RoutingPolicy(clusters=["storm", "burst"])) as webhook:
        limits = httpx.Limits(max_connections=nodes, max_keepalive_connections=nodes)
        async with httpx.AsyncClient(base_url=webhook.url, timeout=60, limits=limits,
                                     headers={"Authorization": f"Bearer {TOKEN}"}) as http:
            async def fire(n: int) -> None:
                nonlocal started
                alert = {"status": "firing", "fingerprint": f"b{n}", "startsAt": "2026-11-30T00:00:00Z",
                         "labels": {"alertname": "FleetMedicGpuXid", "node": f"gpu-{n}", "xid": "79", "gpu": "0",
                                    "cluster": "burst"}}
                body = {"version": "4", "groupKey": f"b{n}", "status": "firing", "receiver": "fleetmedic",
                        "alerts": [alert]}
                while True:
                    response = await http.post("/v1/alerts/alertmanager", json=body)
                    statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
                    if response.status_code < 500:
                        break
                started += sum(1 for a in response.json()["alerts"] if a["action"] == "started")

            began = time.monotonic()
            await asyncio.gather(*(fire(n) for n in range(nodes)))
            wall = time.monotonic() - began
    runbooks = [w.id async for w in env.client.list_workflows('FleetCluster = "burst"')]
    floor = await start_floor(env, nodes)
    return {"nodes": nodes, "http_statuses": {str(k): v for k, v in sorted(statuses.items())},
            "started": started, "runbooks": len(runbooks), "exactly_one_runbook_per_node": len(runbooks) == nodes,
            "wall_s": round(wall, 2), "runbooks_started_per_s": round(started / wall, 1),
            "floor_starts_per_s": floor, "over_floor": round(started / wall / floor, 2),
            "meets_target_200_per_s": started / wall >= 200}


async def start_floor(env: WorkflowEnvironment, count: int) -> float:
    """The same server's own rate: `count` plain starts at once from one client, no webhook (on a
    queue no worker polls, so nothing else competes). The webhook is limited by Temporal when its
    rate is close to this."""
    began = time.monotonic()
    await asyncio.gather(*(env.client.start_workflow("bench-floor", id=f"floor-{n}", task_queue="bench-floor-unpolled")
                           for n in range(count)))
    rate = count / (time.monotonic() - began)
    await asyncio.gather(*(env.client.get_workflow_handle(f"floor-{n}").terminate() for n in range(count)))
    return round(rate, 1)


async def main(alerts: int, nodes: int, senders: int, burst_nodes: int) -> dict[str, object]:
    env = await WorkflowEnvironment.start_local(dev_server_existing_path=temporal_binary(),
                                                data_converter=data_converter,
                                                search_attributes=SEARCH_ATTRIBUTES, dev_server_log_level="error")
    workdir = Path(tempfile.mkdtemp(prefix="fleetmedic-storm-"))
    try:
        with contextlib.ExitStack() as stack:
            kube_line = "none: the worker's Kubernetes calls fail and its runs escalate (scripts/install-kube)"
            settings = Settings(task_queue="storm", slurm="off", metrics_port=0, kubeconfig=str(workdir / "none"))
            if not missing_binaries():
                cluster = stack.enter_context(LocalKubeCluster(workdir / "kube"))
                install_rbac_and_crds(cluster)
                world = RealKube(cluster, None, workdir)
                for n in range(max(nodes, burst_nodes)):
                    world.put(fleet.node(f"gpu-{n}"))
                settings = settings.model_copy(update={"kubeconfig": str(world.kubeconfig)})
                kube_line = "real control plane"
            policy = parse_policy(yaml.safe_dump({"shadow": {"global": True}, "storage": {"root": str(workdir)},
                                                  "routing": {"clusters": ["storm", "burst"]}}))
            async with build_worker(env.client, settings, policy):
                storm_result = await storm(env, alerts, nodes, senders)
                burst_result = await burst(env, burst_nodes)
    finally:
        await env.shutdown()
    return {"benchmark": "alert_storm", "kubernetes": kube_line, "storm": storm_result, "burst": burst_result}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--alerts", type=int, default=5000)
    parser.add_argument("--nodes", type=int, default=500)
    parser.add_argument("--senders", type=int, default=20)
    parser.add_argument("--burst", type=int, default=500)
    options = parser.parse_args()
    print(json.dumps(asyncio.run(main(options.alerts, options.nodes, options.senders, options.burst))))
