"""kueue-quota-sync: the quota planner's guards (pure), and the workflow end to end on the real
Temporal dev server with the real apiserver's ResourceFlavor, ClusterQueue and Workload
objects; the Schedule the worker keeps."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
from temporalio.client import Client, WorkflowHandle

from activities.kube_client import load_api_client
from activities.kubernetes import KubernetesActivities
from activities.kueue import KueueActivities
from activities.start import RUNBOOK_TASK_TIMEOUT
from devstack import fleet
from devstack.kube_world import RealKube
from fleetmedic.ids import cluster_workflow_id
from fleetmedic.models import Approval, NodeInfo, RunbookStatus
from fleetmedic.policy import Policy
from fleetmedic.quota import Flavor, Queue, QueueShare, QuotaSlot, QuotaSyncInput, QuotaUpdate, healthy_gpus, plan
from tests.harness import quick_policy, run_activity, settings_for, worker_for
from tests.runbook_stack import Stack, save_history, status_when
from workers.schedules import ensure_quota_schedule, quota_schedule_id

H100 = {"nvidia.com/gpu.product": "H100"}
KUEUE = {"enabled": True, "interval": "1h"}

# --- the planner ------------------------------------------------------------------------------


def _node(name: str, **kwargs: Any) -> NodeInfo:
    labels = {"nvidia.com/gpu.present": "true", **H100, **kwargs.pop("labels", {})}
    return NodeInfo(name=name, ready=kwargs.pop("ready", True), labels=labels, gpu_allocatable=8, **kwargs)


def test_healthy_gpus_leave_out_notready_cordoned_held_and_degraded_nodes() -> None:
    nodes = [_node("a"), _node("b", ready=False), _node("c", unschedulable=True),
             _node("d", annotations={"fleetmedic.io/workflow": "xid-recovery/c/d"}),
             _node("e", taints=[{"key": "fleetmedic.io/degraded", "value": "nvlink", "effect": "NoSchedule"}]),
             _node("f", labels={"nvidia.com/gpu.product": "A100"})]
    kwargs: dict[str, Any] = {"gpu_node_selector": "nvidia.com/gpu.present=true",
                              "hold_annotations": ("fleetmedic.io/workflow",),
                              "degraded_taint_key": "fleetmedic.io/degraded"}
    healthy, out = healthy_gpus(Flavor(name="h100", node_labels=H100), nodes, count_degraded=False, **kwargs)
    assert healthy == 8
    assert out == ["b (not Ready)", "c (cordoned)", "d (held by a FleetMedic run)", "e (degraded (inference only))"]
    assert healthy_gpus(Flavor(name="h100", node_labels=H100), nodes, count_degraded=True, **kwargs)[0] == 16


@pytest.mark.parametrize(("share", "healthy", "current", "used", "new", "approval"), [
    (QueueShare(), 48, 64, 0, 48, False),  # a cut to what exists is never bounded
    (QueueShare(mode="share", share=0.5), 64, 64, 0, 32, False),
    (QueueShare(mode="reserve", reserve=8), 64, 64, 0, 56, False),
    (QueueShare(), 64, 32, 0, 40, False),  # raised by at most 25 % of 32 per run
    (QueueShare(), 16, 64, 40, 40, True),  # admitted workloads hold 40: no cut below without approval
    (QueueShare(), 16, 32, 40, 32, True),  # ... and never raised above the old quota for them either
])
def test_targets_and_guards(share: QueueShare, healthy: int, current: int, used: int, new: int,
                            approval: bool) -> None:
    queue = Queue(name="training", used={"h100": used} if used else {})
    slot = QuotaSlot(flavor="h100", group=0, flavor_index=0, resource_index=1, nominal=current)
    change = plan(queue, slot, healthy, share, max_change_fraction=0.25)
    assert (change.new, change.needs_approval) == (new, approval), change.reason
    assert change.new <= max(healthy, used, 0) or change.new == current


# --- the workflow ---------------------------------------------------------------------------------


def seed_kueue(kube: RealKube, nodes: list[str], quota: int) -> None:
    for name in nodes:
        node = kube.get("v1", "Node", name) or fleet.node(name)
        node["metadata"]["labels"].update(H100)
        kube.put(node)
    kube.put(fleet.resource_flavor("h100", H100))
    kube.put(fleet.cluster_queue("training", {"h100": quota}))


def quota(kube: RealKube, queue: str = "training") -> Any:
    obj = kube.get(fleet.KUEUE, "ClusterQueue", queue)
    assert obj is not None
    return obj["spec"]["resourceGroups"][0]["flavors"][0]["resources"][1]["nominalQuota"]


def wait_quota(kube: RealKube, expected: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if int(quota(kube)) == expected:
            return
        time.sleep(0.2)
    raise AssertionError(f"quota stayed {quota(kube)}, expected {expected}")


async def sync(client: Client, task_queue: str, kube: RealKube, policy: Policy, *, dry_run: bool = False,
               during: Any = None) -> RunbookStatus:
    async with worker_for(client, settings_for(task_queue, kube), policy):
        handle: WorkflowHandle[Any, RunbookStatus] = await client.start_workflow(
            "kueue-quota-sync", QuotaSyncInput(cluster=task_queue, dry_run=dry_run, requested_by="test"),
            id=cluster_workflow_id("kueue-quota-sync", task_queue), task_queue=task_queue, result_type=RunbookStatus)
        if during is not None:
            await during(handle)
        report = await asyncio.wait_for(handle.result(), 60)
        await save_history(handle)
        return report


async def test_a_node_taken_out_lowers_the_quota_and_its_return_restores_it(stack: Stack) -> None:
    nodes = list(stack.slurm.nodes)
    seed_kueue(stack.kube, nodes, 8 * len(nodes))
    policy = stack.policy(kueue={**KUEUE, "max_change_fraction": 1.0})  # one pass restores the node's 8

    async def while_out(handle: WorkflowHandle[Any, Any]) -> None:
        await status_when(handle, lambda s: s.step in ("replace", "wait for node Ready", "validate"))
        await asyncio.to_thread(wait_quota, stack.kube, 8 * (len(nodes) - 1))

    report, _ = await stack.run(nodes[1], policy=policy, during=while_out, replace_s=4)
    assert report.outcome == "remediated"
    assert any("Kueue quota sync asked" in d.result for d in report.decisions)
    # The return asked for a sync too; a worker picks it up (the runbook's worker is gone by now).
    async with worker_for(stack.client, settings_for(stack.task_queue, stack.kube), policy):
        await asyncio.to_thread(wait_quota, stack.kube, 8 * len(nodes))
        # The sync records its Event in the step after the quota's write: wait for it with the worker up.
        deadline = asyncio.get_running_loop().time() + 30
        while len(events := [e for e in stack.kube.list("v1", "Event")
                             if e["reason"] == "FleetMedicQuotaSynced"]) < 2:
            assert asyncio.get_running_loop().time() < deadline, events
            await asyncio.sleep(0.2)
    assert {e["involvedObject"]["kind"] for e in events} == {"ClusterQueue"}
    assert {e["message"].split(":")[0] for e in events} == {"GPU quota h100 24 → 16", "GPU quota h100 16 → 24"}
    assert any("Kueue quota of `training`" in m["text"] for m in stack.slack.messages)


async def test_admitted_workloads_above_the_target_hold_the_cut_until_approved(client: Client, task_queue: str,
                                                                                 kube: RealKube,
                                                                                 tmp_path: Path) -> None:
    seed_kueue(kube, ["g1", "g2", "g3"], 24)
    for name in ("g2", "g3"):
        node = kube.get("v1", "Node", name)
        assert node is not None
        node["spec"]["unschedulable"] = True
        kube.put(node)
    kube.put(fleet.workload("pretrain", "training", "h100", 16))
    kube.put(fleet.workload("waiting", "training", "h100", 64, admitted=False))

    held = await sync(client, task_queue, kube, quick_policy(tmp_path, kueue=KUEUE))
    assert held.outcome == "held" and int(quota(kube)) == 16
    assert any("24 → 16 GPUs" in d.result and "admitted workloads use 16" in d.result for d in held.decisions)
    assert any("held at 16: cutting training/h100 to 8 (admitted workloads use 16) needs approval" in d.result
               for d in held.decisions)

    async def approve(handle: WorkflowHandle[Any, Any]) -> None:
        await status_when(handle, lambda s: s.awaiting_approval == "quota_cut")
        await handle.execute_update("approve", Approval(by="dana", reason="pretrain is being preempted"))

    approving = quick_policy(tmp_path, kueue=KUEUE, approvals={"steps": ["quota_cut"]})
    approved = await sync(client, task_queue, kube, approving, during=approve)
    assert approved.outcome == "synced" and int(quota(kube)) == 8
    assert any(d.result == "quota cut approved by dana: pretrain is being preempted" for d in approved.decisions)


async def test_dry_run_reports_the_diff_and_changes_nothing(client: Client, task_queue: str,
                                                            kube: RealKube, tmp_path: Path) -> None:
    seed_kueue(kube, ["g1", "g2"], 64)
    report = await sync(client, task_queue, kube, quick_policy(tmp_path, kueue=KUEUE), dry_run=True)
    assert int(quota(kube)) == 64
    assert [r for r in kube.mutations()] == []
    assert any(d.step == "compare" and d.result.startswith("training/h100: 64 → 16 GPUs") for d in report.decisions)
    assert "would set quota ClusterQueue training: h100 16" in report.actions


async def test_kueue_not_installed_is_nothing_to_sync(client: Client, task_queue: str, kube: RealKube,
                                                      tmp_path: Path) -> None:
    kube.inject("GET", "resourceflavors", status=404, times=1)
    report = await sync(client, task_queue, kube, quick_policy(tmp_path, kueue=KUEUE))
    assert report.outcome == "in-sync"
    assert any("Kueue is not installed" in d.result for d in report.decisions)


def test_a_conflict_is_retried_on_the_fresh_object(kube: RealKube, tmp_path: Path) -> None:
    seed_kueue(kube, ["g1"], 64)
    conflict = kube.inject("PUT", "clusterqueues", status=409, times=1)
    k8s = KubernetesActivities(lambda: load_api_client(str(kube.kubeconfig)),  # type: ignore[attr-defined]
                               quick_policy(tmp_path))
    slot = QuotaSlot(flavor="h100", group=0, flavor_index=0, resource_index=1, nominal=8)
    result = run_activity(KueueActivities(k8s).set_quota, QuotaUpdate(queue="training", slots=[slot]))
    assert result.changed and int(quota(kube)) == 8
    # The first PUT met the 409 (answered by the fault proxy), the second reached the API server.
    assert conflict.times == 0
    puts = [r for r in kube.mutations() if r.method.value == "PUT"]
    assert len(puts) == 1 and puts[0].code == 200
    # Only the GPU quota changed: the cpu quota and the rest of the queue are as they were.
    queue = kube.get(fleet.KUEUE, "ClusterQueue", "training")
    assert queue is not None and queue["spec"]["resourceGroups"][0]["flavors"][0]["resources"][0] == {
        "name": "cpu", "nominalQuota": "512"}


async def test_the_schedule_exists_after_the_worker_starts_runs_and_pausing_stops_it(
        client: Client, task_queue: str, kube: RealKube, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    from workers.worker import run_worker

    seed_kueue(kube, ["g1"], 8)
    monkeypatch.setenv("TEMPORAL_ADDRESS", client.service_client.config.target_host)
    policy = quick_policy(tmp_path, kueue={"enabled": True, "interval": "2s"})
    settings = settings_for(task_queue, kube, cluster=task_queue)
    stop = asyncio.Event()
    worker = asyncio.create_task(run_worker(settings, policy, stop=stop))
    handle = client.get_schedule_handle(quota_schedule_id(task_queue))

    async def runs() -> int:
        return (await client.count_workflows(f'WorkflowType = "kueue-quota-sync" AND FleetCluster = "{task_queue}"'
                                             )).count

    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                description = await handle.describe()
                if len(description.info.recent_actions) >= 2:
                    break
            except Exception:
                pass
            await asyncio.sleep(0.5)
        else:
            raise AssertionError("the schedule did not run twice")
        assert description.schedule.spec.intervals[0].every.total_seconds() == 2
        await handle.pause(note="maintenance: quotas by hand")
        await asyncio.sleep(1)
        paused_at = len((await handle.describe()).info.recent_actions)
        # A worker restart keeps the operator's pause.
        await ensure_quota_schedule(client, settings, policy)
        await asyncio.sleep(5)
        description = await handle.describe()
        assert description.schedule.state.paused
        assert len(description.info.recent_actions) == paused_at
        assert await runs() >= 2
        async for run in client.list_workflows(f'WorkflowType = "kueue-quota-sync" AND FleetCluster = "{task_queue}"'):
            history = await client.get_workflow_handle(run.id, run_id=run.run_id).fetch_history()
            started = history.events[0].workflow_execution_started_event_attributes
            assert started.workflow_task_timeout.ToTimedelta() == RUNBOOK_TASK_TIMEOUT  # as every runbook's
    finally:
        stop.set()
        await asyncio.wait_for(worker, 60)
        await handle.delete()
