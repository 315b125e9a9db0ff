"""xid-recovery end to end: real Temporal dev server, real Slurm, the Kubernetes emulator."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

from temporalio.client import Client, WorkflowHandle

from fleetmedic.ids import node_workflow_id
from fleetmedic.models import NodeRunbookInput, RunbookStatus
from tests.harness import CHECKPOINTING_JOB, job_on, provider_controller, quick_policy, settings_for, worker_for
from workers.devstack import fleet
from workers.devstack.kube_emulator import KubeEmulatorThread
from workers.devstack.slurm_cluster import LocalSlurmCluster
from workers.devstack.standins import ProviderStandIn, SlackStandIn


def seed_node(kube: KubeEmulatorThread, name: str) -> None:
    kube.emulator.put(fleet.node(name))
    kube.emulator.put(fleet.pod(f"trainer-{name}", name, namespace="training", owner_kind="Job",
                                labels={"app": "trainer"}, gpus=8))
    kube.emulator.put(fleet.pod(f"serve-{name}", name, namespace="inference", labels={"app": "serve"}))
    kube.emulator.put(fleet.pod(f"serve-other-{name}", "elsewhere", namespace="inference", labels={"app": "serve"}))
    kube.emulator.put(fleet.pdb("serve", namespace="inference", match_labels={"app": "serve"}, min_available=1))
    kube.emulator.put(fleet.pod(f"dcgm-{name}", name, namespace="gpu-operator", owner_kind="DaemonSet"))


async def test_xid79_replaces_node_and_job_resumes(client: Client, task_queue: str, kube: KubeEmulatorThread,
                                                  slurm: LocalSlurmCluster, slack: SlackStandIn,
                                                  provider_http: ProviderStandIn, tmp_path: Path) -> None:
    policy = quick_policy(tmp_path, provider={"kind": "http", "http": {"url": provider_http.url}})
    job = slurm.submit(CHECKPOINTING_JOB.format(root=policy.storage.root))
    node = job_on(slurm, job)
    for name in slurm.nodes:
        seed_node(kube, name)
    settings = settings_for(task_queue, kube, slurm=slurm, slack=slack, provider=provider_http)
    workflow_id = node_workflow_id("xid-recovery", "test", node)
    with provider_controller(kube, provider_http):
        async with worker_for(client, settings, policy):
            handle: WorkflowHandle = await client.start_workflow(
                "xid-recovery", NodeRunbookInput(cluster="test", node=node, gpu=3, xid=79), id=workflow_id,
                task_queue=task_queue, result_type=RunbookStatus)
            report = await asyncio.wait_for(handle.result(), 120)
    assert report.outcome == "remediated", report
    from workers.audit import render_markdown, timeline
    print(render_markdown(timeline(client, await handle.fetch_history())))
    log = (Path(policy.storage.root) / f"{job}.log").read_text()
    assert "sigterm" in log
    assert log.count("start ") == 2, log
    assert len(provider_http.accepted()) == 1
    state = slurm.run("sinfo", "-h", "-n", node, "-o", "%t").stdout.strip()
    assert state == "idle" or state == "mix" or state == "alloc", state
    assert uuid
