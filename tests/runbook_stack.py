"""A node runbook under test: real Temporal, real Slurm, the real Kubernetes control plane, stand-ins for
Slack, the provider and the node agent. Shared by every node runbook's tests."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from temporalio.client import Client, WorkflowHandle
from temporalio.service import RPCError

from devstack import fleet
from devstack.controllers import provider_controller
from devstack.kube_world import RealKube
from devstack.slurm_cluster import LocalSlurmCluster
from devstack.standins import AgentStandIn, ProviderStandIn, SlackStandIn
from fleetmedic.ids import node_workflow_id
from fleetmedic.models import NodeRunbookInput, RunbookStatus
from fleetmedic.policy import Policy
from tests.alerts import post, replica
from tests.harness import own_taints, quick_policy, settings_for, worker_for

# What each node runbook needs in its input to take the remediation path.
START = {
    "xid-recovery": {"xid": 79, "gpu": 3},
    "hot-gpu-pull": {"gpu": 3, "temperature_c": 84.0},
    "nvlink-fault-replace": {"gpu": 3},
}


@dataclass
class Stack:
    client: Client
    task_queue: str
    kube: RealKube
    slurm: LocalSlurmCluster
    slack: SlackStandIn
    provider: ProviderStandIn
    tmp_path: Path

    @property
    def cluster(self) -> str:
        return self.task_queue  # one cluster per test: workflow IDs never collide across tests

    def policy(self, **overrides: Any) -> Policy:
        return quick_policy(self.tmp_path, provider={"kind": "http", "http": {"url": self.provider.url}},
                            **overrides)

    def seed(self) -> None:
        for name in self.slurm.nodes:
            self.kube.put(fleet.node(name))
            self.kube.put(fleet.pod(f"trainer-{name}", name, namespace="training", owner_kind="Job",
                                             labels={"app": "trainer"}, gpus=8))
            self.kube.put(fleet.pod(f"serve-{name}", name, namespace="inference",
                                             labels={"app": "serve", "fleetmedic.io/workload": "inference"}))
            self.kube.put(fleet.pod(f"dcgm-{name}", name, namespace="gpu-operator", owner_kind="DaemonSet"))
        # Another replica elsewhere keeps the PDB satisfiable: one eviction at a time is allowed. Its
        # node exists (not a GPU node): the controller-manager's pod GC deletes pods bound to a node
        # that does not, 40 s after it sees them — a slow run then found the replica gone.
        self.kube.put(fleet.node("cpu-node", gpus=0, labels={fleet.GPU_LABEL: "false"}))
        self.kube.put(fleet.pod("serve-elsewhere", "cpu-node", namespace="inference",
                                         labels={"app": "serve"}))
        self.kube.put(fleet.pdb("serve", namespace="inference", match_labels={"app": "serve"},
                                         min_available=1))

    def start_input(self, runbook: str, node: str, **overrides: Any) -> NodeRunbookInput:
        return NodeRunbookInput.model_validate({**START[runbook], **overrides, "cluster": self.cluster,
                                                "node": node})

    async def run(self, node: str, xid: int | None = None, gpu: int | None = None, *, runbook: str = "xid-recovery",
                  policy: Policy | None = None, controller: bool = True, replace_s: float = 1.0,
                  dry_run: bool = False, timeout: float = 120, during: Any = None, agent: AgentStandIn | None = None,
                  worker: dict[str, Any] | None = None, alerts: Sequence[dict[str, Any]] = (),
                  **start: Any) -> tuple[RunbookStatus, WorkflowHandle[Any, RunbookStatus]]:
        """`worker`: the worker's settings beside the stack's (`workflow_cache`, ...). `alerts`: the
        run is started by Alertmanager's notification of these to the webhook, before the worker
        runs (the first starts the run, the others attach to it), not by a start of its own."""
        extra = {"agent_url": agent.url_template, "agent_token": agent.token} if agent else {}
        extra.update(worker or {})
        settings = settings_for(self.task_queue, self.kube, slurm=self.slurm, slack=self.slack, provider=self.provider,
                                **extra)
        replacing: AbstractContextManager[Any] = (provider_controller(self.kube, self.provider, replace_s) if controller
                                                  else nullcontext())
        start.update({k: v for k, v in (("xid", xid), ("gpu", gpu)) if v is not None})
        with replacing:
            notified = await self.notify(*alerts) if alerts else None
            async with worker_for(self.client, settings, policy or self.policy()):
                handle = notified or await self.client.start_workflow(
                    runbook, self.start_input(runbook, node, dry_run=dry_run, **start),
                    id=node_workflow_id(runbook, self.cluster, node), task_queue=self.task_queue,
                    result_type=RunbookStatus)
                try:
                    if during is not None:
                        await during(handle)
                    report = await asyncio.wait_for(handle.result(), timeout)
                    await save_history(handle)
                except BaseException:
                    status = await handle.query("status", result_type=RunbookStatus)
                    print(f"run left at {status.step}, waiting for {status.waiting_for}: {status.decisions}")
                    await handle.terminate("test failed")  # never leave a run behind for the next test
                    raise
        return report, handle

    async def notify(self, *alerts: dict[str, Any]) -> WorkflowHandle[Any, RunbookStatus]:
        """One Alertmanager notification of `alerts` to a webhook replica of this cluster; the run
        the first started (each other alert was answered attached to it)."""
        async with replica(self.client, self.task_queue) as (_, http):  # the cluster is named after the queue
            answers = await post(http, *alerts)
        assert [a["action"] for a in answers] == ["started"] + ["attached"] * (len(alerts) - 1), answers
        return self.client.get_workflow_handle(answers[0]["workflow_id"], result_type=RunbookStatus)

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        return fleetmedic_cli(self.client, self.task_queue, self.cluster, *args)

    def slurm_state(self, node: str) -> tuple[str, str]:
        state, reason = self.slurm.node_state(node)
        return state.rstrip("*"), reason

    def node(self, name: str) -> dict[str, Any]:
        obj = self.kube.get("v1", "Node", name)
        assert obj is not None
        return obj

    def taints(self, name: str) -> list[dict[str, Any]]:
        """The node's taints less the node lifecycle controller's."""
        return own_taints(self.node(name))

    def node_writes(self, name: str) -> list[Any]:
        return [r for r in self.kube.mutations() if r.url.path == f"/api/v1/nodes/{name}"]

    def evicted(self) -> list[str]:
        """namespace/name of every pod an eviction was asked for."""
        paths = [r.url.path.split("/") for r in self.kube.mutations() if r.url.path.endswith("/eviction")]
        return sorted(f"{p[p.index('namespaces') + 1]}/{p[p.index('pods') + 1]}" for p in paths)


def fleetmedic_cli(client: Client, task_queue: str, cluster: str, *args: str) -> subprocess.CompletedProcess[str]:
    """`fleetmedic <args>` as an operator's terminal runs it, against this Temporal, task queue and
    cluster."""
    env = {"PATH": "/usr/bin:/bin", "FLEETMEDIC_TASK_QUEUE": task_queue, "FLEETMEDIC_CLUSTER": cluster}
    return subprocess.run([sys.executable, "-m", "workers.cli", *args, "--address",
                           client.service_client.config.target_host, "--namespace", client.namespace], env=env,
                          capture_output=True, text=True, timeout=120)


async def save_history(handle: WorkflowHandle[Any, Any], name: str | None = None) -> None:
    """FLEETMEDIC_SAVE_HISTORIES=dir keeps each finished run's history for the replay tests, under
    `name` (a scenario's), else the test's name."""
    target = os.environ.get("FLEETMEDIC_SAVE_HISTORIES")
    if target:
        history = await handle.fetch_history()
        name = name or os.environ.get("PYTEST_CURRENT_TEST", "run").split("::")[-1].split(" ")[0]
        Path(target, f"{name}.json").write_text(history.to_json())


def wait_for(predicate: Any, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError("condition not met in time")


async def status_when(handle: WorkflowHandle[Any, Any], predicate: Any, timeout: float = 60, *,
                      worker_swapped: bool = False) -> RunbookStatus:
    """The run's status once `predicate` holds. `worker_swapped`: the run's worker was just replaced,
    and a query can go to the dead one's sticky queue and come back cancelled before the server hands
    the run to the new one: ask again (each query then has 20 s)."""
    deadline = time.monotonic() + timeout
    status = None
    while time.monotonic() < deadline:
        try:
            status = await handle.query("status", result_type=RunbookStatus,
                                        rpc_timeout=timedelta(seconds=20) if worker_swapped else None)
        except RPCError:
            if not worker_swapped:
                raise
            await asyncio.sleep(0.5)
            continue
        if predicate(status):
            return status
        await asyncio.sleep(0.3)
    raise AssertionError(f"{handle.id}: status never matched: {status}")
