"""traffic-flip and migrate-back end to end: the real Temporal dev server and the real control plane
(the Deployment and ReplicaSet controllers recreate evicted pods, the scheduler places them and
honours the overflow taint, the disruption controller computes the PDB), inference behind a
PodDisruptionBudget."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client as k8s
from temporalio.client import Client, WorkflowExecutionStatus, WorkflowHandle
from temporalio.common import WorkflowIDConflictPolicy

from devstack import fleet
from devstack.kube_world import RealKube
from devstack.replicas import deployment, pod_ready, virtual_node
from devstack.standins import ProviderStandIn, SlackStandIn
from fleetmedic.ids import cluster_workflow_id, guard_workflow_id
from fleetmedic.models import EscalationAnswer, GuardState, Operator, RunbookStatus
from fleetmedic.policy import Policy
from fleetmedic.traffic import TrafficInput
from tests.gate_check import assert_gated, cancels_requested, scheduled_events
from tests.harness import quick_policy, settings_for, until_quiet, worker_for
from tests.runbook_stack import save_history, status_when

REPLICAS, MINIMUM = 40, 36  # min_ready_fraction 0.9
HOME_NODES = [f"gpu-{i}" for i in range(5)]  # 5 × 8 GPUs: exactly inference's 40


@dataclass
class Sampler:
    """Watches the fleet every 20 ms: the fewest ready inference pods ever, and every taint the
    virtual node ever carried."""

    kube: RealKube
    min_ready: int = 10**9
    effects: set[str] = field(default_factory=set)
    stop: threading.Event = field(default_factory=threading.Event)

    def ready(self) -> int:
        return sum(1 for p in self.kube.list("v1", "Pod", "inference") if pod_ready(p))

    def run(self) -> None:
        while not self.stop.is_set():
            self.min_ready = min(self.min_ready, self.ready())
            node = self.kube.get("v1", "Node", "virtual-gpu")
            for taint in (node or {}).get("spec", {}).get("taints") or []:
                if taint["key"] == "fleetmedic.io/overflow":
                    self.effects.add(taint["effect"])
            time.sleep(0.02)


@dataclass
class World:
    client: Client
    task_queue: str
    kube: RealKube
    slack: SlackStandIn
    tmp_path: Path

    def policy(self, retries: dict[str, Any] | None = None, **traffic: Any) -> Policy:
        values = {"watch_duration": "3s", "below_minimum_grace": "2s", "batch_size": 5, "batch_pause": "0s",
                  "batch_timeout": "30s", "min_ready_fraction": 0.9, **traffic}
        return quick_policy(self.tmp_path, traffic=values, **({"retries": retries} if retries else {}))

    def on(self, where: str) -> list[dict[str, Any]]:
        pods = self.kube.list("v1", "Pod", "inference")
        if where == "virtual":
            return [p for p in pods if p["spec"].get("nodeName") == "virtual-gpu"]
        return [p for p in pods if p["spec"].get("nodeName") in HOME_NODES]

    def wait(self, predicate: Any, timeout: float = 60, what: str = "") -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return
            time.sleep(0.1)
        raise AssertionError(f"not in time: {what}")

    def all_home_ready(self, where: str) -> bool:
        pods = self.on(where)
        return len(pods) == REPLICAS and all(pod_ready(p) for p in pods)

    def overflow(self) -> list[dict[str, Any]]:
        node = self.kube.get("v1", "Node", "virtual-gpu")
        assert node is not None
        return [t for t in node["spec"].get("taints") or [] if t["key"] == "fleetmedic.io/overflow"]

    def admit_training(self, nodes: list[str]) -> None:
        """Kueue admits a high-priority training job; its pods take `nodes` (the scheduler preempts
        inference there through evictions, PDB honoured)."""
        self.kube.put(fleet.workload("pretrain", "training", "h100", 8 * len(nodes), priority=1000))
        for name in nodes:
            self.kube.put(fleet.pod(f"pretrain-{name}", name, namespace="training", owner_kind="Job",
                                             gpus=8))
        api = k8s.CoreV1Api(self.kube.api)  # the scheduler's preemption, not FleetMedic: the admin identity
        for pod in [p for p in self.kube.list("v1", "Pod", "inference") if p["spec"].get("nodeName") in nodes]:
            body = k8s.V1Eviction(metadata=k8s.V1ObjectMeta(name=pod["metadata"]["name"], namespace="inference"))
            while True:
                try:
                    api.create_namespaced_pod_eviction(pod["metadata"]["name"], "inference", body)
                    break
                except k8s.ApiException as exc:
                    if exc.status != 429:
                        raise
                    time.sleep(0.1)

    async def start(self, runbook: str, dry_run: bool = False) -> WorkflowHandle[Any, RunbookStatus]:
        return await self.client.start_workflow(
            runbook, TrafficInput(cluster=self.task_queue, dry_run=dry_run, requested_by="test"),
            id=cluster_workflow_id(runbook, self.task_queue), task_queue=self.task_queue, result_type=RunbookStatus,
            id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING)


@pytest.fixture
def world(client: Client, task_queue: str, kube: RealKube, slack: SlackStandIn,
          tmp_path: Path) -> Iterator[World]:
    for name in HOME_NODES:
        kube.put(fleet.node(name))
    kube.put(fleet.pdb("serve", namespace="inference", match_labels={"app": "serve"}, min_available=MINIMUM))
    yield World(client, task_queue, kube, slack, tmp_path)


@pytest.fixture
def sampler(kube: RealKube) -> Iterator[Sampler]:
    s = Sampler(kube)
    yield s
    s.stop.set()


def start_sampling(s: Sampler) -> None:
    threading.Thread(target=s.run, daemon=True).start()


def fill_home_with_training(world: World) -> None:
    """Training holds every home GPU (so inference, when it starts, lands on the open virtual node)."""
    for name in HOME_NODES:
        world.kube.put(fleet.pod(f"old-train-{name}", name, namespace="training", owner_kind="Job", gpus=8))


def training_finishes(world: World) -> None:
    world.wait(lambda: world.all_home_ready("virtual"), what="inference placed away")
    for name in HOME_NODES:
        world.kube.remove("v1", "Pod", f"old-train-{name}", "training")


def settings(world: World) -> Any:
    return settings_for(world.task_queue, world.kube, slack=world.slack)


async def test_training_admitted_opens_the_virtual_node_and_inference_moves_without_dropping(
        world: World, sampler: Sampler) -> None:
    world.kube.put(virtual_node(overflow_closed=True))
    world.kube.put(deployment("serve", REPLICAS))
    world.wait(lambda: world.all_home_ready("home"), what="inference starts at home")
    start_sampling(sampler)
    async with worker_for(world.client, settings(world), world.policy()):
        world.kube.put(fleet.workload("pretrain", "training", "h100", 32, priority=1000))
        handle = await world.start("traffic-flip")
        again = await world.start("traffic-flip")  # a duplicate trigger attaches to the same run
        assert again.result_run_id == handle.result_run_id
        await status_when(handle, lambda s: s.step == "watch inference")
        assert world.overflow() == []
        await asyncio.to_thread(world.admit_training, HOME_NODES[:4])
        await asyncio.to_thread(world.wait, lambda: len(world.on("virtual")) == 32 and sampler.ready() == REPLICAS,
                                60, "inference re-homed on the virtual node")
        report = await asyncio.wait_for(handle.result(), 60)
        await save_history(handle)
    assert report.outcome == "flipped", report.decisions
    assert any("training training/pretrain (32 GPUs) leaves 8 of 40 GPUs; inference needs 40" in d.result
               for d in report.decisions)
    assert sampler.min_ready >= MINIMUM, sampler.min_ready
    assert any("remove taint fleetmedic.io/overflow=closed:NoSchedule on node virtual-gpu" in a for a in report.actions)


async def test_training_finished_forty_pods_come_home_in_batches_never_below_the_minimum(
        world: World, sampler: Sampler) -> None:
    world.kube.put(virtual_node(overflow_closed=False))
    fill_home_with_training(world)  # first: the scheduler places the Deployment's pods the moment it exists
    world.kube.put(deployment("serve", REPLICAS))
    # A PDB far looser than the policy's minimum: FleetMedic's own batching is what holds 36 of 40.
    world.kube.put(fleet.pdb("serve", namespace="inference", match_labels={"app": "serve"},
                                      min_available=20))
    training_finishes(world)
    start_sampling(sampler)
    async with worker_for(world.client, settings(world), world.policy(batch_size=5)):
        migrate = await world.start("migrate-back")
        report = await asyncio.wait_for(migrate.result(), 120)
        await save_history(migrate)
        gated = assert_gated(await migrate.fetch_history())
    world.wait(lambda: world.all_home_ready("home"), what="all home and ready")
    # Evicted pods take their grace period to go (a kubelet's SIGTERM, then the pod object).
    world.wait(lambda: world.on("virtual") == [], what="the pods moved home have left the virtual node")
    assert report.outcome == "migrated", report.decisions
    assert sampler.min_ready >= MINIMUM, sampler.min_ready
    assert sampler.effects == {"NoSchedule"}  # closed again, and never with NoExecute
    assert gated == {"k8s.add_taint", "traffic.evict"}
    batches = [d for d in report.decisions if d.step == "move a batch home" and d.result.startswith("evicted")]
    assert len(batches) >= REPLICAS // 4  # at most 40 - 36 at a time, though the batch size is 5
    assert any("40 pod(s) home" in d.result and "never below the minimum" in d.result for d in report.decisions)


async def test_training_again_mid_migration_stops_it_within_a_batch_and_the_flip_runs(world: World) -> None:
    world.kube.put(virtual_node(overflow_closed=False))
    fill_home_with_training(world)  # first: the scheduler places the Deployment's pods the moment it exists
    world.kube.put(deployment("serve", REPLICAS))
    training_finishes(world)
    async with worker_for(world.client, settings(world), world.policy(batch_size=5, batch_pause="1s")):
        migrate = await world.start("migrate-back")
        await status_when(migrate, lambda s: sum(d.result.startswith("evicted") for d in s.decisions) >= 2)
        world.kube.put(fleet.workload("pretrain", "training", "h100", 32, priority=1000))
        flip = await world.start("traffic-flip")
        migrated = await asyncio.wait_for(migrate.result(), 60)
        flipped = await asyncio.wait_for(flip.result(), 60)
    # No pod is left without a home: every replica runs somewhere and is Ready.
    world.wait(lambda: sum(1 for p in world.kube.list("v1", "Pod", "inference")
                           if p["spec"].get("nodeName") and pod_ready(p))
               == REPLICAS, what="every replica has a home")
    assert migrated.outcome == "stopped", migrated.decisions
    stop_at = next(d.at for d in flipped.decisions if d.step == "stop migrate-back")
    after_stop = [d for d in migrated.decisions if d.result.startswith("evicted") and d.at > stop_at]
    assert len(after_stop) <= 1  # within one batch
    assert world.overflow() == []  # open again: inference may spill out while training runs
    assert flipped.outcome == "flipped"
    opened = next(d.at for d in flipped.decisions if d.step == "open the virtual node")
    assert opened >= migrated.decisions[-1].at  # never acting at the same time


async def test_migrate_back_waits_out_a_fleet_pause_and_an_abort_ends_it(world: World) -> None:
    """The fleet pause reaches a runbook that holds no lease: it asks the guard at each gate."""
    world.kube.put(virtual_node(overflow_closed=False))
    fill_home_with_training(world)
    world.kube.put(deployment("serve", REPLICAS))
    training_finishes(world)
    async with worker_for(world.client, settings(world), world.policy()):
        await world.client.start_workflow(  # `fleetmedic pause`: the guard starts paused
            "fleet-guard", GuardState(cluster=world.task_queue), id=guard_workflow_id(world.task_queue),
            task_queue=world.task_queue, id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
            start_signal="pause", start_signal_args=[Operator(by="dana", reason="change freeze")])
        migrate = await world.start("migrate-back")
        status = await status_when(migrate, lambda s: "fleet paused by dana" in (s.waiting_for or ""))
        assert status.step == "close the virtual node" and status.paused is not None
        await asyncio.sleep(2)
        assert world.overflow() == [] and len(world.on("virtual")) == REPLICAS  # nothing changed
        await migrate.signal("abort", Operator(by="dana", reason="not today"))
        report = await asyncio.wait_for(migrate.result(), 60)
    assert report.outcome == "aborted", report.decisions
    assert len(world.on("virtual")) == REPLICAS


async def test_an_abort_ends_a_batch_that_waits_out_a_pdb_at_once(world: World) -> None:
    """A batch coming home waits up to `batch_timeout` (10 minutes here) while the service's PDB
    lets no pod go, evicting again whenever it would. An operator's abort ends the run at once, and
    the evictions stop at the batch's next heartbeat (every 8 s, whatever `wait_heartbeat` is):
    every pod stays where it serves."""
    world.kube.put(virtual_node(overflow_closed=False))
    fill_home_with_training(world)
    world.kube.put(deployment("serve", REPLICAS))
    world.kube.put(fleet.pdb("serve", namespace="inference", match_labels={"app": "serve"},
                                      min_available=REPLICAS))

    def evictions_tried() -> int:  # as the API server saw them
        return sum(1 for r in world.kube.requests(("worker",)) if r.url.path.endswith("/eviction"))

    training_finishes(world)
    policy = world.policy(batch_timeout="10m")  # the default wait_heartbeat: 2 minutes
    async with worker_for(world.client, settings(world), policy):
        migrate = await world.start("migrate-back")
        await status_when(migrate, lambda s: s.step == "move a batch home" and evictions_tried() >= 10,
                          timeout=120)
        await migrate.signal("abort", Operator(by="dana", reason="serve is mid-rollout"))
        report = await asyncio.wait_for(migrate.result(), 60)
        await save_history(migrate)
        # The worker still runs: no eviction for longer than two of the batch's 5-second backoffs.
        await until_quiet(evictions_tried, 12, "the batch's evictions")
        history = await migrate.fetch_history()
    assert report.outcome == "aborted", report.decisions
    [batch] = scheduled_events(history, "traffic.evict")
    assert cancels_requested(history) == [batch.event_id]
    assert len(world.on("virtual")) == REPLICAS  # nobody was moved


async def test_an_abort_ends_the_wait_for_the_other_runbook_to_stop_at_once(world: World) -> None:
    """traffic-flip asks migrate-back to stop and waits up to 15 minutes for it to close. Here
    migrate-back cannot close yet (it waits out a fleet pause before its next change). An operator
    who aborts the flip ends it at once, having changed nothing, not when the wait runs out."""
    world.kube.put(virtual_node(overflow_closed=False))
    fill_home_with_training(world)
    world.kube.put(deployment("serve", REPLICAS))
    training_finishes(world)
    async with worker_for(world.client, settings(world), world.policy(retries={"call_timeout": "10s"})):
        await world.client.start_workflow(  # `fleetmedic pause`: the guard starts paused
            "fleet-guard", GuardState(cluster=world.task_queue), id=guard_workflow_id(world.task_queue),
            task_queue=world.task_queue, id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
            start_signal="pause", start_signal_args=[Operator(by="dana", reason="change freeze")])
        migrate = await world.start("migrate-back")
        await status_when(migrate, lambda s: "fleet paused by dana" in (s.waiting_for or ""))
        world.kube.put(fleet.workload("pretrain", "training", "h100", 32, priority=1000))
        flip = await world.start("traffic-flip")
        await status_when(flip, lambda s: s.step == "stop migrate-back")
        await asyncio.sleep(2)  # well into the wait: migrate-back, paused, does not close
        assert (await migrate.describe()).status == WorkflowExecutionStatus.RUNNING
        await flip.signal("abort", Operator(by="erin", reason="wrong cluster"))
        flipped = await asyncio.wait_for(flip.result(), 30)
        await save_history(flip)
        history = await flip.fetch_history()
        await migrate.signal("abort", Operator(by="dana", reason="test over"))
        await asyncio.wait_for(migrate.result(), 60)
    assert flipped.outcome == "stopped", flipped.decisions
    assert any("erin" in d.result and "wrong cluster" in d.result for d in flipped.decisions), flipped.decisions
    [wait] = scheduled_events(history, "traffic.stop_runbook")
    assert cancels_requested(history) == [wait.event_id]
    # The flip changed nothing: the virtual node is as it was, every replica where it served.
    assert world.overflow() == [] and len(world.on("virtual")) == REPLICAS


async def test_an_opted_out_namespace_stays_on_the_virtual_node(world: World) -> None:
    world.kube.put(virtual_node(overflow_closed=False))
    fill_home_with_training(world)
    world.kube.put(deployment("serve", REPLICAS))
    namespace = world.kube.get("v1", "Namespace", "inference")
    assert namespace is not None
    labels = namespace["metadata"].setdefault("labels", {})
    try:
        labels["fleetmedic.io/remediation"] = "disabled"
        world.kube.put(namespace)
        training_finishes(world)
        async with worker_for(world.client, settings(world), world.policy()):
            report = await asyncio.wait_for((await world.start("migrate-back")).result(), 60)
    finally:
        labels.pop("fleetmedic.io/remediation", None)
        world.kube.put(namespace)
    assert report.outcome == "migrated", report.decisions
    assert "0 pod(s) home" in report.decisions[-1].result
    assert "namespace inference has fleetmedic.io/remediation=disabled" in report.decisions[-1].result
    assert len(world.on("virtual")) == REPLICAS
    assert not [m for m in world.kube.mutations() if m.url.path.endswith("/eviction")]


async def test_a_failed_slo_gate_pauses_the_migration_and_escalates(world: World) -> None:
    world.kube.put(virtual_node(overflow_closed=False))
    fill_home_with_training(world)  # first: the scheduler places the Deployment's pods the moment it exists
    world.kube.put(deployment("serve", REPLICAS))
    # The service's owners froze it: its PDB allows no disruption at all.
    world.kube.put(fleet.pdb("serve", namespace="inference", match_labels={"app": "serve"},
                                      min_available=REPLICAS))
    training_finishes(world)
    async with worker_for(world.client, settings(world), world.policy(batch_timeout="3s")):
        migrate = await world.start("migrate-back")
        status = await status_when(migrate, lambda s: s.escalation is not None)
        assert status.escalation is not None and status.escalation.step == "SLO gate"
        assert "could not evict 4 pod(s)" in status.escalation.error and "PodDisruptionBudget" in \
            status.escalation.error and "paused" in status.escalation.error
        await migrate.signal("answer", EscalationAnswer(action="abort", by="sre", reason="service frozen"))
        report = await asyncio.wait_for(migrate.result(), 60)
    assert report.outcome == "aborted"
    assert any("@oncall" in m["text"] and "SLO gate" in m["text"] for m in world.slack.messages)
    assert len(world.on("virtual")) == REPLICAS  # nobody was moved


async def test_nothing_to_do_is_recorded_without_touching_anything(world: World) -> None:
    world.kube.put(virtual_node(overflow_closed=True))
    world.kube.put(deployment("serve", REPLICAS))
    world.wait(lambda: world.all_home_ready("home"), what="inference at home")
    async with worker_for(world.client, settings(world), world.policy()):
        flip = await asyncio.wait_for((await world.start("traffic-flip")).result(), 60)
        back = await asyncio.wait_for((await world.start("migrate-back")).result(), 60)
    assert flip.outcome == "not-needed" and "no training at or above the priority" in flip.decisions[-1].result
    assert back.outcome == "nothing-to-move"
    assert [m for m in world.kube.mutations() if "/nodes/" in m.url.path] == []


async def test_prewarm_asks_the_provider_and_waits_for_external_capacity(world: World,
                                                                         provider_http: ProviderStandIn) -> None:
    world.kube.put(virtual_node(gpus=0, overflow_closed=True))
    world.kube.put(deployment("serve", REPLICAS))
    policy = quick_policy(world.tmp_path, provider={"kind": "http", "http": {"url": provider_http.url}},
                          traffic={"prewarm": True, "prewarm_timeout": "30s", "watch_duration": "1s"})

    def capacity_arrives() -> None:  # the external provider brings 64 GPUs up behind the virtual node
        world.wait(lambda: bool(provider_http.accepted()), 30, "the prewarm request")
        node = world.kube.get("v1", "Node", "virtual-gpu")
        assert node is not None
        node["status"]["allocatable"]["nvidia.com/gpu"] = "64"
        world.kube.put(node)

    world.wait(lambda: world.all_home_ready("home"), what="inference at home")
    world.kube.put(fleet.workload("pretrain", "training", "h100", 32, priority=1000))
    async with worker_for(world.client, settings_for(world.task_queue, world.kube, provider=provider_http),
                          policy):
        handle = await world.start("traffic-flip")
        await asyncio.to_thread(capacity_arrives)
        report = await asyncio.wait_for(handle.result(), 60)
    assert report.outcome == "flipped", report.decisions
    [request] = provider_http.accepted()
    assert (request["node"], request["action"]) == ("virtual-gpu", "prewarm")
    results = [d.result for d in report.decisions if d.step == "pre-warm"]
    assert results[-1] == "external capacity ready: 64 GPUs"
    opened = next(d.at for d in report.decisions if d.step == "open the virtual node")
    ready = next(d.at for d in report.decisions if d.result == "external capacity ready: 64 GPUs")
    assert ready <= opened  # inference spills out only once the capacity is there


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[tuple[str, Any]]:
    """Debian's Prometheus scraping an exporter the test controls (the gateway's 5xx ratio)."""
    import shutil
    import subprocess

    import httpx
    import yaml
    from prometheus_client import CollectorRegistry, Gauge, start_http_server

    from devstack.slurm_cluster import free_port
    from tests.conftest import require

    binary = shutil.which("prometheus")
    require(binary is not None, "Debian's prometheus")
    registry = CollectorRegistry()
    errors = Gauge("inference_gateway_error_ratio", "5xx share of inference requests", registry=registry)
    exporter_port, port = free_port(), free_port()
    server, thread = start_http_server(exporter_port, addr="127.0.0.1", registry=registry)
    config = tmp_path / "prometheus.yml"
    config.write_text(yaml.safe_dump({"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                                      "scrape_configs": [{"job_name": "gateway", "static_configs": [
                                          {"targets": [f"127.0.0.1:{exporter_port}"]}]}]}))
    proc = subprocess.Popen([str(binary), f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                answer = httpx.get(f"{url}/api/v1/query", params={"query": "inference_gateway_error_ratio"}, timeout=1)
                if answer.status_code == 200 and answer.json()["data"]["result"]:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        else:
            raise AssertionError("prometheus did not scrape the exporter")
        yield url, errors
    finally:
        proc.kill()
        proc.wait()
        server.shutdown()


async def test_the_slo_query_gates_each_batch_against_a_real_prometheus(world: World, prometheus: Any) -> None:
    url, errors = prometheus
    errors.set(0.2)  # the gateway is failing one request in five
    world.kube.put(virtual_node(overflow_closed=False))
    fill_home_with_training(world)  # first: the scheduler places the Deployment's pods the moment it exists
    world.kube.put(deployment("serve", REPLICAS))
    policy = world.policy(batch_size=10, slo_query="max(inference_gateway_error_ratio)", slo_max=0.01)
    training_finishes(world)
    async with worker_for(world.client, settings_for(world.task_queue, world.kube, slack=world.slack,
                                                     prometheus_url=url), policy):
        migrate = await world.start("migrate-back")
        status = await status_when(migrate, lambda s: s.escalation is not None)
        assert status.escalation is not None
        assert "SLO: max(inference_gateway_error_ratio) = 0.2 (max 0.01)" in status.escalation.error
        # Paused after the first batch: 4, not the batch size of 10 — 36 of 40 must stay ready.
        assert len(world.on("home")) == REPLICAS - MINIMUM
        errors.set(0.0)  # the gateway recovered
        await asyncio.sleep(2)  # two scrapes
        await migrate.signal("answer", EscalationAnswer(action="retry", by="sre", reason="gateway fixed"))
        report = await asyncio.wait_for(migrate.result(), 120)
    assert report.outcome == "migrated", report.decisions
    assert any(d.step == "SLO gate" and d.result == "max(inference_gateway_error_ratio) = 0 (max 0.01)"
               for d in report.decisions)
