"""Benchmark: an alert storm through the webhook into the real Temporal dev server.

5,000 alerts for 500 nodes — firing duplicates and resolutions mixed, sent by concurrent
senders in Alertmanager-sized batches over HTTP to `fleetmedic webhook` (uvicorn) — must make
exactly 500 runbooks and lose no alert: every alert is answered, and every alert answered
started/attached is a signal in its workflow's history.

    python bench/alert_storm.py [--alerts 5000] [--nodes 500] [--senders 20]

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

import httpx
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.testing import WorkflowEnvironment

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.stats import percentile
from fleetmedic.ids import SEARCH_ATTRIBUTES
from workers.dev import temporal_binary
from workers.devstack.webhook_thread import WebhookThread

TOKEN = "storm"


def batches(alerts: int, nodes: int) -> list[list[dict[str, object]]]:
    """Per node: firing copies, then resolutions, each batch in Alertmanager's shape; nodes interleaved."""
    per_node = alerts // nodes
    out: list[list[dict[str, object]]] = []
    for n in range(nodes):
        statuses = ["firing"] * (per_node - per_node // 5) + ["resolved"] * (per_node // 5)
        alerts_of_node = [{"status": s, "fingerprint": f"n{n}-{i}",
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


async def main(alerts: int, nodes: int, senders: int) -> dict[str, object]:
    env = await WorkflowEnvironment.start_local(dev_server_existing_path=temporal_binary(),
                                                data_converter=pydantic_data_converter,
                                                search_attributes=SEARCH_ATTRIBUTES, dev_server_log_level="error")
    try:
        address = env.client.service_client.config.target_host
        work = batches(alerts, nodes)
        # One sender per node at a time keeps a node's firing before its resolution, as Alertmanager does.
        node_locks: dict[str, asyncio.Lock] = {}
        latencies: list[float] = []
        answers: list[dict[str, str]] = []
        statuses: list[int] = []
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
                            while True:  # Alertmanager retries a 5xx; so do we
                                response = await http.post("/v1/alerts/alertmanager", json=body)
                                if response.status_code < 500:
                                    break
                            latencies.append(time.monotonic() - began)
                            statuses.append(response.status_code)
                            answers.extend(response.json()["alerts"])

            began = time.monotonic()
            await asyncio.gather(*(sender() for _ in range(senders)))
            wall = time.monotonic() - began
        runbooks = [w.id async for w in env.client.list_workflows('FleetCluster = "storm"')]
        signalled = 0
        for workflow_id in runbooks:
            history = await env.client.get_workflow_handle(workflow_id).fetch_history()
            signalled += sum(1 for e in history.events if e.HasField("workflow_execution_signaled_event_attributes"))
    finally:
        await env.shutdown()
    delivered = sum(1 for a in answers if a["action"] in ("started", "attached"))
    return {
        "benchmark": "alert_storm", "alerts": len(answers), "nodes": nodes, "senders": senders,
        "requests": len(latencies), "http_statuses": sorted(set(statuses)),
        "runbooks": len(runbooks), "exactly_one_runbook_per_node": len(runbooks) == nodes,
        "started": sum(1 for a in answers if a["action"] == "started"),
        "attached": sum(1 for a in answers if a["action"] == "attached"),
        "ignored": sum(1 for a in answers if a["action"] == "ignored"),
        "signals_in_histories": signalled, "alerts_lost": alerts - len(answers) + (delivered - signalled),
        "alerts_per_s": round(len(answers) / wall, 1),
        "request_p50_ms": round(statistics.median(latencies) * 1000, 1),
        "request_p99_ms": round(percentile(latencies, 99) * 1000, 1),
        "wall_s": round(wall, 1),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--alerts", type=int, default=5000)
    parser.add_argument("--nodes", type=int, default=500)
    parser.add_argument("--senders", type=int, default=20)
    options = parser.parse_args()
    print(json.dumps(asyncio.run(main(options.alerts, options.nodes, options.senders))))
