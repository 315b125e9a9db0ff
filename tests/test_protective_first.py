"""Protective first (DESIGN.md): a bad node is cordoned and set DRAIN in Slurm right after one read
of it, before the disruption lease — and nothing that kills work (DOWN, the checkpoint signal,
requeue, eviction, replacement) happens until the lease comes. Observed from the outside: the API
server, slurmctld, the job's own log."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from temporalio.client import WorkflowHandle

from activities.breaker import GuardView
from activities.start import start_or_attach
from fleetmedic.ids import guard_workflow_id, node_workflow_id
from fleetmedic.models import GuardState, Operator, RunbookStatus
from tests.gate_check import assert_gated
from tests.harness import CHECKPOINTING_JOB, job_on, settings_for, worker_for
from tests.runbook_stack import Stack, status_when
from tests.test_hot_gpu_pull import hot_agent
from workflows.node_base import RECHECK_AFTER


async def test_a_paused_fleet_takes_nothing_out_and_kills_nothing_until_it_resumes(stack: Stack) -> None:
    """An operator who says stop means stop: a run that starts while the fleet is paused records its
    alert and waits — not even the protective step cordons or DRAINs (0.2.0; 0.1.0 cordoned) — and
    after the resume it takes the node out under its lease and goes the whole way."""
    policy = stack.policy()
    job = stack.slurm.submit(CHECKPOINTING_JOB.format(root=policy.storage.root))
    node = job_on(stack.slurm, job)
    # An operator froze the fleet: no lease, no cordon, no destructive step anywhere. The freeze is
    # in force once the guard has recorded it in its memo, where every worker reads it (a worker
    # runs the guard meanwhile: the run's own worker would race its first step against it).
    settings = settings_for(stack.task_queue, stack.kube, slurm=stack.slurm, slack=stack.slack, provider=stack.provider)
    async with worker_for(stack.client, settings, policy):
        guard = await start_or_attach(stack.client, "fleet-guard", GuardState(cluster=stack.cluster),
                                      workflow_id=guard_workflow_id(stack.cluster), task_queue=stack.task_queue,
                                      signal="pause", signal_args=[Operator(by="dana", reason="change freeze")])
        async def recorded() -> None:
            while GuardView.from_memo(await (await guard.describe()).memo()).paused is None:
                await asyncio.sleep(0.1)

        await asyncio.wait_for(recorded(), 30)

    async def while_paused(handle: WorkflowHandle[Any, RunbookStatus]) -> None:
        status = await status_when(handle, lambda s: s.step == "take disruption lease"
                                   and "paused by dana" in (s.waiting_for or ""))
        assert any(d.step == "protect" and d.result.startswith("nothing cordoned ahead of the lease: fleet paused "
                                                               "by dana") for d in status.decisions), status.decisions
        await asyncio.sleep(2)  # and it stays so while the run waits
        # Nothing written: not cordoned in the API, not DRAINed in Slurm, the job runs on, never signalled.
        assert stack.node_writes(node) == [] and not stack.node(node)["spec"].get("unschedulable")
        state, reason = stack.slurm_state(node)
        assert state in ("alloc", "mix") and reason == "none", (state, reason)  # not DRAIN
        assert stack.slurm.run("squeue", "-h", "-j", str(job), "-o", "%T").stdout.strip() == "RUNNING"
        log = (Path(policy.storage.root) / f"{job}.log").read_text()
        assert "sigterm" not in log and len(log.splitlines()) == 1
        assert stack.evicted() == [] and stack.provider.accepted() == []
        await guard.signal("resume", Operator(by="dana"))

    report, handle = await stack.run(node, policy=policy, during=while_paused, replace_s=2)
    assert report.outcome == "remediated", report.decisions
    # After the pause the run went the whole way: signal, checkpoint, DOWN, requeue, drain, back.
    log = (Path(policy.storage.root) / f"{job}.log").read_text().splitlines()
    assert log[1].startswith("sigterm") and "restarts=1" in log[2]
    assert not stack.node(node)["spec"].get("unschedulable")
    # Every destructive call still passed the gate of its own step, after the lease.
    assert {"slurm.set_node_state", "slurm.signal_job", "k8s.evict_pods", "provider.request"} <= assert_gated(
        await handle.fetch_history())


async def test_a_job_its_xid_killed_restarts_before_the_lease_within_the_storm_limit(stack: Stack) -> None:
    """XID 79 has killed the job on the GPU already (catalog `job_lost`): the node goes DOWN and the
    job is requeued while its run still waits in line for a lease — for one node a minute (the
    policy's storm limit here); the next such node keeps its job running until its own lease."""
    policy = stack.policy(budget={"max_protective_kills_per_minute": 1})
    root = policy.storage.root
    job_a = stack.slurm.submit(CHECKPOINTING_JOB.format(root=root), "-w", "gpu-node-0")
    job_b = stack.slurm.submit(CHECKPOINTING_JOB.format(root=root), "-w", "gpu-node-1")
    assert job_on(stack.slurm, job_a) == "gpu-node-0" and job_on(stack.slurm, job_b) == "gpu-node-1"
    settings = settings_for(stack.task_queue, stack.kube, slurm=stack.slurm, slack=stack.slack, provider=stack.provider)

    async def start(node: str) -> WorkflowHandle[Any, RunbookStatus]:
        return await stack.client.start_workflow(
            "xid-recovery", stack.start_input("xid-recovery", node), id=node_workflow_id("xid-recovery", stack.cluster,
                                                                                         node),
            task_queue=stack.task_queue, result_type=RunbookStatus)

    def in_line_after(decision: str) -> Any:
        return lambda s: s.step == "take disruption lease" and any(decision in d.result for d in s.decisions)

    async with worker_for(stack.client, settings, policy):
        # 3 GPU nodes, 10 % at most out: one lease, which this run keeps while its node is replaced.
        holder = await start("gpu-node-2")
        await status_when(holder, lambda s: s.step in ("replace", "wait for node Ready"))
        first = await start("gpu-node-0")
        second: WorkflowHandle[Any, RunbookStatus] | None = None
        try:
            await status_when(first, in_line_after("requeued before the lease"))
            # From Slurm: node DOWN, the job requeued (restarted once), while its run is still in line.
            assert "DOWN" in stack.slurm.node_states("gpu-node-0")
            shown = stack.slurm.run("scontrol", "show", "job", str(job_a)).stdout
            assert "Restarts=1" in shown and "JobState=RUNNING" not in shown, shown
            # The storm limit: the second node only stops taking work; its job runs on, never signalled.
            second = await start("gpu-node-1")
            await status_when(second, in_line_after("not before the lease: 1 protective kill(s) in the last minute"))
            assert stack.slurm.node_states("gpu-node-1") >= {"DRAIN"} and "DOWN" not in stack.slurm.node_states(
                "gpu-node-1")
            assert stack.slurm.run("squeue", "-h", "-j", str(job_b), "-o", "%T").stdout.strip() == "RUNNING"
            assert "sigterm" not in (Path(root) / f"{job_b}.log").read_text()
            # The kill before the lease passed the gate of a destructive step all the same.
            assert "slurm.set_node_state" in assert_gated(await first.fetch_history())
        finally:
            for handle in (holder, first, second):
                if handle is not None:
                    await handle.terminate("test over")


async def test_a_fault_gone_while_in_line_takes_the_protective_step_back(stack: Stack) -> None:
    """A hot GPU: its node is cordoned and DRAINed at once, then waits in line (the budget is in use:
    another node is out of service) for more than a minute, and cools down meanwhile. When the lease
    comes, the run confirms the fault again (it is older than a minute), finds nothing to do, and
    gives the node back: uncordoned, Slurm RESUMEd, nothing evicted or replaced."""
    node = "gpu-node-1"
    # Someone else's node out of service fills the budget (max_unavailable_fraction of 3 GPU nodes: 1).
    stack.kube.put({**stack.node("gpu-node-0"), "spec": {**stack.node("gpu-node-0")["spec"], "unschedulable": True}})
    with hot_agent() as agent:
        async def cools_while_in_line(handle: WorkflowHandle[Any, RunbookStatus]) -> None:
            await status_when(handle, lambda s: s.step == "take disruption lease"
                              and "budget in use" in (s.waiting_for or ""))
            assert stack.node(node)["spec"].get("unschedulable") is True
            assert stack.slurm_state(node)[1].startswith("fleetmedic: GPU 3 hot")
            agent.temperatures[3] = 55.0
            await asyncio.sleep(RECHECK_AFTER.total_seconds() + 2)  # the confirmation is now stale
            other = stack.node("gpu-node-0")
            stack.kube.put({**other, "spec": {**other["spec"], "unschedulable": False}})  # the budget frees up

        report, _ = await stack.run(node, runbook="hot-gpu-pull", agent=agent, during=cools_while_in_line,
                                    timeout=120)
    assert report.outcome == "recovered", report.decisions
    assert not stack.node(node)["spec"].get("unschedulable")
    assert "fleetmedic.io/workflow" not in stack.node(node)["metadata"].get("annotations", {})
    assert stack.slurm_state(node) == ("idle", "none")
    assert stack.evicted() == [] and stack.provider.requests == []


async def test_the_protective_step_reads_the_opt_outs_from_the_api_servers_cache_and_destructive_steps_consistently(
        stack: Stack) -> None:
    """Counted in the API server's audit log. The protective step lists the opted-out pods with
    `resourceVersion=0`: its watch cache, at once. Without it the list is a consistent read, which
    waited 70-95 ms for the cache to catch up with etcd in two of three of bench/xid_latency's
    one-at-a-time alerts, between the node's read and its cordon. Every later list of them, the
    opt-out check before each destructive step, stays a consistent read."""
    report, _ = await stack.run("gpu-node-0")
    assert report.outcome == "remediated", report.decisions
    requests = stack.kube.requests(("worker",))
    cordon = next(i for i, r in enumerate(requests) if r.verb == "patch" and r.url.path == "/api/v1/nodes/gpu-node-0"
                  and "unschedulable" in json.dumps(r.data))
    lists = [(i, r.params.get("resourceVersion")) for i, r in enumerate(requests)
             if r.verb == "list" and r.url.path == "/api/v1/pods"
             and r.params.get("labelSelector") == "fleetmedic.io/remediation=disabled"]
    assert [version for i, version in lists if i < cordon] == ["0"], lists
    later = [version for i, version in lists if i > cordon]
    assert later and all(version is None for version in later), lists
