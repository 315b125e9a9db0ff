"""Benchmark: migrate-back moving 200 inference pods home from the virtual node, with batch sizes
1, 5 and 20: total time and the fewest ready replicas seen (sampled every 20 ms), as JSON.

Real Temporal dev server and worker; the real control plane (its controller-manager, scheduler
and kwok run the pods); 25 GPU nodes of 8
GPUs at home; 10 Deployments of 20 replicas, each behind a PDB of 90 % (the policy's minimum).

    python bench/migrate_back.py [--pods 200] [--batches 1,5,20]

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml
from temporalio.testing import WorkflowEnvironment

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from devstack import fleet
from devstack.dev import temporal_binary
from devstack.kube_world import RealKube, local_kube
from devstack.replicas import deployment, virtual_node
from fleetmedic.converter import data_converter
from fleetmedic.ids import SEARCH_ATTRIBUTES, cluster_workflow_id
from fleetmedic.models import RunbookStatus
from fleetmedic.policy import parse_policy
from fleetmedic.settings import Settings
from fleetmedic.traffic import TrafficInput, minimum_ready
from workers.worker import build_worker

DEPLOYMENTS = 10
FRACTION = 0.9


def ready_pods(kube: RealKube) -> int:
    return sum(1 for p in kube.list("v1", "Pod", "inference")
               if p["status"]["conditions"][0]["status"] == "True")


async def one_run(env: WorkflowEnvironment, workdir: Path, pods: int, batch: int) -> dict[str, object]:
    per = pods // DEPLOYMENTS
    with local_kube(workdir / f"batch-{batch}") as kube:
        nodes = [f"gpu-{i:03d}" for i in range(pods // 8)]
        for name in nodes:
            kube.put(fleet.node(name))
        kube.put(virtual_node(overflow_closed=False))
        for d in range(DEPLOYMENTS):
            kube.put(deployment(f"serve-{d}", per))
            kube.put(fleet.pdb(f"serve-{d}", namespace="inference", match_labels={"app": f"serve-{d}"},
                                        min_available=minimum_ready(per, FRACTION)))
        policy = parse_policy(yaml.safe_dump({"traffic": {"batch_size": batch, "batch_pause": "0s",
                                                          "batch_timeout": "60s", "min_ready_fraction": FRACTION}}))
        settings = Settings(kubeconfig=str(kube.write_kubeconfig(workdir / f"kubeconfig-{batch}")), slurm="off",
                            metrics_port=0, task_queue=f"bench-{batch}")
        for name in nodes:  # training holds home while inference starts: everything lands away
            kube.put(fleet.pod(f"train-{name}", name, namespace="training", owner_kind="Job", gpus=8))
        while ready_pods(kube) < pods:
            await asyncio.sleep(0.1)
        for name in nodes:
            kube.remove("v1", "Pod", f"train-{name}", "training")
        lowest = [pods]
        stop = threading.Event()

        def sample() -> None:
            while not stop.is_set():
                lowest[0] = min(lowest[0], ready_pods(kube))
                time.sleep(0.02)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        async with build_worker(env.client, settings, policy):
            began = time.monotonic()
            report = await env.client.execute_workflow(
                "migrate-back", TrafficInput(cluster=f"bench-{batch}"),
                id=cluster_workflow_id("migrate-back", f"bench-{batch}"), task_queue=settings.task_queue,
                result_type=RunbookStatus)
            took = time.monotonic() - began
        stop.set()
        sampler.join(2)
        home = sum(1 for p in kube.list("v1", "Pod", "inference")
                   if p["spec"].get("nodeName", "").startswith("gpu-"))
    batches = sum(1 for d in report.decisions if d.step == "move a batch home" and d.result.startswith("evicted"))
    return {"batch_size": batch, "outcome": report.outcome, "seconds": round(took, 2), "batches": batches,
            "pods_home": home,
            "min_ready": lowest[0], "minimum_allowed": DEPLOYMENTS * minimum_ready(per, FRACTION)}


async def main(pods: int, batches: list[int]) -> dict[str, object]:
    workdir = Path(tempfile.mkdtemp(prefix="fleetmedic-migrate-bench-"))
    env = await WorkflowEnvironment.start_local(dev_server_existing_path=temporal_binary(),
                                                data_converter=data_converter,
                                                search_attributes=SEARCH_ATTRIBUTES, dev_server_log_level="error")
    try:
        runs = [await one_run(env, workdir, pods, batch) for batch in batches]
    finally:
        await env.shutdown()
    return {"benchmark": "migrate_back", "pods": pods, "deployments": DEPLOYMENTS, "runs": runs}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pods", type=int, default=200)
    parser.add_argument("--batches", default="1,5,20")
    options = parser.parse_args()
    print(json.dumps(asyncio.run(main(options.pods, [int(b) for b in options.batches.split(",")]))))
