"""Benchmark: 1,000 kwok GPU nodes on the real control plane, 50 of them fail within a minute; or
a false storm: alerts for 40 % of them within a minute (`--false-storm 0.4`).

Real parts: etcd, kube-apiserver (RBAC on), controller-manager, scheduler and kwok from
scripts/install-kube; the Temporal dev server; the worker as its own process under its
ServiceAccount identity; the webhook (in this process) receiving XID 79 alerts. The `http`
provider stand-in takes each replacement, and the node goes NotReady and comes back Ready
`--replace-s` later (kwok, as a kubelet would).

Budget: the shipped one (max_concurrent 5, max_unavailable_fraction 0.10, max_per_domain 2 across
4 zones, the failing nodes spread over all four), except `max_per_hour`, which the shipped policy
sets to 20: fifty replacements under it take about two and a half hours, so the run raises it
(`--max-per-hour`, reported).

    python bench/fleet_scale.py [--nodes 1000] [--failing 50] [--replace-s 5]

Prints one JSON object, with a verdict for each of the design's invariants, counted from the API
(sampled every 200 ms, not the guard's own count):
- leases held at once (the guard's high-water mark) ≤ `budget.max_concurrent`;
- nodes disrupted by FleetMedic at once (NotReady: being replaced, which only a lease allows) ≤
  `budget.max_concurrent`;
- nodes cordoned at once (protective, ahead of the lease, and under leases) ≤ the cordon breaker's
  bound plus `max_concurrent` (leases cordon too);
plus whether every failed node was healed, the time to heal them all, the worker's peak RSS, and the
requests FleetMedic sent the apiserver per remediation (from its audit log). The false storm heals
nothing on purpose: it reports the most nodes cordoned, when the breaker tripped after the first
alert, the runs it held, and the pods evicted (only lease holders drain; the rest wait).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import yaml
from kubernetes import client as k8s_client
from temporalio.service import RPCError
from temporalio.testing import WorkflowEnvironment

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.world import cpu_seconds
from devstack import fleet
from devstack.controllers import provider_controller
from devstack.dev import temporal_binary
from devstack.kube_cluster import LocalKubeCluster, install_rbac_and_crds
from devstack.kube_world import RealKube
from devstack.standins import ProviderStandIn
from fleetmedic.converter import data_converter
from fleetmedic.ids import SEARCH_ATTRIBUTES
from fleetmedic.models import GuardState
from fleetmedic.policy import RoutingPolicy, parse_policy
from workers.webhook import AlertReceiver, available_runbooks

CLUSTER, TOKEN = "scale", "bench"


def out_of_service(core: k8s_client.CoreV1Api) -> tuple[int, int, int]:
    """GPU nodes (out of service, cordoned, NotReady) now."""
    out = cordoned = not_ready = 0
    for node in core.list_node(label_selector="nvidia.com/gpu.present=true").items:
        ready = any(c.type == "Ready" and c.status == "True" for c in (node.status.conditions or []))
        out += bool(node.spec.unschedulable or not ready)
        cordoned += bool(node.spec.unschedulable)
        not_ready += not ready
    return out, cordoned, not_ready


def rss_peak_mib(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return 0.0


async def main(nodes: int, failing: int, replace_s: float, max_per_hour: int,
               false_storm: float = 0.0) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix="fleetmedic-scale-"))
    names = [f"gpu-{i:04d}" for i in range(nodes)]
    failing = int(nodes * false_storm) if false_storm else failing
    bad = names[:: max(1, nodes // failing)][:failing]
    env = await WorkflowEnvironment.start_local(dev_server_existing_path=temporal_binary(),
                                                data_converter=data_converter,
                                                search_attributes=SEARCH_ATTRIBUTES, dev_server_log_level="error")
    worker: subprocess.Popen[bytes] | None = None
    try:
        with LocalKubeCluster(workdir / "kube") as cluster, ProviderStandIn() as provider:
            install_rbac_and_crds(cluster)
            world = RealKube(cluster, None, workdir)
            began = time.monotonic()
            for i, name in enumerate(names):  # four zones of contiguous nodes; the failures span them all
                world.put(fleet.node(name, zone=f"zone-{i * 4 // nodes}"))
            seeded_s = time.monotonic() - began
            core = k8s_client.CoreV1Api(world.api)
            policy = parse_policy(yaml.safe_dump({
                "provider": {"kind": "http", "http": {"url": provider.url}},
                "storage": {"root": str(workdir)},
                "budget": {"max_per_hour": max_per_hour},
                "routing": {"clusters": [CLUSTER], "default_cluster": CLUSTER},
            }))
            (workdir / "policy.yaml").write_text(yaml.safe_dump(policy.model_dump(mode="json", by_alias=True)))
            worker_env = {**os.environ, "TEMPORAL_ADDRESS": env.client.service_client.config.target_host,
                          "FLEETMEDIC_TASK_QUEUE": "scale", "FLEETMEDIC_POLICY": str(workdir / "policy.yaml"),
                          "KUBECONFIG": str(world.kubeconfig), "FLEETMEDIC_SLURM": "off",
                          "FLEETMEDIC_METRICS_PORT": "0"}
            log = (workdir / "worker.log").open("wb")
            # Started once, before the measured part: a blocking spawn is fine here.
            worker = subprocess.Popen([sys.executable, "-m", "workers.cli", "worker"],  # noqa: ASYNC220
                                      env=worker_env, stdout=log, stderr=subprocess.STDOUT)
            receiver = AlertReceiver(env.client, RoutingPolicy(clusters=[CLUSTER], default_cluster=CLUSTER),
                                     "scale", TOKEN, available_runbooks())
            peak, stop = {"out": 0, "cordoned": 0, "not_ready": 0, "rss": 0.0}, threading.Event()

            def sample() -> None:
                while not stop.is_set():
                    out, cordoned, not_ready = out_of_service(core)
                    peak["out"], peak["cordoned"] = max(peak["out"], out), max(peak["cordoned"], cordoned)
                    peak["not_ready"] = max(peak["not_ready"], not_ready)
                    peak["rss"] = max(peak["rss"], rss_peak_mib(worker.pid) if worker else 0.0)
                    stop.wait(0.2)

            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            audit_before = len(world.requests(("worker",)))
            worker_cpu = cpu_seconds(worker.pid)
            started, first_alert = time.monotonic(), datetime.now(UTC)
            with provider_controller(world, provider, delay_s=replace_s):
                transport = httpx.ASGITransport(app=receiver.app())
                async with httpx.AsyncClient(transport=transport, base_url="http://webhook",
                                             headers={"Authorization": f"Bearer {TOKEN}"}) as http:
                    for i, name in enumerate(bad):  # spread over a minute, as a bad rack or driver push would
                        alert = {"status": "firing", "fingerprint": f"fp-{name}", "startsAt": "2026-11-30T00:00:00Z",
                                 "labels": {"alertname": "FleetMedicGpuXid", "node": name, "xid": "79", "gpu": "0"}}
                        body = {"version": "4", "groupKey": name, "status": "firing", "receiver": "fleetmedic",
                                "alerts": [alert]}
                        answer = await http.post("/v1/alerts/alertmanager", json=body)
                        assert answer.status_code == 202, answer.text
                        await asyncio.sleep(max(0.0, started + 60 * (i + 1) / len(bad) - time.monotonic()))
                outcomes: dict[str, int] = {}
                if false_storm:  # nothing to heal: look for 30 s more, then end every run
                    await asyncio.sleep(30)
                    guard = await env.client.get_workflow_handle(f"fleet-guard/{CLUSTER}").query(
                        "state", result_type=GuardState)
                    for name in bad:
                        with contextlib.suppress(RPCError):  # those the lease let finish are closed already
                            await env.client.get_workflow_handle(f"xid-recovery/{CLUSTER}/{name}").terminate(
                                "bench over")
                else:
                    for name in bad:
                        handle = env.client.get_workflow_handle(f"xid-recovery/{CLUSTER}/{name}")
                        result = await asyncio.wait_for(handle.result(), 3600)
                        outcomes[result["outcome"]] = outcomes.get(result["outcome"], 0) + 1
                    guard = await env.client.get_workflow_handle(f"fleet-guard/{CLUSTER}").query(
                        "state", result_type=GuardState)
            healed_s = time.monotonic() - started
            worker_cpu = cpu_seconds(worker.pid) - worker_cpu
            stop.set()
            sampler.join(2)
            healthy = out_of_service(core)[0] == 0
            sent = world.requests(("worker",))[audit_before:]
            requests = len(sent)
            evicted = [r for r in sent if r.url.path.endswith("/eviction") and r.code < 300]
    finally:
        if worker is not None:  # ours, by its PID: SIGTERM, then SIGKILL past its graceful shutdown
            worker.terminate()
            try:
                worker.wait(40)
            except subprocess.TimeoutExpired:
                worker.kill()
                worker.wait(10)
        await env.shutdown()
    budget, protective = policy.budget, policy.budget.protective
    bound = max(protective.min_nodes, int(protective.max_out_fraction * nodes))
    report: dict[str, Any] = {
        "benchmark": "fleet_scale", "case": "false-storm" if false_storm else "failures", "nodes": nodes,
        "alerting": failing, "replace_s": replace_s,
        "budget": {"max_concurrent": budget.max_concurrent, "max_unavailable_fraction": budget.max_unavailable_fraction,
                   "max_per_domain": budget.max_per_domain, "max_per_hour": max_per_hour,
                   "breaker_bound": bound, "breaker_window": str(protective.window),
                   "breaker_max_per_minute": protective.max_per_minute},
        "leases_max_held": guard.max_held, "leases_within_budget": guard.max_held <= budget.max_concurrent,
        "max_disrupted_from_api": peak["not_ready"],
        "disrupted_within_budget": peak["not_ready"] <= budget.max_concurrent,
        "max_cordoned_from_api": peak["cordoned"],
        "cordoned_within_breaker": peak["cordoned"] <= bound + budget.max_concurrent,
        "max_out_of_service_from_api": peak["out"],
        "worker_rss_peak_mib": peak["rss"], "seed_nodes_s": round(seeded_s, 1),
        # Everything the worker did for the alerts (their runs and the fleet guard), per alert: for
        # failures, a whole remediation each (lease, drain, replacement, return to service).
        "worker_cpu_s_per_run": round(worker_cpu / failing, 3),
    }
    if false_storm:
        breaker = guard.breaker
        report.update({
            "breaker_tripped": breaker is not None,
            "breaker_tripped_after_first_alert_s": round((breaker.tripped_at - first_alert).total_seconds(), 1)
            if breaker else None,
            "runs_held_by_breaker": breaker.held if breaker else 0,
            "pods_evicted": len(evicted), "nodes_drained": len({r.url.path.split("/")[-2] for r in evicted}),
        })
    else:
        report.update({
            "outcomes": outcomes, "every_failed_node_healed": outcomes == {"remediated": failing} and healthy,
            "time_to_heal_all_s": round(healed_s, 1),
            "apiserver_requests_per_remediation": round(requests / failing, 1),
        })
    return report


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--failing", type=int, default=50)
    parser.add_argument("--replace-s", type=float, default=5.0)
    parser.add_argument("--max-per-hour", type=int, default=100)
    parser.add_argument("--false-storm", type=float, default=0.0,
                        help="alerts for this share of the fleet within a minute, none of them a real fault")
    options = parser.parse_args()
    print(json.dumps(asyncio.run(main(options.nodes, options.failing, options.replace_s, options.max_per_hour,
                                      options.false_storm))))
