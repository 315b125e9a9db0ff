"""xid-recovery end to end: real Temporal dev server, real Slurm, the real Kubernetes control plane, stand-ins."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from temporalio.client import Client, WorkflowHandle
from temporalio.exceptions import CancelledError

from devstack import fleet
from devstack.kube_world import RealKube
from devstack.standins import AgentStandIn, ProviderStandIn
from fleetmedic.ids import node_workflow_id
from fleetmedic.lemon import remediations, with_remediation
from fleetmedic.models import Alert, EscalationAnswer, NodeRunbookInput, RunbookStatus
from tests.gate_check import cancels_requested, scheduled_events
from tests.gate_check import scheduled as called
from tests.harness import CHECKPOINTING_JOB, job_on, quick_policy, settings_for, until_quiet, worker_for
from tests.runbook_stack import Stack, status_when
from workers.audit import local_activity, render_markdown, timeline
from workflows import runbook


@pytest.mark.temporal_production
async def test_xid79_replaces_the_node_and_the_job_resumes(stack: Stack) -> None:
    policy = stack.policy()
    job = stack.slurm.submit(CHECKPOINTING_JOB.format(root=policy.storage.root))
    node = job_on(stack.slurm, job)
    # The replacement takes longer than Slurm needs to restart the job: it must move to another node.
    report, handle = await stack.run(node, policy=policy, replace_s=12)

    assert report.outcome == "remediated", report
    # The job got SIGTERM, wrote a checkpoint before it was killed, was requeued and runs again elsewhere.
    log = (Path(policy.storage.root) / f"{job}.log").read_text().splitlines()
    assert log[0].startswith(f"start host={node} restarts=0 step=0")
    assert log[1].startswith("sigterm")
    assert log[2].startswith("start host=") and "restarts=1 step=1" in log[2] and f"host={node}" not in log[2]
    assert any(f"job {job} resumes from step 1" in d.result for d in report.decisions)
    assert any(f"job {job} runs again" in d.result for d in report.decisions)
    # Slurm: DOWN with our reason during the run, RESUMEd at the end.
    reason = f"fleetmedic: XID 79 on GPU 3 (xid-recovery/{stack.cluster}/{node})"
    assert any(d.result == f"set DOWN Slurm node {node}: {reason}" for d in report.decisions)
    assert stack.slurm_state(node)[0] in ("idle", "mix", "alloc")
    assert stack.slurm_state(node)[1] == "none"
    # Kubernetes: cordoned (annotated), drained with the PDB respected and the DaemonSet pod untouched, returned.
    evictions = [r.url.path for r in stack.kube.mutations() if r.url.path.endswith("/eviction")]
    assert sorted(evictions) == sorted([f"/api/v1/namespaces/training/pods/trainer-{node}/eviction",
                                        f"/api/v1/namespaces/inference/pods/serve-{node}/eviction"])
    assert stack.kube.get("v1", "Pod", f"dcgm-{node}", "gpu-operator") is not None
    assert stack.kube.get("v1", "Pod", "serve-elsewhere", "inference") is not None
    assert not stack.node(node)["spec"].get("unschedulable")
    assert "fleetmedic.io/workflow" not in stack.node(node)["metadata"].get("annotations", {})
    # The provider was asked exactly once; an Event and a Slack thread exist.
    assert [(r["node"], r["action"]) for r in stack.provider.accepted()] == [(node, "replace")]
    events = stack.kube.list("v1", "Event")
    assert [e["reason"] for e in events] == ["FleetMedicRemediated"]
    threads = stack.slack.threads()
    assert len(threads) == 1 and len(next(iter(threads.values()))) >= 2
    # The waits ran on the waits queue (async: they held no activity thread), the rest on the run's.
    history = await handle.fetch_history()
    scheduled = [e.activity_task_scheduled_event_attributes for e in history.events
                 if e.HasField("activity_task_scheduled_event_attributes")]
    queues = {a.activity_type.name: a.task_queue.name for a in scheduled}
    assert {name for name, queue in queues.items() if queue == f"{stack.task_queue}-waits"} == {
        "k8s.evict_pods", "k8s.wait_node_ready"}, queues
    assert queues["provider.request"] == stack.task_queue
    # The wait for Ready carries the policy's wait heartbeat (2 min), not an ordinary call's 30 s: a
    # wait that lasts hours heartbeats a quarter as often, and the server writes each heartbeat. (The
    # server cuts it to the attempt's own timeout: this test's short deadlines make that 90 s.) The
    # drain evicts while it waits: it heartbeats every 8 s (10 s timeout), so an abort stops it then.
    waits = [a for a in scheduled if a.task_queue.name == f"{stack.task_queue}-waits"]
    beats = {a.activity_type.name: a.heartbeat_timeout.ToTimedelta() for a in waits}
    ready = next(a for a in waits if a.activity_type.name == "k8s.wait_node_ready")
    ready_beat = min(policy.retries.wait_heartbeat, ready.start_to_close_timeout.ToTimedelta())
    assert beats == {"k8s.wait_node_ready": ready_beat, "k8s.evict_pods": timedelta(seconds=10)}, beats
    assert beats["k8s.wait_node_ready"] > policy.retries.call_timeout, beats
    assert policy.retries.wait_heartbeat == timedelta(minutes=2)
    # The protective step ran inside the run's first workflow task, as a local activity: no task
    # queue, and nothing scheduled before it.
    first_completed = next(e.event_id for e in history.events if e.HasField("workflow_task_completed_event_attributes"))
    protected = [e for e in history.events if (ran := local_activity(e)) is not None and ran["type"] == "protect.node"]
    assert len(protected) == 1 and "protect.node" not in queues, queues
    assert protected[0].marker_recorded_event_attributes.workflow_task_completed_event_id == first_completed
    # So did the reads between steps, each inside the task that asked for it (0.2.0): the lemon count
    # in that first task, the node's Slurm jobs with the take-out, whose Kubernetes node is the
    # protective step's read. None is an activity task, nor a workflow task for its answer.
    in_task = {ran["type"]: e.marker_recorded_event_attributes.workflow_task_completed_event_id
               for e in history.events if (ran := local_activity(e)) is not None}
    assert in_task["temporal.count_remediations"] == first_completed, in_task
    assert "slurm.jobs_on_node" in in_task and "k8s.get_node" not in in_task, in_task
    assert not {"temporal.count_remediations", "slurm.jobs_on_node", "k8s.get_node"} & set(queues), queues
    # Slack after the node is out of service: its call is not in the storm's critical second.
    names = [name for name, _, _ in called(history)]
    assert names.index("slack.notify_start") > names.index("protect.node"), names
    # The step reaches the search attributes when the run waits, not at every step it passes: the
    # first task writes the protective step (shown while it runs, should it outlast the task) and the
    # one it waits in, the protective kill's answer (not the policy read, classify, notify and the
    # lemon count), and no value is written twice in a row.
    shown: list[tuple[int, str]] = []  # (workflow task, FleetStep written)
    task = 0
    for event in history.events:
        task += event.HasField("workflow_task_completed_event_attributes")
        fields = event.upsert_workflow_search_attributes_event_attributes.search_attributes.indexed_fields
        if "FleetStep" in fields:
            shown.append((task, json.loads(fields["FleetStep"].data)))
    assert [step for task, step in shown if task == 1] == ["protect", "protective kill"], shown
    assert all(a[1] != b[1] for a, b in zip(shown, shown[1:], strict=False)), shown
    # The search attributes carry the outcome; the audit reads the whole story from the history.
    description = await handle.describe()
    assert description.typed_search_attributes is not None
    audit = render_markdown(timeline(stack.client, await handle.fetch_history()))
    assert "Outcome: **remediated**" in audit and "provider.request (ok" in audit
    assert "| call | protect.node (ok, in the workflow task) |" in audit, audit


async def test_node_that_never_comes_back_stays_quarantined_and_says_why(stack: Stack) -> None:
    policy = stack.policy(grace={"node_ready_deadline": "6s"})
    report, _ = await stack.run("gpu-node-2", policy=policy, controller=False)
    assert report.outcome == "quarantined"
    node = stack.node("gpu-node-2")
    assert node["spec"]["unschedulable"] is True
    assert any(d.step == "record outcome" and "did not come back healthy" in d.result for d in report.decisions)
    assert "not back in service after XID 79" in node["metadata"]["annotations"]["fleetmedic.io/quarantine-reason"]
    assert "DOWN" in stack.slurm.node_states("gpu-node-2")
    assert any("@oncall" in m["text"] and "stays out of service" in m["text"] for m in stack.slack.messages)


async def test_provider_failure_escalates_and_an_operator_aborts(stack: Stack) -> None:
    stack.provider.fail_next(503, times=100)

    async def operator_aborts(handle: WorkflowHandle[Any, Any]) -> None:
        status = await status_when(handle, lambda s: s.escalation is not None)
        assert status.escalation is not None and status.escalation.step == "replace"
        assert "Unavailable" in status.escalation.error
        await handle.signal("answer", EscalationAnswer(action="abort", by="alice", reason="hardware team on it"))

    policy = stack.policy()
    report, _ = await stack.run("gpu-node-0", policy=policy, during=operator_aborts)
    assert report.outcome == "aborted"
    assert any(d.result == "alice answered abort: hardware team on it" for d in report.decisions)
    assert stack.node("gpu-node-0")["spec"]["unschedulable"] is True  # left out of service, annotated
    assert "run aborted by alice" in stack.node("gpu-node-0")["metadata"]["annotations"][
        "fleetmedic.io/quarantine-reason"]
    assert any("@oncall" in m["text"] and "failed after its retries" in m["text"] for m in stack.slack.messages)


async def test_the_cli_answers_an_escalation_and_run_wait_says_how_it_ended(stack: Stack) -> None:
    """`fleetmedic answer <id> abort`, as an operator on a terminal would; and `run --wait` exits 3
    for a run that did not do what it was started for."""
    stack.provider.fail_next(503, times=100)

    async def operator_answers(handle: WorkflowHandle[Any, Any]) -> None:
        await status_when(handle, lambda s: s.escalation is not None)
        done = await asyncio.to_thread(stack.cli, "answer", handle.id, "abort", "--by", "alice", "--reason", "on it")
        assert done.returncode == 0 and "answer sent by alice" in done.stdout, done.stderr

    report, _ = await stack.run("gpu-node-0", during=operator_answers)
    assert report.outcome == "aborted"
    assert any(d.result == "alice answered abort: on it" for d in report.decisions)
    settings = settings_for(stack.task_queue, stack.kube, slurm=stack.slurm, slack=stack.slack,
                            provider=stack.provider)
    async with worker_for(stack.client, settings, stack.policy()):
        done = await asyncio.to_thread(stack.cli, "run", "xid-recovery", "--node", "no-such-node", "--xid", "79",
                                       "--wait")
    assert done.returncode == 3 and "outcome: unknown-node" in done.stdout, done.stdout + done.stderr


async def test_provider_failure_then_retry_continues(stack: Stack) -> None:
    stack.provider.fail_next(500, times=5)  # exactly the retry budget of a write

    async def operator_retries(handle: WorkflowHandle[Any, Any]) -> None:
        await status_when(handle, lambda s: s.escalation is not None)
        await handle.signal("answer", EscalationAnswer(action="retry", by="bob"))

    report, _ = await stack.run("gpu-node-0", during=operator_retries)
    assert report.outcome == "remediated"
    assert len(stack.provider.accepted()) == 1


async def test_a_protective_step_out_of_retries_escalates_and_retry_goes_on(stack: Stack) -> None:
    """The protective step runs inside the workflow task (a local activity, whose exhausted retries
    raise their own error): the API server refusing the node's read escalates to a person, never
    fails the run; once it answers again, `retry` takes the node out and the repair goes on."""
    fault = stack.kube.inject("GET", "nodes", name="gpu-node-0", status=503, times=100_000)
    policy = stack.policy(retries={"writes": {"attempts": 2, "initial_interval": "200ms", "max_interval": "1s"}})

    async def operator_retries(handle: WorkflowHandle[Any, Any]) -> None:
        status = await status_when(handle, lambda s: s.escalation is not None)
        assert status.escalation is not None and status.escalation.step == "protect", status.escalation
        assert "Unavailable" in status.escalation.error and "get node gpu-node-0" in status.escalation.error
        assert not stack.node("gpu-node-0")["spec"].get("unschedulable")  # nothing done yet
        fault.times = 0  # the API server is back
        await handle.signal("answer", EscalationAnswer(action="retry", by="bob"))

    report, _ = await stack.run("gpu-node-0", policy=policy, during=operator_retries)
    assert report.outcome == "remediated", report.decisions
    assert any(d.step == "protect" and d.result == "bob answered retry" for d in report.decisions)
    assert any("@oncall" in m["text"] and "*protect* failed after its retries" in m["text"]
               for m in stack.slack.messages)


async def test_a_protective_step_the_worker_cancelled_is_tried_again(stack: Stack,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A run never cancels its local activities, but the SDK's core resolved one as cancelled under
    load (5,000 runs on temporal-server: the protective step of a workflow-task attempt the server
    had given up on came back "Cancelled" in the next attempt), and the run failed with it. Here
    its first try resolves cancelled, as it did there: a failed try, said in the run's decisions,
    then tried again, and the repair goes on. So do the run's first two reads of its configuration:
    asked again in the same task (workflows/runbook.py `configuration`)."""
    real, cancelled = runbook.workflow.execute_local_activity, []

    async def execute_local_activity(name: str, *args: Any, **options: Any) -> Any:
        if name == "protect.node" and "protect.node" not in cancelled or (
                name == "config.run" and cancelled.count("config.run") < 2):
            cancelled.append(name)
            raise CancelledError("Cancelled")  # what the workflow received there
        return await real(name, *args, **options)

    monkeypatch.setattr(runbook.workflow, "execute_local_activity", execute_local_activity)
    report, _ = await stack.run("gpu-node-0")
    assert cancelled == ["config.run", "config.run", "protect.node"]
    assert report.outcome == "remediated", report.decisions
    assert any(d.step == "protect" and d.result.startswith("try 1 failed: Cancelled: protect.node was cancelled "
                                                           "by the worker") for d in report.decisions), report.decisions


async def test_an_abort_while_the_protective_step_outlasts_its_task_replays_and_is_honoured(stack: Stack) -> None:
    """An API server slow to take the cordon (9 s) holds the protective step past its workflow
    task's timeout (the SDK's core then ends the task and asks for another, the step still
    running), and an operator's abort arrives meanwhile: the signal lands between two tasks of a
    local activity. With no workflow cache, every task replays the whole history, the way a
    worker that lost the run (restart, eviction) does. The run replays at each task, its
    protective step is done once, and the abort is honoured before any destructive step: the
    node is left cordoned, DRAIN and annotated, nothing evicted, nothing asked of the provider."""
    held = stack.kube.inject("PATCH", "nodes", name="gpu-node-0", status=0, delay_s=9.0, times=1)

    async def abort_while_protecting(handle: WorkflowHandle[Any, Any]) -> None:
        while held.times:  # until the cordon's PATCH reaches the proxy, which holds it
            await asyncio.sleep(0.05)
        await handle.signal("abort", {"by": "erin", "reason": "wrong node"})

    report, handle = await stack.run("gpu-node-0", during=abort_while_protecting, worker={"workflow_cache": 0})
    assert report.outcome == "aborted", report.decisions
    events = [e async for e in handle.fetch_history_events()]
    failed = [e.workflow_task_failed_event_attributes.failure.message for e in events
              if e.HasField("workflow_task_failed_event_attributes")]
    assert failed == []  # a nondeterminism error fails the task, on every try
    first_task_done = next(e.event_id for e in events if e.HasField("workflow_task_completed_event_attributes"))
    protect = [e.event_id for e in events if (la := local_activity(e)) and la["type"] == "protect.node"]
    aborted = [e.event_id for e in events if e.HasField("workflow_execution_signaled_event_attributes")
               and e.workflow_execution_signaled_event_attributes.signal_name == "abort"]
    assert len(protect) == 1 and len(aborted) == 1
    assert first_task_done < aborted[0] < protect[0], "the abort did not land while the protective step ran"
    node = stack.node("gpu-node-0")
    assert node["spec"].get("unschedulable") is True
    assert "run aborted by erin: wrong node" in node["metadata"]["annotations"]["fleetmedic.io/quarantine-reason"]
    assert stack.slurm_state("gpu-node-0")[0] == "drain"
    assert stack.evicted() == [] and stack.provider.requests == []


async def test_slurm_controller_down_for_a_while(stack: Stack) -> None:
    ctld = stack.slurm.procs["slurmctld"]
    ctld.kill()
    ctld.wait()

    async def controller_returns(handle: WorkflowHandle[Any, Any]) -> None:
        await asyncio.sleep(6)
        stack.slurm._spawn("slurmctld", ["slurmctld", "-D", "-f", str(stack.slurm.conf)])

    report, _ = await stack.run("gpu-node-1", during=controller_returns, timeout=180)
    assert report.outcome == "remediated", report.decisions
    assert stack.slurm_state("gpu-node-1")[1] == "none"


async def test_application_xid_only_notifies(stack: Stack) -> None:
    policy = stack.policy(xid={"application_burst": {"count": 3, "window": "3s"}})
    report, _ = await stack.run("gpu-node-0", xid=13, policy=policy)
    assert report.outcome == "notified"
    assert stack.kube.mutations() == [r for r in stack.kube.mutations()
                                               if r.url.path.endswith("/events")]
    assert stack.slurm_state("gpu-node-0") == ("idle", "none")


async def test_application_xid_burst_escalates_to_diagnosis(stack: Stack) -> None:
    policy = stack.policy(xid={"application_burst": {"count": 3, "window": "1h"}})

    async def repeats(handle: WorkflowHandle[Any, Any]) -> None:
        await status_when(handle, lambda s: s.step == "watch for repeats")
        for _ in range(2):
            await handle.signal("alert", Alert(status="firing", labels={"xid": "13", "gpu": "3"},
                                               startsAt=datetime.now(UTC)))

    report, _ = await stack.run("gpu-node-0", xid=13, policy=policy, during=repeats)
    assert report.outcome == "escalated"
    assert any(d.step == "record outcome" and "burst" in d.result for d in report.decisions)
    assert stack.provider.requests == [] and stack.slurm_state("gpu-node-0") == ("idle", "none")


async def test_destructive_xid_during_the_watch_remediates(stack: Stack) -> None:
    policy = stack.policy(xid={"application_burst": {"count": 5, "window": "1h"}})

    async def fatal_follows(handle: WorkflowHandle[Any, Any]) -> None:
        await status_when(handle, lambda s: s.step == "watch for repeats")
        await handle.signal("alert", Alert(status="firing", labels={"xid": "79", "gpu": "1"}))

    report, _ = await stack.run("gpu-node-0", xid=13, policy=policy, during=fatal_follows)
    assert report.outcome == "remediated"
    assert any("XID 79 on GPU 1" in d.result for d in report.decisions)


async def test_reset_class_xid_without_an_agent_falls_back_to_reboot(stack: Stack) -> None:
    report, _ = await stack.run("gpu-node-1", xid=48)
    assert report.outcome == "remediated"
    assert [(r["node"], r["action"]) for r in stack.provider.accepted()] == [("gpu-node-1", "reboot")]
    assert any("falling back to reboot" in d.result for d in report.decisions)


async def test_a_person_who_repaired_the_node_in_place_ends_the_wait_for_its_reboot(stack: Stack) -> None:
    """The provider took the reboot and nothing came of it (the node never went NotReady); a person
    fixes the node in place and says so (`fleetmedic replaced`, no new name) while the run waits for
    a Ready newer than its request — one wait up to its 30-minute deadline: the run takes the
    node's present Ready at once, not when the wait ends."""
    policy = stack.policy(grace={"node_ready_deadline": "30m"})

    async def person_repairs(handle: WorkflowHandle[Any, Any]) -> None:
        await status_when(handle, lambda s: (s.waiting_for or "").startswith("node gpu-node-1 Ready after"),
                          timeout=90)
        done = await asyncio.to_thread(stack.cli, "replaced", handle.id, "--by", "alice")
        assert done.returncode == 0, done.stderr

    report, handle = await stack.run("gpu-node-1", xid=48, policy=policy, controller=False, during=person_repairs,
                                     timeout=60)
    assert report.outcome == "remediated", report.decisions
    assert [(r["node"], r["action"]) for r in stack.provider.accepted()] == [("gpu-node-1", "reboot")]
    assert not stack.node("gpu-node-1")["spec"].get("unschedulable")
    waits = [e.activity_task_scheduled_event_attributes
             for e in scheduled_events(await handle.fetch_history(), "k8s.wait_node_ready")]
    # The first wait spanned the deadline and was cancelled; the second counted the present Ready.
    assert len(waits) == 2 and waits[0].start_to_close_timeout.ToTimedelta() > timedelta(minutes=29)
    assert json.loads(waits[1].input.payloads[0].data)["since"] is None


async def test_reset_class_xid_resets_the_gpu_through_the_agent_and_validates(stack: Stack) -> None:
    with AgentStandIn() as agent:
        assert isinstance(agent, AgentStandIn)
        # An in-place reset keeps the node Ready: the agent's validation is the proof, not a transition.
        report, _ = await stack.run("gpu-node-1", xid=48, gpu=5, agent=agent, controller=False)
    assert report.outcome == "remediated", report.decisions
    assert agent.resets == [("gpu-node-1", 5)]
    assert stack.provider.requests == []
    assert any(d.step == "validate" and d.result == "passed" for d in report.decisions)


async def test_failed_validation_leaves_the_node_quarantined(stack: Stack) -> None:
    with AgentStandIn() as agent:
        assert isinstance(agent, AgentStandIn)
        agent.passed = False
        report, _ = await stack.run("gpu-node-2", agent=agent)
    assert report.outcome == "quarantined"
    assert any(d.step == "validate" and "XID 79 on GPU 3" in d.result for d in report.decisions)
    assert stack.node("gpu-node-2")["spec"]["unschedulable"] is True
    assert "DOWN" in stack.slurm.node_states("gpu-node-2")


async def test_approval_approve_continues_and_a_nameless_approval_is_refused(stack: Stack) -> None:
    from temporalio.client import WorkflowUpdateFailedError

    from fleetmedic.models import Approval

    async def approve(handle: WorkflowHandle[Any, Any]) -> None:
        await status_when(handle, lambda s: s.awaiting_approval == "replace")
        assert stack.provider.requests == []  # nothing is asked of the provider before the approval
        with pytest.raises(WorkflowUpdateFailedError) as refused:
            await handle.execute_update("approve", Approval(by=" "))
        assert "an approver is required" in str(refused.value.cause)
        answer = await handle.execute_update("approve", Approval(by="erin", reason="spare on site"), result_type=str)
        assert answer == "replace approved by erin"
        # The audit of the open run already has the decisions so far and the approval.
        done = await asyncio.to_thread(stack.cli, "audit", handle.id)
        assert done.returncode == 0, done.stderr
        assert "| update | approve by erin |" in done.stdout and "waiting for approval: policy asks" in done.stdout

    report, handle = await stack.run("gpu-node-0", policy=stack.policy(approvals={"steps": ["replace"]}),
                                     during=approve)
    assert report.outcome == "remediated"
    assert any(d.result == "approved by erin: spare on site" for d in report.decisions)
    audit = render_markdown(timeline(stack.client, await handle.fetch_history()))
    assert "| update | approve by erin |" in audit and "replace approved by erin" in audit
    assert any("needs approval" in m["text"] and "@oncall" in m["text"] for m in stack.slack.messages)


async def test_rejection_needs_a_reason_and_ends_the_run(stack: Stack) -> None:
    from temporalio.client import WorkflowUpdateFailedError

    from fleetmedic.models import Approval

    async def reject(handle: WorkflowHandle[Any, Any]) -> None:
        await status_when(handle, lambda s: s.awaiting_approval == "replace")
        with pytest.raises(WorkflowUpdateFailedError) as refused:
            await handle.execute_update("reject", Approval(by="erin"))
        assert "a rejection needs a reason" in str(refused.value.cause)
        await handle.execute_update("reject", Approval(by="erin", reason="vendor visit on Monday"))

    report, _ = await stack.run("gpu-node-1", policy=stack.policy(approvals={"steps": ["replace"]}), during=reject)
    assert report.outcome == "rejected"
    assert stack.provider.requests == []
    assert "rejected by erin" in stack.node("gpu-node-1")["metadata"]["annotations"]["fleetmedic.io/quarantine-reason"]


async def test_approval_timeout_escalates_or_aborts(stack: Stack) -> None:
    from fleetmedic.models import Approval

    async def late_approval(handle: WorkflowHandle[Any, Any]) -> None:
        await status_when(handle, lambda s: any("no approval within" in d.result for d in s.decisions))
        await handle.execute_update("approve", Approval(by="frank"))

    escalating = stack.policy(approvals={"steps": ["replace"], "timeout": "1s", "on_timeout": "escalate"})
    report, _ = await stack.run("gpu-node-2", policy=escalating, during=late_approval)
    assert report.outcome == "remediated"
    aborting = stack.policy(approvals={"steps": ["cordon"], "timeout": "1s", "on_timeout": "abort"})
    report, _ = await stack.run("gpu-node-0", policy=aborting)
    assert report.outcome == "aborted"
    assert stack.node_writes("gpu-node-0") == []  # the cordon never happened


async def test_third_remediation_in_the_window_retires_a_lemon_node(stack: Stack) -> None:
    policy = stack.policy(lemon={"count": 3, "window": "7d"})
    outcomes = [(await stack.run("gpu-node-1", policy=policy))[0].outcome for _ in range(3)]
    assert outcomes == ["remediated", "remediated", "lemon"]
    assert [r["action"] for r in stack.provider.accepted()] == ["replace", "replace", "rma"]
    node = stack.node("gpu-node-1")
    assert node["spec"]["unschedulable"] is True
    assert "lemon node: 3 remediations" in node["metadata"]["annotations"]["fleetmedic.io/quarantine-reason"]
    assert "DOWN" in stack.slurm.node_states("gpu-node-1")


async def test_the_lemon_count_survives_temporal_retention(stack: Stack) -> None:
    """Two remediations whose runs Temporal has already forgotten, recorded on the node itself."""
    policy = stack.policy(lemon={"count": 3, "window": "7d"})
    now = datetime.now(UTC)
    record = with_remediation(None, now - timedelta(days=2), "run-past-retention-1", keep=10)
    record = with_remediation(record, now - timedelta(days=1), "run-past-retention-2", keep=10)
    node = stack.node("gpu-node-1")
    node["metadata"]["annotations"]["fleetmedic.io/remediations"] = record
    stack.kube.put(node)
    report, handle = await stack.run("gpu-node-1", policy=policy)
    assert report.outcome == "lemon", report.decisions
    assert [r["action"] for r in stack.provider.accepted()] == ["rma"]
    # The record was read with the protective step's one read of the node, not by a read of its own.
    steps = [(name, step) for name, step, _ in called(await handle.fetch_history())
             if not name.startswith("config.")]
    assert ("k8s.get_node", "lemon check") not in steps and steps[0] == ("protect.node", "protect"), steps
    runs = remediations(stack.node("gpu-node-1")["metadata"]["annotations"]["fleetmedic.io/remediations"])
    assert len(runs) == 3 and runs[-1][1] not in ("run-past-retention-1", "run-past-retention-2")


def frozen_serve_pdb(stack: Stack) -> None:
    """The service's owners froze it: its PDB lets no replica go (4 replicas, all 4 required)."""
    stack.kube.put(fleet.pdb("serve", namespace="inference", match_labels={"app": "serve"}, min_available=4))


async def test_a_pod_its_pdb_never_releases_escalates_and_skip_is_named_in_the_outcome(stack: Stack) -> None:
    frozen_serve_pdb(stack)

    async def operator_skips(handle: WorkflowHandle[Any, Any]) -> None:
        status = await status_when(handle, lambda s: s.escalation is not None)
        assert status.escalation is not None and status.escalation.step == "drain"
        assert "inference/serve-gpu-node-0" in status.escalation.error
        assert stack.provider.requests == []  # nothing replaced while the operator decides
        await handle.signal("answer", EscalationAnswer(action="skip", by="alice", reason="serve can take it"))

    policy = stack.policy(grace={"checkpoint": "2s", "eviction_deadline": "3s"})
    report, _ = await stack.run("gpu-node-0", policy=policy, during=operator_skips)
    assert report.outcome == "remediated", report.decisions
    outcome = next(d.result for d in report.decisions if d.step == "record outcome")
    assert "1 pod(s) left on the node past their PodDisruptionBudget: inference/serve-gpu-node-0" in outcome


async def test_drain_on_blocked_proceed_records_it_and_says_so(stack: Stack) -> None:
    frozen_serve_pdb(stack)
    policy = stack.policy(grace={"checkpoint": "2s", "eviction_deadline": "3s"}, drain={"on_blocked": "proceed"})
    report, _ = await stack.run("gpu-node-0", policy=policy)
    assert report.outcome == "remediated", report.decisions
    assert not any("escalated" in d.result for d in report.decisions)
    assert any("drain.on_blocked: proceed" in d.result for d in report.decisions)
    outcome = next(d.result for d in report.decisions if d.step == "record outcome")
    assert "left on the node past their PodDisruptionBudget: inference/serve-gpu-node-0" in outcome


async def test_an_abort_stops_a_drain_that_waits_out_a_pdb_at_once(stack: Stack) -> None:
    """The drain waits out a PodDisruptionBudget up to its deadline (10 minutes here), evicting
    again whenever the budget allows. An operator who aborts because the drain is wrong ends the run
    at once, and the drain stops at its next heartbeat: it tries no eviction after that, however
    soon the budget would have let one through. With the default `wait_heartbeat` (2 minutes), as
    shipped: a drain heartbeats every 8 s however long the waits' heartbeats are."""
    frozen_serve_pdb(stack)
    policy = stack.policy(grace={"checkpoint": "2s", "eviction_deadline": "10m"})
    blocked = "/api/v1/namespaces/inference/pods/serve-gpu-node-0/eviction"

    def evictions_tried() -> int:  # as the API server saw them
        return sum(1 for r in stack.kube.requests() if r.url.path == blocked)

    async def operator_aborts(handle: WorkflowHandle[Any, Any]) -> None:
        await status_when(handle, lambda s: s.step == "drain" and evictions_tried() >= 2, timeout=120)
        workflow_id = node_workflow_id("xid-recovery", stack.cluster, "gpu-node-0")
        aborted = await asyncio.to_thread(stack.cli, "abort", workflow_id, "--by", "alice",
                                          "--reason", "serve is mid-rollout")
        assert aborted.returncode == 0, aborted.stderr
        await asyncio.wait_for(handle.result(), 60)
        # The worker (still running) hears of the cancel with the drain's next heartbeat (every 8 s)
        # and stops: no eviction for longer than two of its 5-second backoffs.
        await until_quiet(evictions_tried, 12, "the drain's evictions")

    report, handle = await stack.run("gpu-node-0", policy=policy, during=operator_aborts)
    assert report.outcome == "aborted", report.decisions
    assert any("alice" in d.result and "mid-rollout" in d.result for d in report.decisions), report.decisions
    history = await handle.fetch_history()
    [drain] = scheduled_events(history, "k8s.evict_pods")
    assert cancels_requested(history) == [drain.event_id]
    assert stack.kube.get("v1", "Pod", "serve-gpu-node-0", "inference") is not None  # never evicted
    assert stack.provider.requests == []  # nothing after the drain ran


async def test_a_dry_run_that_meets_an_error_ends_dry_run_and_pages_nobody(stack: Stack) -> None:
    stack.kube.inject("GET", "nodes", name="gpu-node-0", status=503, times=100_000)
    policy = stack.policy(retries={"reads": {"attempts": 2, "initial_interval": "200ms", "max_interval": "1s"}})
    report, _ = await stack.run("gpu-node-0", policy=policy, dry_run=True)
    assert report.outcome == "dry-run", report.decisions
    outcome = next(d.result for d in report.decisions if d.step == "record outcome")
    assert "would have escalated" in outcome and "Unavailable" in outcome
    assert not any(d.result.startswith("escalated") for d in report.decisions)
    assert stack.slack.messages == []  # no live thread, no mention
    assert stack.kube.mutations() == []


async def test_an_invalid_start_input_fails_the_run_with_the_reason(client: Client, task_queue: str,
                                                                     kube: RealKube) -> None:
    from temporalio.client import WorkflowFailureError

    settings = settings_for(task_queue, kube)
    async with worker_for(client, settings, quick_policy(kube.kubeconfig.parent)):  # type: ignore[attr-defined]
        handle = await client.start_workflow("xid-recovery", {"cluster": "", "node": "gpu-1", "xid": "seventy-nine"},
                                             id=f"xid-recovery/{task_queue}/bad", task_queue=task_queue)
        with pytest.raises(WorkflowFailureError) as failed:
            await asyncio.wait_for(handle.result(), 30)
    message = str(failed.value.cause)
    assert "invalid xid-recovery input" in message and "cluster:" in message and "xid:" in message


async def test_run_metrics_reach_the_workers_metrics_endpoint(client: Client, task_queue: str,
                                                               kube: RealKube,
                                                               provider_http: ProviderStandIn, tmp_path: Path) -> None:
    """Counted where an SRE scrapes them, as Prometheus names them: a live repair and a shadow run."""
    import re

    import httpx

    from devstack.controllers import provider_controller
    from devstack.slurm_cluster import free_port
    from workers.temporal_client import connect
    from workers.worker import full_pass_metrics, metrics_runtime

    port = free_port()
    runtime = metrics_runtime(port)
    assert runtime is not None
    metered = await connect(runtime=runtime, target_host=client.service_client.config.target_host)
    for name in ("gpu-m", "gpu-n"):
        kube.put(fleet.node(name))
    settings = settings_for(task_queue, kube, provider=provider_http)
    policy = quick_policy(tmp_path, provider={"kind": "http", "http": {"url": provider_http.url}})
    with provider_controller(kube, provider_http, delay_s=0.5):
        async with (worker := worker_for(metered, settings, policy)):
            live = await metered.execute_workflow(
                "xid-recovery", NodeRunbookInput(cluster=task_queue, node="gpu-m", gpu=1, xid=79),
                id=node_workflow_id("xid-recovery", task_queue, "gpu-m"), task_queue=task_queue,
                result_type=RunbookStatus)
            shadow = await metered.execute_workflow(
                "xid-recovery", NodeRunbookInput(cluster=task_queue, node="gpu-n", gpu=1, xid=79, dry_run=True),
                id=node_workflow_id("xid-recovery", task_queue, "gpu-n"), task_queue=task_queue,
                result_type=RunbookStatus)
            # The runs' activations went through the gate that times the worker's full passes
            # (started only in a worker's own process: run it here by hand, as its thread would).
            assert worker.gate.activations >= 10
            worker.gate.on_pass = full_pass_metrics(runtime)
            worker.gate.collect_in_gap()
            body = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    assert live.outcome == "remediated" and shadow.outcome == "dry-run", (live.decisions, shadow.decisions)
    finished = [line for line in body.splitlines() if line.startswith("fleetmedic_runbooks_finished_total{")]
    assert any('outcome="dry-run"' in line and 'runbook="xid-recovery"' in line for line in finished), finished
    assert any('outcome="remediated"' in line for line in finished), finished
    # Seconds, in buckets a repair can land in; one repair timed (the shadow run repaired nothing).
    repair = [line for line in body.splitlines() if line.startswith("fleetmedic_time_to_repair")]
    assert any('le="1800"' in line for line in repair), repair
    count = next(line for line in repair if line.startswith("fleetmedic_time_to_repair_count"))
    assert count.endswith(" 1"), repair
    seconds = float(next(line for line in repair if line.startswith("fleetmedic_time_to_repair_sum")).split()[-1])
    assert 1 < seconds < 600, seconds  # seconds, not milliseconds
    lost = next(line for line in body.splitlines() if line.startswith("fleetmedic_gpu_hours_lost_sum"))
    assert float(lost.split()[-1]) > 0  # 8 GPUs out for some seconds
    assert re.search(r"^fleetmedic_runbook_steps_total\{", body, re.M)
    assert re.search(r'^fleetmedic_worker_gc_full_passes_total\{.*forced="false".*\} 1$', body, re.M), body
    # Seconds, in the buckets the worker gives them (the SDK's own are milliseconds).
    assert re.search(r'^fleetmedic_worker_gc_full_pass_seconds_bucket\{.*le="0.25".*\} [01]$', body, re.M), body
    assert re.search(r'^fleetmedic_worker_gc_full_pass_seconds_count\{.*\} 1$', body, re.M), body
