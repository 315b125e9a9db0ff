"""Benchmark: a whole training cycle on a cluster Kueue shares between training and inference,
driven by FleetMedic (Kueue's admission starts traffic-flip and migrate-back) and, in the same run
and control plane, by hand with kubectl, as JSON.

Real Temporal dev server and worker, the real control plane (scheduler, controller-manager, kwok)
and Kueue's real controller-manager (devstack/kueue_controller.py). `--nodes` h100 nodes of 8 GPUs,
a virtual-kubelet node with as many external GPUs, `--replicas` inference pods of 1 GPU (a
Deployment Kueue manages), a training Job of `--training-gpus` in pods of 1 GPU that Kueue admits by
preempting inference.

What the user feels, per mode:
- `overflow_open_after_admission_s`: when the virtual node opened, from Kueue's admission of the
  training (negative: before it, as FleetMedic opens it while the Workload is still pending);
- `admitted_to_gpus_free_s`: from Kueue admitting the training Workload to every one of its pods
  Running on the GPUs it was admitted for (no inference pod left in their way);
- `admitted_to_inference_whole_s`: ... to every inference replica Ready again (the preempted ones on
  the virtual node);
- `ended_to_home_s`: from Kueue finishing the training Workload to every inference pod Ready at
  home and the virtual node closed;
- `min_ready_flip`, `min_ready_home`: the fewest Ready inference replicas seen (every 50 ms) from the
  training Job's creation to inference whole again, and from the training's end to every pod home,
  against the policy's minimum. While training comes, Kueue's preemption decides it (the same in
  both modes); on the way home, whoever moves the pods does.

By hand (the floor): a script a person would write, polling `kubectl get workloads`: on admission
`kubectl taint` the overflow taint off; on the end, the taint back on and `kubectl drain` of the
inference pods on the virtual node, all at once (then uncordon).

    python bench/flip_cycle.py [--nodes 4] [--replicas 20] [--training-gpus 24]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from temporalio.testing import WorkflowEnvironment

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from devstack import kueue_fleet as kf
from devstack.dev import temporal_binary
from devstack.kube_cluster import LocalKubeCluster
from devstack.kube_world import RealKube
from devstack.kueue_controller import kueue_control_plane
from devstack.replicas import pod_ready
from fleetmedic.converter import data_converter
from fleetmedic.ids import SEARCH_ATTRIBUTES
from fleetmedic.policy import parse_policy
from fleetmedic.settings import Settings
from fleetmedic.traffic import minimum_ready
from workers.worker import build_worker

FRACTION = 0.8
# Kueue preempts for quota, not placement: pods of 1 GPU always fit the GPUs it freed.
TRAINING_POD_GPUS = 1


class Sampler:
    """Every 50 ms: the fewest Ready inference replicas, and when the overflow was first seen open."""

    def __init__(self, kube: RealKube) -> None:
        self.kube, self.lowest, self.stop = kube, 10**9, threading.Event()
        self.opened: float | None = None
        threading.Thread(target=self.run, daemon=True).start()

    def run(self) -> None:
        while not self.stop.is_set():
            self.lowest = min(self.lowest, sum(1 for p in self.kube.list("v1", "Pod", kf.INFERENCE_NS) if pod_ready(p)))
            if self.opened is None and kf.overflow(self.kube) == []:
                self.opened = time.monotonic()
            time.sleep(0.05)


async def until(predicate: Callable[[], bool], what: str, timeout: float = 300) -> float:
    """Polls every 50 ms; the monotonic time it first held."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await asyncio.to_thread(predicate):
            return time.monotonic()
        await asyncio.sleep(0.05)
    raise TimeoutError(f"not within {timeout:g} s: {what}")


def inference_ready(kube: RealKube, where: str, replicas: int) -> bool:
    return len([p for p in kf.inference_on(kube, where) if pod_ready(p)]) == replicas


async def cycle(kube: RealKube, job: str, replicas: int, pods: int,
                on_admitted: Callable[[], None], on_finished: Callable[[], None]) -> dict[str, Any]:
    await until(lambda: inference_ready(kube, "home", replicas) and kf.overflow(kube) == ["NoSchedule"],
                "inference Ready at home, the virtual node closed")
    flipping = Sampler(kube)
    kube.put(kf.training_job(job, pods, TRAINING_POD_GPUS))
    admitted = await until(lambda: kf.condition(kf.workload_of(kube, job), "Admitted"), "training admitted")
    on_admitted()
    free = await until(lambda: sum(1 for p in kube.list("v1", "Pod", kf.TRAINING_NS)
                                   if (p["metadata"].get("labels") or {}).get("app") == job and pod_ready(p)) == pods,
                       "every training pod Running")
    whole = await until(lambda: sum(1 for p in kube.list("v1", "Pod", kf.INFERENCE_NS) if pod_ready(p)) == replicas,
                        "every inference replica Ready again")
    flipping.stop.set()
    homing = Sampler(kube)
    kf.finish(kube, job)
    ended = await until(lambda: kf.condition(kf.workload_of(kube, job), "Finished"), "training finished")
    on_finished()
    home = await until(lambda: inference_ready(kube, "home", replicas) and kf.overflow(kube) == ["NoSchedule"],
                       "every inference pod home, the virtual node closed")
    homing.stop.set()
    return {"overflow_open_after_admission_s": round((flipping.opened or float("nan")) - admitted, 2),
            "admitted_to_gpus_free_s": round(free - admitted, 2),
            "admitted_to_inference_whole_s": round(whole - admitted, 2),
            "ended_to_home_s": round(home - ended, 2),
            "min_ready_flip": flipping.lowest, "min_ready_home": homing.lowest}


def kubectl(cluster: LocalKubeCluster, *args: str) -> None:
    subprocess.run(["kubectl", "--kubeconfig", str(cluster.kubeconfig("admin")), *args], check=True,
                   capture_output=True, text=True, timeout=120)


async def main(nodes: int, replicas: int, training_gpus: int) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix="fleetmedic-flip-bench-"))
    home_gpus = 8 * nodes
    pods = training_gpus // TRAINING_POD_GPUS
    env = await WorkflowEnvironment.start_local(dev_server_existing_path=temporal_binary(),
                                                data_converter=data_converter,
                                                search_attributes=SEARCH_ATTRIBUTES, dev_server_log_level="error")
    try:
        with kueue_control_plane(workdir / "kube") as cluster:
            kube = RealKube(cluster, None, workdir)
            for obj in [*kf.gpu_nodes([f"h100-{i}" for i in range(nodes)]), kf.virtual_node(home_gpus),
                        *kf.kueue_objects(home_gpus, home_gpus, training_priority=1000), kf.inference(replicas)]:
                kube.put(obj)

            policy = parse_policy(yaml.safe_dump({"traffic": {
                "min_ready_fraction": FRACTION, "watch_duration": "5s", "batch_size": 2, "batch_pause": "0s",
                "kueue_resync": "10s"}}))
            settings = Settings(kubeconfig=str(kube.write_kubeconfig(workdir / "kubeconfig", "worker")), slurm="off",
                                metrics_port=0, task_queue="bench-flip", cluster="bench-flip")
            async with build_worker(env.client, settings, policy):
                fleetmedic = await cycle(kube, "with-fleetmedic", replicas, pods, lambda: None, lambda: None)

            def open_by_hand() -> None:
                kubectl(cluster, "taint", "node", kf.VIRTUAL_NODE, f"{kf.OVERFLOW_TAINT['key']}-")

            def home_by_hand() -> None:
                kubectl(cluster, "taint", "node", kf.VIRTUAL_NODE,
                        f"{kf.OVERFLOW_TAINT['key']}={kf.OVERFLOW_TAINT['value']}:NoSchedule")
                kubectl(cluster, "drain", kf.VIRTUAL_NODE, "--pod-selector", "fleetmedic.io/workload=inference",
                        "--ignore-daemonsets", "--timeout", "120s")
                kubectl(cluster, "uncordon", kf.VIRTUAL_NODE)

            by_hand = await cycle(kube, "by-hand", replicas, pods, open_by_hand, home_by_hand)
    finally:
        await env.shutdown()
    minimum = minimum_ready(replicas, FRACTION)

    def ratio(key: str) -> float:
        return round(float(fleetmedic[key]) / max(float(by_hand[key]), 0.01), 2)

    return {"benchmark": "flip_cycle", "home_gpus": home_gpus, "inference_replicas": replicas,
            "training_gpus": training_gpus, "minimum_ready": minimum,
            "fleetmedic": fleetmedic, "by_hand_kubectl": by_hand,
            "ratio_to_by_hand": {k: ratio(k) for k in ("admitted_to_gpus_free_s", "admitted_to_inference_whole_s",
                                                       "ended_to_home_s")},
            # The verdict: on the way home FleetMedic keeps the minimum (by hand it need not).
            "fleetmedic_home_never_below_minimum": fleetmedic["min_ready_home"] >= minimum,
            "by_hand_home_never_below_minimum": by_hand["min_ready_home"] >= minimum}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--replicas", type=int, default=20)
    parser.add_argument("--training-gpus", type=int, default=24)
    options = parser.parse_args()
    print(json.dumps(asyncio.run(main(options.nodes, options.replicas, options.training_gpus))))
