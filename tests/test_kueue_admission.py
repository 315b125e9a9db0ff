"""Kueue's own admission drives the traffic runbooks: the real control plane, Kueue's real
controller-manager (admission, preemption, its webhooks, its RBAC), the real scheduler placing
pods, the Temporal dev server. Nobody writes a Workload's status here: Kueue does.

Counted from the outside: ready inference replicas sampled throughout, where pods run, the
virtual node's taints, and what FleetMedic's worker and Kueue each wrote (the apiserver's audit log).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from temporalio.client import Client, WorkflowHandle
from temporalio.service import RPCError

from activities.kueue import training_workloads
from devstack import kueue_fleet as kf
from devstack.kube_world import RealKube
from devstack.replicas import pod_ready
from devstack.slurm_cluster import LocalSlurmCluster
from devstack.standins import ProviderStandIn, SlackStandIn
from fleetmedic.ids import cluster_workflow_id
from fleetmedic.models import RunbookStatus
from fleetmedic.settings import Settings
from tests.harness import quick_policy, settings_for, worker_for
from tests.runbook_stack import Stack, fleetmedic_cli, save_history, status_when

HOME_NODES, GPUS_PER_NODE = ["h100-0", "h100-1"], 8  # 16 GPUs at home
REPLICAS, MINIMUM = 10, 8  # inference: 10 pods of 1 GPU, min_ready_fraction 0.8
# 8 GPUs: Kueue preempts 2 inference pods for it. Pods of 1 GPU: Kueue preempts for quota, not for
# placement, and 2-GPU pods could find the freed GPUs split 1 + 1 over two nodes.
TRAINING_PODS, TRAINING_GPUS = 8, 1
EXTERNAL_GPUS = 16


@dataclass
class Sampler:
    """Ready inference pods every 50 ms (the fewest ever seen) and every overflow taint effect seen."""

    kube: RealKube
    min_ready: int = 10**9
    samples: int = 0
    stop: threading.Event = field(default_factory=threading.Event)

    def ready(self) -> int:
        return sum(1 for p in self.kube.list("v1", "Pod", kf.INFERENCE_NS) if pod_ready(p))

    def run(self) -> None:
        while not self.stop.is_set():
            self.min_ready = min(self.min_ready, self.ready())
            self.samples += 1
            time.sleep(0.05)


@dataclass
class KueueWorld:
    client: Client
    task_queue: str
    kube: RealKube
    tmp_path: Path

    def inference_on(self, where: str) -> list[dict[str, Any]]:
        return kf.inference_on(self.kube, where)

    def overflow(self) -> list[str]:
        return kf.overflow(self.kube)

    def workload_of(self, job: str) -> dict[str, Any] | None:
        return kf.workload_of(self.kube, job)

    def condition(self, workload: dict[str, Any] | None, kind: str) -> bool:
        return kf.condition(workload, kind)

    async def inference_at_home(self) -> None:
        self.kube.put(kf.inference(REPLICAS))
        await self.until(lambda: len([p for p in self.inference_on("home") if pod_ready(p)]) == REPLICAS,
                         "inference admitted by Kueue and Ready at home")

    def settings(self) -> Settings:
        """A worker's, for this test's cluster (its Kueue watch starts runs for it)."""
        return settings_for(self.task_queue, self.kube, cluster=self.task_queue)

    async def until(self, predicate: Callable[[], bool], what: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if await asyncio.to_thread(predicate):
                return
            await asyncio.sleep(0.1)
        raise AssertionError(f"not within {timeout:g} s: {what}")

    def finish(self, job: str) -> None:
        kf.finish(self.kube, job)

    def handle(self, runbook: str) -> WorkflowHandle[Any, RunbookStatus]:
        return self.client.get_workflow_handle(cluster_workflow_id(runbook, self.task_queue),
                                               result_type=RunbookStatus)

    async def run_of(self, runbook: str, timeout: float = 60) -> WorkflowHandle[Any, RunbookStatus]:
        """The run of `runbook` for this cluster, once something (Kueue's admission) has started it."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                description = await self.handle(runbook).describe()
                return self.client.get_workflow_handle(description.id, run_id=description.run_id,
                                                       result_type=RunbookStatus)
            except RPCError:
                await asyncio.sleep(0.2)
        raise AssertionError(f"no {runbook} run started within {timeout:g} s")


@pytest.fixture
def kueue_world(client: Client, task_queue: str, kueue_kube: RealKube, tmp_path: Path) -> Iterator[KueueWorld]:
    for obj in [*kf.gpu_nodes(HOME_NODES, GPUS_PER_NODE), kf.virtual_node(EXTERNAL_GPUS),
                *kf.kueue_objects(len(HOME_NODES) * GPUS_PER_NODE, EXTERNAL_GPUS, training_priority=1000)]:
        kueue_kube.put(obj)
    yield KueueWorld(client, task_queue, kueue_kube, tmp_path)


@pytest.fixture
def sampler(kueue_kube: RealKube) -> Iterator[Sampler]:
    s = Sampler(kueue_kube)
    yield s
    s.stop.set()


def policy(world: KueueWorld, **traffic: Any) -> Any:
    values = {"start_from_kueue": True, "kueue_resync": "5s", "watch_duration": "5s", "below_minimum_grace": "30s",
              "batch_size": 2, "batch_pause": "0s", "batch_timeout": "30s", "min_ready_fraction": 0.8, **traffic}
    return quick_policy(world.tmp_path, traffic=values)


async def test_kueue_admits_training_by_preempting_inference_the_flip_and_migrate_back_follow(
        kueue_world: KueueWorld, sampler: Sampler) -> None:
    world = kueue_world
    await world.inference_at_home()
    threading.Thread(target=sampler.run, daemon=True).start()
    settings = world.settings()
    worker = worker_for(world.client, settings, policy(world))
    async with worker:
        world.kube.put(kf.training_job("pretrain", TRAINING_PODS, TRAINING_GPUS))
        flip = await world.run_of("traffic-flip")
        flipped = await asyncio.wait_for(flip.result(), 90)
        await world.until(lambda: world.condition(world.workload_of("pretrain"), "Admitted"),
                          "Kueue admits the training Job")
        await world.until(lambda: len([p for p in world.inference_on("virtual") if pod_ready(p)]) == 2,
                          "the 2 preempted inference pods Ready on the virtual node")
        assert world.overflow() == []
        await save_history(flip, "traffic-flip-kueue-pending-training")

        world.finish("pretrain")
        await world.until(lambda: world.condition(world.workload_of("pretrain"), "Finished"),
                          "Kueue finishes the training Workload")
        migrate = await world.run_of("migrate-back")
        migrated = await asyncio.wait_for(migrate.result(), 120)
        await save_history(migrate, "migrate-back-kueue-training-finished")
    sampler.stop.set()
    assert flipped.outcome == "flipped", flipped.decisions
    # Started by Kueue's decision, while the training Workload still waited for the preempted pods:
    # the start's summary, written at the look that started the run, says so. (The flip's confirm
    # reads the Workload again once the worker runs it: on a loaded machine Kueue had admitted it
    # by then, and the confirm named it without "(pending)".)
    summary = await (await flip.describe()).static_summary()
    assert summary is not None and "Kueue: training/job-pretrain" in summary and "(pending)" in summary, summary
    assert flipped.decisions[0].step == "confirm" and "training/job-pretrain" in flipped.decisions[0].result, \
        flipped.decisions
    assert migrated.outcome == "migrated", migrated.decisions
    assert world.overflow() == ["NoSchedule"]
    assert world.inference_on("virtual") == []
    assert len([p for p in world.inference_on("home") if pod_ready(p)]) == REPLICAS
    assert sampler.min_ready >= MINIMUM, sampler.min_ready

    # Kueue preempted the inference pods; FleetMedic evicted only pods on the virtual node.
    kueue_wrote = world.kube.requests(("kueue",))
    assert any(r.verb == "patch" and "/pods/" in r.url.path for r in kueue_wrote)
    evicted = [r.url.path.split("/")[-2] for r in world.kube.requests(("worker",))
               if r.url.path.endswith("/eviction") and r.code == 201]
    assert len(evicted) == 2, evicted


async def flipped_with_two_away(world: KueueWorld, job: str) -> WorkflowHandle[Any, RunbookStatus]:
    """Inference at home, then `job` admitted by Kueue and the flip it started done: 2 pods away."""
    world.kube.put(kf.training_job(job, TRAINING_PODS, TRAINING_GPUS))
    flip = await world.run_of("traffic-flip")
    assert (await asyncio.wait_for(flip.result(), 90)).outcome == "flipped"
    await world.until(lambda: len([p for p in world.inference_on("virtual") if pod_ready(p)]) == 2,
                      "the 2 preempted inference pods Ready on the virtual node")
    return flip


async def test_a_fleet_pause_holds_migrate_back_and_training_admitted_again_stops_it(
        kueue_world: KueueWorld, sampler: Sampler) -> None:
    world = kueue_world
    await world.inference_at_home()
    settings = world.settings()
    # One pod a batch, 4 s apart: a second training Job arrives between the two batches.
    async with worker_for(world.client, settings, policy(world, batch_size=1, batch_pause="4s")):
        await flipped_with_two_away(world, "pretrain")
        threading.Thread(target=sampler.run, daemon=True).start()
        paused = await asyncio.to_thread(fleetmedic_cli, world.client, world.task_queue, world.task_queue,
                                         "pause", "--by", "dana", "--reason", "change freeze")
        assert paused.returncode == 0, paused.stderr

        world.finish("pretrain")
        migrate = await world.run_of("migrate-back")
        status = await status_when(migrate, lambda s: "fleet paused by dana" in (s.waiting_for or ""))
        assert status.step == "close the virtual node"
        await asyncio.sleep(2)  # held: nothing closes, nothing moves
        assert world.overflow() == [] and len(world.inference_on("virtual")) == 2

        resumed = await asyncio.to_thread(fleetmedic_cli, world.client, world.task_queue, world.task_queue,
                                          "resume", "--by", "dana")
        assert resumed.returncode == 0, resumed.stderr
        await world.until(lambda: len(world.inference_on("virtual")) == 1, "the first batch (one pod) home")
        world.kube.put(kf.training_job("finetune", TRAINING_PODS, TRAINING_GPUS))
        stopped = await asyncio.wait_for(migrate.result(), 60)
        await save_history(migrate, "migrate-back-stopped-mid-batch")
        flip = await world.run_of("traffic-flip")
        again = await asyncio.wait_for(flip.result(), 90)
    sampler.stop.set()
    # Stopped at once: by the flip Kueue's admission of finetune started, or, had the migration
    # looked first, by finetune itself in its next snapshot.
    assert stopped.outcome == "stopped", stopped.decisions
    assert any(why in stopped.decisions[-1].result for why in ("traffic-flip starts", "training/job-finetune"))
    assert world.overflow() == []  # open again: inference has somewhere to go
    assert again.outcome == "flipped", again.decisions
    assert "training/job-finetune" in again.decisions[0].result, again.decisions[0]
    assert sampler.min_ready >= MINIMUM, sampler.min_ready
    # Only the first batch's one pod was moved by FleetMedic.
    evicted = [r.url.path for r in world.kube.requests(("worker",))
               if r.url.path.endswith("/eviction") and r.code == 201]
    assert len(evicted) == 1, evicted


async def test_a_node_taken_out_under_admitted_training_lowers_the_quota_kueue_admits_by(
        client: Client, task_queue: str, kueue_kube: RealKube, slurm: LocalSlurmCluster, slack: SlackStandIn,
        provider_http: ProviderStandIn, tmp_path: Path) -> None:
    """XID 79 on a node under an admitted training Workload: kueue-quota-sync cuts the h100 quota,
    and Kueue itself leaves a Workload that needs the lost GPUs pending (saying why); when the node
    is back, Kueue admits it."""
    stack = Stack(client, task_queue, kueue_kube, slurm, slack, provider_http, tmp_path)
    nodes = list(slurm.nodes)
    for obj in [*kf.gpu_nodes(nodes), *kf.kueue_objects(8 * len(nodes), 0, training_priority=1000)]:
        kueue_kube.put(obj)
    world = KueueWorld(client, task_queue, kueue_kube, tmp_path)
    # Evicted pods come back (backoffLimit): the Workload stays admitted through the node's loss.
    kueue_kube.put(kf.training_job("pretrain", 4, 2, backoff_limit=20))
    await world.until(lambda: world.condition(world.workload_of("pretrain"), "Admitted"), "pretrain admitted")
    await world.until(lambda: len([p for p in kueue_kube.list("v1", "Pod", kf.TRAINING_NS) if pod_ready(p)]) == 4,
                      "pretrain's pods running")
    under = next(p["spec"]["nodeName"] for p in kueue_kube.list("v1", "Pod", kf.TRAINING_NS))
    policy = stack.policy(kueue={"enabled": True, "max_change_fraction": 1.0})
    full, cut = 8 * len(nodes), 8 * (len(nodes) - 1)
    # Before the XID it would fit: full minus pretrain's 8.
    big = 8 * (len(nodes) - 1)
    pending: dict[str, Any] = {}

    async def while_out(handle: WorkflowHandle[Any, Any]) -> None:
        await status_when(handle, lambda s: s.step in ("replace", "wait for node Ready", "validate"))
        await world.until(lambda: h100_quota(kueue_kube) == cut, f"h100 quota cut to {cut}")
        kueue_kube.put(kf.training_job("big", big // 2, 2))
        await world.until(lambda: reason(world.workload_of("big")) != "", "Kueue's reason for big")
        pending["reason"] = reason(world.workload_of("big"))
        pending["admitted"] = world.condition(world.workload_of("big"), "QuotaReserved")

    report, _ = await stack.run(under, policy=policy, during=while_out, replace_s=10)
    assert report.outcome == "remediated", report.decisions
    assert not pending["admitted"], pending
    assert "insufficient" in pending["reason"] and "nvidia.com/gpu" in pending["reason"], pending
    assert world.condition(world.workload_of("pretrain"), "Admitted")  # the cut left admitted training alone
    # The node's return asked for another sync; a worker picks it up, and Kueue admits big.
    async with worker_for(client, settings_for(task_queue, kueue_kube), policy):
        await world.until(lambda: h100_quota(kueue_kube) == full, f"h100 quota back to {full}")
        await world.until(lambda: world.condition(world.workload_of("big"), "Admitted"), "Kueue admits big")


def h100_quota(kube: RealKube) -> int:
    queue = kube.get(kf.KUEUE, "ClusterQueue", kf.QUEUE) or {}
    flavors = queue["spec"]["resourceGroups"][0]["flavors"]
    return int(next(f for f in flavors if f["name"] == "h100")["resources"][0]["nominalQuota"])


def reason(workload: dict[str, Any] | None) -> str:
    """Why Kueue has not reserved quota for it (its QuotaReserved condition's message), "" before it says."""
    for condition in ((workload or {}).get("status") or {}).get("conditions") or []:
        if condition["type"] == "QuotaReserved" and condition["status"] == "False":
            return str(condition.get("message") or "")
    return ""


async def test_what_kueue_decided_while_no_worker_ran_is_acted_on_at_the_next_start(
        kueue_world: KueueWorld) -> None:
    """No event is needed: a worker's first look is a full list. Training admitted while no worker
    runs is flipped for by the next one; training that ended while none ran starts migrate-back."""
    world = kueue_world
    await world.inference_at_home()
    world.kube.put(kf.training_job("pretrain", TRAINING_PODS, TRAINING_GPUS))
    await world.until(lambda: world.condition(world.workload_of("pretrain"), "Admitted"), "pretrain admitted")
    settings = world.settings()
    async with worker_for(world.client, settings, policy(world)):
        flipped = await asyncio.wait_for((await world.run_of("traffic-flip")).result(), 90)
        await world.until(lambda: len([p for p in world.inference_on("virtual") if pod_ready(p)]) == 2,
                          "the 2 preempted inference pods Ready on the virtual node")
    world.finish("pretrain")
    await world.until(lambda: world.condition(world.workload_of("pretrain"), "Finished"), "pretrain finished")
    async with worker_for(world.client, settings, policy(world)):
        migrated = await asyncio.wait_for((await world.run_of("migrate-back")).result(), 120)
    assert flipped.outcome == "flipped", flipped.decisions
    confirm = flipped.decisions[0].result
    assert "training/job-pretrain-" in confirm and "(pending)" not in confirm, confirm  # admitted by now
    assert migrated.outcome == "migrated", migrated.decisions
    assert world.overflow() == ["NoSchedule"] and world.inference_on("virtual") == []


def kueue_workload(name: str, priority: int, *, conditions: tuple[str, ...] = (), active: bool = True,
                   pods: int = 2, gpus: int = 4, admitted_gpus: int = 0) -> dict[str, Any]:
    """A Workload as Kueue writes it (v1beta2), for the pure tests below."""
    status: dict[str, Any] = {"conditions": [{"type": c, "status": "True"} for c in conditions]}
    if admitted_gpus:
        status["admission"] = {"clusterQueue": "gpus", "podSetAssignments": [
            {"name": "main", "flavors": {"nvidia.com/gpu": "h100"},
             "resourceUsage": {"nvidia.com/gpu": str(admitted_gpus)}}]}
    return {"metadata": {"name": name, "namespace": "training", "uid": f"uid-{name}"},
            "spec": {"priority": priority, "active": active, "podSets": [{"name": "main", "count": pods, "template": {
                "spec": {"containers": [{"name": "m", "resources": {"requests": {"nvidia.com/gpu": str(gpus)}}}]}}}]},
            "status": status}


def test_training_is_admitted_or_pending_and_never_finished_or_deactivated() -> None:
    workloads = [
        kueue_workload("running", 1000, conditions=("QuotaReserved", "Admitted"), admitted_gpus=8),
        kueue_workload("waiting", 1500, pods=3, gpus=2),
        # Kueue leaves Admitted on a finished Workload: it holds nothing any more.
        kueue_workload("done", 1000, conditions=("QuotaReserved", "Admitted", "Finished"), admitted_gpus=8),
        kueue_workload("parked", 1000, active=False),
        kueue_workload("inference", 10, conditions=("Admitted",), admitted_gpus=1),
    ]
    found = {w.name: w for w in training_workloads(workloads, "nvidia.com/gpu", 1000)}
    assert set(found) == {"running", "waiting"}
    assert found["running"].admitted and found["running"].gpus == 8 and found["running"].uid == "uid-running"
    assert not found["waiting"].admitted and found["waiting"].gpus == 6
    assert found["waiting"].ref == "training/waiting (pending)"
