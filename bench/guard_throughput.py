"""Benchmark: the fleet guard's lease round trips per second, and the wait it adds uncontended.

Real Temporal dev server, the guard workflow and its activities on an in-process worker, the
real control plane with 1,000 kwok GPU nodes for its capacity count. A probe workflow does what a
runbook does: ask for a lease, wait for the grant signal, release it.

    python bench/guard_throughput.py [--probes 200] [--concurrent 20]

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import yaml
from temporalio import workflow
from temporalio.testing import WorkflowEnvironment

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.stats import percentile
from devstack import fleet
from devstack.dev import temporal_binary
from devstack.kube_world import local_kube
from fleetmedic.converter import data_converter
from fleetmedic.ids import SEARCH_ATTRIBUTES
from fleetmedic.models import LeaseAnswer, LeaseRequest
from fleetmedic.policy import parse_policy
from fleetmedic.settings import Settings
from workers.worker import build_worker
from workflows.fleet_guard import FleetGuard


@workflow.defn(name="lease-probe", sandboxed=False)
class LeaseProbe:
    """What a runbook does with the guard, and nothing else."""

    def __init__(self) -> None:
        self.answer: LeaseAnswer | None = None

    @workflow.signal
    def lease(self, answer: LeaseAnswer) -> None:
        self.answer = answer

    @workflow.run
    async def run(self, cluster: str) -> float:
        me = workflow.info().workflow_id
        asked = workflow.now()
        await workflow.execute_activity("guard.request", args=[cluster, LeaseRequest(workflow_id=me, node=me)],
                                        start_to_close_timeout=timedelta(seconds=30))
        await workflow.wait_condition(lambda: self.answer is not None and self.answer.granted)
        waited = (workflow.now() - asked).total_seconds()
        await workflow.execute_activity("guard.release", args=[cluster, me],
                                        start_to_close_timeout=timedelta(seconds=30))
        return waited


async def probes(env: WorkflowEnvironment, count: int, concurrent: int, cluster: str) -> tuple[list[float], float]:
    semaphore = asyncio.Semaphore(concurrent)

    async def one(i: int) -> float:
        async with semaphore:
            return float(await env.client.execute_workflow("lease-probe", cluster, id=f"probe-{cluster}-{i}",
                                                           task_queue="bench"))

    began = time.monotonic()
    waits = await asyncio.gather(*(one(i) for i in range(count)))
    return list(waits), time.monotonic() - began


async def main(count: int, concurrent: int) -> dict[str, object]:
    workdir = Path(tempfile.mkdtemp(prefix="fleetmedic-guard-bench-"))
    env = await WorkflowEnvironment.start_local(dev_server_existing_path=temporal_binary(),
                                                data_converter=data_converter,
                                                search_attributes=SEARCH_ATTRIBUTES, dev_server_log_level="error")
    try:
        with local_kube(workdir) as kube:
            for i in range(1000):
                kube.put(fleet.node(f"gpu-{i:04d}"))
            policy = parse_policy(yaml.safe_dump({"budget": {"max_concurrent": 1000, "max_unavailable_fraction": 1.0,
                                                             "max_per_hour": 40000, "topology_label": None}}))
            settings = Settings(kubeconfig=str(kube.write_kubeconfig(workdir / "kubeconfig")), slurm="off",
                                metrics_port=0, task_queue="bench")
            async with build_worker(env.client, settings, policy, workflows=[FleetGuard, LeaseProbe]):
                await probes(env, 5, 1, "warmup")
                sequential, _ = await probes(env, count, 1, "sequential")
                concurrent_waits, wall = await probes(env, count, concurrent, "concurrent")
    finally:
        await env.shutdown()
    return {
        "benchmark": "guard_throughput",
        "uncontended_wait_p50_s": round(statistics.median(sequential), 4),
        "uncontended_wait_p99_s": round(percentile(sequential, 99), 4),
        "round_trips_per_s": round(count / wall, 1), "concurrent_probes": concurrent, "probes": count,
        "concurrent_wait_p99_s": round(percentile(concurrent_waits, 99), 4),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--probes", type=int, default=200)
    parser.add_argument("--concurrent", type=int, default=20)
    options = parser.parse_args()
    print(json.dumps(asyncio.run(main(options.probes, options.concurrent))))
