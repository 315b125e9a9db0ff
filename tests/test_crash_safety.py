"""Crash safety: the worker process is SIGKILLed right after each side effect in turn and restarted;
every run still completes, and each mutation reached the systems once — counted where the systems
record them: the API server's audit log, and slurmctld's own log for every `scontrol` write."""

from __future__ import annotations

import asyncio
import os
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from temporalio.client import Client

from devstack import fleet
from devstack.controllers import provider_controller
from devstack.kube_world import RealKube
from devstack.processes import FleetMedicProcess
from devstack.slurm_cluster import LocalSlurmCluster
from devstack.standins import ProviderStandIn, SlackStandIn
from fleetmedic.ids import node_workflow_id
from fleetmedic.models import NodeRunbookInput, RunbookStatus
from tests.harness import CHECKPOINTING_JOB, job_on, quick_policy


def kill_when(condition: Callable[[], bool], worker: FleetMedicProcess, fired: threading.Event,
              stop: threading.Event) -> threading.Thread:
    """Kill the worker the moment `condition` first holds, then start a fresh one."""

    def watch() -> None:
        while not stop.is_set():
            try:
                hit = condition()
            except Exception:
                hit = False
            if hit:
                worker.kill()
                fired.set()
                worker.start()
                return
            time.sleep(0.01)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


@pytest.mark.temporal_production
@pytest.mark.parametrize("moment", [
    "slurm down", "cordoned", "first pod evicted", "provider asked", "node ready again", "uncordoned",
    "slurm resumed", "event recorded",
])
async def test_worker_killed_after_each_side_effect(moment: str, client: Client, task_queue: str,
                                                    kube: RealKube, slurm: LocalSlurmCluster,
                                                    slack: SlackStandIn, provider_http: ProviderStandIn,
                                                    tmp_path: Path) -> None:
    node = "gpu-node-1"
    for name in slurm.nodes:
        kube.put(fleet.node(name))
    kube.put(fleet.pod("trainer", node, namespace="training", owner_kind="Job", gpus=8))
    kube.put(fleet.pod("serve", node, namespace="inference"))
    kube.put(fleet.pod("dcgm", node, namespace="gpu-operator", owner_kind="DaemonSet"))

    # XID 79 as if it left the job alive (catalog job_lost off): the job is signalled and checkpoints.
    policy = quick_policy(tmp_path, provider={"kind": "http", "http": {"url": provider_http.url}},
                          xid={"catalog": {79: {"job_lost": False}}},
                          # A killed worker's wait moves on after 10 s, not the default 2 min.
                          retries={"call_timeout": "6s", "wait_heartbeat": "10s"})
    # A training job on the node: it is signalled, checkpoints, and is requeued once.
    job = slurm.submit(CHECKPOINTING_JOB.format(root=policy.storage.root), "-w", node)
    assert job_on(slurm, job) == node
    policy_file = tmp_path / "policy.yaml"
    policy_file.write_text(yaml.safe_dump(policy.serving(task_queue).model_dump(mode="json", by_alias=True)))
    env = {**os.environ, "TEMPORAL_ADDRESS": client.service_client.config.target_host,
           "TEMPORAL_NAMESPACE": client.namespace,
           "FLEETMEDIC_TASK_QUEUE": task_queue, "FLEETMEDIC_POLICY": str(policy_file),
           "KUBECONFIG": str(kube.kubeconfig), "FLEETMEDIC_KUBE_TIMEOUT": "2",  # type: ignore[attr-defined]
           "FLEETMEDIC_SLURM": "on", "SLURM_CONF": str(slurm.conf), "FLEETMEDIC_SLURM_TIMEOUT": "4",
           "SLACK_BOT_TOKEN": "xoxb-test", "FLEETMEDIC_SLACK_CHANNEL": "#fleet", "FLEETMEDIC_SLACK_API_URL":
           slack.api_url, "FLEETMEDIC_PROVIDER_TOKEN": provider_http.token or "", "FLEETMEDIC_METRICS_PORT": "0"}

    def sinfo() -> tuple[str, str]:
        state, reason = slurm.node_state(node, timeout=3)
        return state.rstrip("*"), reason

    def slurm_down() -> bool:  # DOWN, whatever sinfo's short name (drained first, it says "drain")
        out = slurm.run("scontrol", "show", "node", node, "-o", timeout=3).stdout
        return "State=DOWN" in out

    def node_obj() -> dict[str, Any]:
        return kube.get("v1", "Node", node) or {}

    seen = {"cordoned": False, "down": False}

    def after_cordon_then(check: Callable[[], bool]) -> Callable[[], bool]:
        def condition() -> bool:
            seen["cordoned"] = seen["cordoned"] or bool(node_obj().get("spec", {}).get("unschedulable"))
            return seen["cordoned"] and check()
        return condition

    def after_down_then(check: Callable[[], bool]) -> Callable[[], bool]:
        def condition() -> bool:
            seen["down"] = seen["down"] or slurm_down()
            return seen["down"] and check()
        return condition

    conditions: dict[str, Callable[[], bool]] = {
        "slurm down": slurm_down,
        "cordoned": lambda: bool(node_obj().get("spec", {}).get("unschedulable")),
        "first pod evicted": lambda: len([p for p in kube.list("v1", "Pod")
                                          if p["spec"]["nodeName"] == node]) < 3,
        "provider asked": lambda: bool(provider_http.accepted()),
        "node ready again": lambda: bool(provider_http.accepted()) and any(
            c["type"] == "Ready" and c["status"] == "True" and c["lastTransitionTime"] > "2026-01-02"
            for c in node_obj()["status"]["conditions"]),
        "uncordoned": after_cordon_then(lambda: not node_obj().get("spec", {}).get("unschedulable")),
        "slurm resumed": after_down_then(lambda: sinfo()[1] == "none"),
        "event recorded": lambda: bool(kube.list("v1", "Event")),
    }

    # `fleetmedic worker` as its own process, so the test can SIGKILL it like a node losing power.
    worker = FleetMedicProcess(["worker"], env, tmp_path / "worker.log")
    worker.start()
    fired, stop = threading.Event(), threading.Event()
    watcher = kill_when(conditions[moment], worker, fired, stop)
    try:
        with provider_controller(kube, provider_http):
            handle = await client.start_workflow(
                "xid-recovery", NodeRunbookInput(cluster=task_queue, node=node, gpu=3, xid=79),
                id=node_workflow_id("xid-recovery", task_queue, node), task_queue=task_queue,
                result_type=RunbookStatus)
            try:
                report = await asyncio.wait_for(handle.result(), 180)
            except BaseException:
                await handle.terminate("test failed")
                raise
    finally:
        stop.set()
        watcher.join(5)
        worker.stop()

    assert fired.is_set() and worker.kills == 1, f"the worker was never killed at '{moment}'"
    assert report.outcome == "remediated", (report.decisions, (tmp_path / "worker.log").read_text()[-3000:])
    # Writes the API accepted: on a real API server a kubelet heartbeat between our read and our
    # write is a 409, and the adapter writes again on the fresh object (that retry is not a duplicate).
    writes = [r for r in kube.mutations() if r.url.path == f"/api/v1/nodes/{node}" and r.code < 300]
    cordons = [w for w in writes if (w.data or {}).get("spec", {}).get("unschedulable") is True]
    uncordons = [w for w in writes if "unschedulable" in (w.data or {}).get("spec", {})
                 and w.data["spec"]["unschedulable"] is None]
    assert len(cordons) == 1 and len(uncordons) == 1, [w.data for w in writes]
    evictions = [r.url.path for r in kube.mutations() if r.url.path.endswith("/eviction")]
    assert sorted(evictions) == ["/api/v1/namespaces/inference/pods/serve/eviction",
                                 "/api/v1/namespaces/training/pods/trainer/eviction"]
    assert len(provider_http.accepted()) == 1
    assert len(kube.list("v1", "Event")) == 1
    assert sinfo() in (("idle", "none"), ("mix", "none"), ("alloc", "none"))
    assert not node_obj()["spec"].get("unschedulable")
    # Slurm saw each write once: DRAIN, the checkpoint signal, DOWN, RESUME (to IDLE).
    log = (slurm.dir / "log" / "slurmctld.log").read_text()
    states = re.findall(rf"update_node: node {node} state set to (\w+)", log)
    assert [s for s in states if s in ("DRAINING", "DOWN", "IDLE")] == ["DRAINING", "DOWN", "IDLE"], states
    assert len(re.findall(rf"REQUEST_KILL_JOB JobId={job} ", log)) == 1
    assert any(f"job {job} runs again" in d.result for d in report.decisions), report.decisions
