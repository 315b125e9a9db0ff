"""What every node runbook does the same way, because they share the steps: opt-out, dry-run,
pause and duplicate alerts. Each test runs xid-recovery, hot-gpu-pull and nvlink-fault-replace."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest
from temporalio.client import WorkflowHandle
from temporalio.common import WorkflowIDConflictPolicy

from devstack import fleet
from fleetmedic.models import Alert
from tests.runbook_stack import START, Stack, status_when
from workers.audit import render_markdown, timeline

RUNBOOKS = pytest.mark.parametrize("runbook", sorted(START))


@RUNBOOKS
async def test_opt_out_pod_stops_every_destructive_step(stack: Stack, runbook: str) -> None:
    stack.kube.put(fleet.pod("precious", "gpu-node-1", labels={"fleetmedic.io/remediation": "disabled"}))
    report, _ = await stack.run("gpu-node-1", runbook=runbook)
    assert report.outcome == "opted-out"
    assert any(d.step == "record outcome" and "pod default/precious has fleetmedic.io/remediation=disabled"
               in d.result for d in report.decisions)
    assert stack.node_writes("gpu-node-1") == []
    assert stack.slurm_state("gpu-node-1")[0] == "idle"
    assert stack.provider.requests == []


@RUNBOOKS
async def test_dry_run_changes_nothing_and_the_audit_says_what_would_happen(stack: Stack, runbook: str) -> None:
    policy = stack.policy(notify={"shadow_channel": "#fleet-shadow"})
    report, handle = await stack.run("gpu-node-0", runbook=runbook, dry_run=True, policy=policy)
    assert report.outcome == "dry-run" and report.dry_run
    assert report.decisions[-1].result.startswith("dry-run: would have ended remediated")
    assert stack.kube.mutations() == []
    assert stack.provider.requests == []
    assert stack.slurm_state("gpu-node-0") == ("idle", "none")
    audit = render_markdown(timeline(stack.client, await handle.fetch_history()))
    assert "shadow mode: nothing was changed" in audit
    held = "would add taint fleetmedic.io/degraded=nvlink:NoSchedule" if runbook == "nvlink-fault-replace" \
        else "would cordon node gpu-node-0"
    evicted = "would evict 1 pod(s)" if runbook == "nvlink-fault-replace" else "would evict 2 pod(s)"
    for line in ("would set DOWN Slurm node gpu-node-0", held, evicted,
                 "would ask http to replace node gpu-node-0", "would uncordon node gpu-node-0"):
        assert line in audit, line
    # The thread is in the shadow channel, never the live one, and mentions nobody.
    assert {m["channel"] for m in stack.slack.messages} == {"#fleet-shadow"}
    assert "shadow mode" in stack.slack.messages[0]["text"]
    assert not any("@oncall" in m["text"] for m in stack.slack.messages)


@RUNBOOKS
async def test_pause_holds_the_next_destructive_step(stack: Stack, runbook: str) -> None:
    async def pause_then_resume(handle: WorkflowHandle[Any, Any]) -> None:
        await handle.signal("pause", {"by": "carol", "reason": "maintenance window"})
        status = await status_when(handle, lambda s: s.waiting_for is not None and "resume" in s.waiting_for)
        assert status.paused is not None and status.paused.by == "carol"
        assert stack.provider.requests == []
        await handle.signal("resume", {"by": "carol"})

    report, _ = await stack.run("gpu-node-2", runbook=runbook, during=pause_then_resume)
    assert report.outcome == "remediated"
    assert len(stack.provider.accepted()) == 1


@RUNBOOKS
async def test_duplicate_alert_attaches_to_the_running_workflow(stack: Stack, runbook: str) -> None:
    alert = Alert(status="firing", labels={"alertname": "Duplicate", "node": "gpu-node-0", "xid": "79", "gpu": "3"},
                  fingerprint="abc", startsAt=datetime.now(UTC))

    async def second_alert(handle: WorkflowHandle[Any, Any]) -> None:
        again = await stack.client.start_workflow(
            runbook, stack.start_input(runbook, "gpu-node-0", alert=alert), id=handle.id, task_queue=stack.task_queue,
            id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING, start_signal="alert", start_signal_args=[alert])
        assert again.result_run_id == handle.result_run_id
        await status_when(handle, lambda s: True)

    report, handle = await stack.run("gpu-node-0", runbook=runbook, during=second_alert)
    assert report.outcome == "remediated"
    runs = [w async for w in stack.client.list_workflows(f'WorkflowId = "{handle.id}"')]
    assert len(runs) == 1
    assert len(stack.provider.accepted()) == 1
