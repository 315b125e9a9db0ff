"""nvlink-fault-replace end to end: real Temporal dev server, real Slurm, the real Kubernetes control plane."""

from __future__ import annotations

from typing import Any

from temporalio.client import WorkflowHandle

from tests.runbook_stack import Stack, status_when

DEGRADED = {"key": "fleetmedic.io/degraded", "value": "nvlink", "effect": "NoSchedule"}


async def test_kept_for_inference_training_leaves_inference_stays_then_the_node_returns(stack: Stack) -> None:
    node = "gpu-node-1"
    seen: dict[str, Any] = {}

    async def while_replaced(handle: WorkflowHandle[Any, Any]) -> None:
        # Before the replacement lands: out of training, still serving inference.
        await status_when(handle, lambda s: s.step in ("replace", "wait for node Ready"))
        seen["taints"] = stack.taints(node)
        seen["unschedulable"] = stack.node(node)["spec"].get("unschedulable")
        seen["slurm"] = stack.slurm_state(node)[1], stack.slurm.node_states(node)
        seen["serve"] = stack.kube.get("v1", "Pod", f"serve-{node}", "inference")

    report, _ = await stack.run(node, runbook="nvlink-fault-replace", during=while_replaced, replace_s=4)
    assert report.outcome == "remediated", report.decisions
    assert seen["taints"] == [DEGRADED] and not seen["unschedulable"]
    assert "DOWN" in seen["slurm"][1] and seen["slurm"][0].startswith("fleetmedic: NVLink errors on GPU 3")
    assert seen["serve"] is not None
    assert stack.evicted() == [f"training/trainer-{node}"]
    assert stack.kube.get("v1", "Pod", f"serve-{node}", "inference") is not None
    # After replacement and validation: the taint is gone, the hold released, Slurm RESUMEd.
    after = stack.node(node)
    assert not stack.taints(node) and not after["spec"].get("unschedulable")
    assert "fleetmedic.io/workflow" not in after["metadata"].get("annotations", {})
    assert stack.slurm_state(node)[1] == "none" and stack.slurm_state(node)[0] != "down"
    assert [(r["node"], r["action"]) for r in stack.provider.accepted()] == [(node, "replace")]


async def test_without_inference_the_node_is_drained_fully_and_replaced(stack: Stack) -> None:
    node = "gpu-node-2"
    policy = stack.policy(nvlink={"keep_serving_inference": False})
    report, _ = await stack.run(node, runbook="nvlink-fault-replace", policy=policy)
    assert report.outcome == "remediated", report.decisions
    assert stack.evicted() == sorted([f"inference/serve-{node}", f"training/trainer-{node}"])
    assert any(d.result.startswith(f"cordon node {node}") for d in report.decisions)
    assert not stack.taints(node)
    assert [(r["node"], r["action"]) for r in stack.provider.accepted()] == [(node, "replace")]


async def test_replacement_waits_for_approval_when_policy_asks(stack: Stack) -> None:
    from fleetmedic.models import Approval

    async def approve(handle: WorkflowHandle[Any, Any]) -> None:
        await status_when(handle, lambda s: s.awaiting_approval == "replace")
        assert stack.provider.requests == []
        assert stack.taints("gpu-node-0") == [DEGRADED]  # quarantined meanwhile
        await handle.execute_update("approve", Approval(by="erin"))

    report, _ = await stack.run("gpu-node-0", runbook="nvlink-fault-replace", during=approve,
                                policy=stack.policy(approvals={"steps": ["replace"]}))
    assert report.outcome == "remediated"


async def test_xid_74_is_an_nvlink_fault(stack: Stack) -> None:
    report, _ = await stack.run("gpu-node-0", runbook="nvlink-fault-replace", xid=74, dry_run=True)
    assert report.outcome == "dry-run" and "would have ended remediated" in report.decisions[-1].result
    assert any("XID 74 (NVLink) on GPU 3" in d.result for d in report.decisions)
