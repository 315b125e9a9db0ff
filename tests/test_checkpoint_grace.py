"""Checkpoint grace that means what the policy says, and the gate between every destructive step.

Slurm's DOWN sends SIGTERM and SIGKILLs the job KillWait seconds later (5 s in the test cluster,
30 s by default), whatever `grace.checkpoint` says. FleetMedic drains the node first, sends the
signal itself, waits for a fresh *complete* checkpoint, and only then takes the node DOWN. Jobs
here are real Slurm batch jobs that write real files.
"""

from __future__ import annotations

import asyncio
import re
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import pytest
from temporalio.client import WorkflowHandle

from fleetmedic.ids import guard_workflow_id
from fleetmedic.models import EscalationAnswer, Operator
from fleetmedic.policy import Policy
from tests.gate_check import assert_gated, scheduled
from tests.harness import CHECKPOINTING_JOB, job_on
from tests.runbook_stack import START, Stack, status_when
from tests.test_hot_gpu_pull import hot_agent

NODE = "gpu-node-1"

# On SIGTERM the job needs 8 s to write its checkpoint — longer than KillWait (5 s) — then exits.
SLOW_JOB = """#!/bin/bash
#SBATCH --requeue
dir="{root}/$SLURM_JOB_ID"
mkdir -p "$dir"
step=$(ls "$dir" 2>/dev/null | sed 's/step-//' | sort -n | tail -1)
step=${{step:-0}}
echo "start restarts=${{SLURM_RESTART_COUNT:-0}} step=$step" >> "$dir.log"
on_term() {{
  echo "sigterm $(date +%s.%N)" >> "$dir.log"
  {write}
  echo "checkpoint step=$((step + 1)) $(date +%s.%N)" >> "$dir.log"
  exit 0
}}
trap on_term TERM
touch "$dir/step-$step"
while true; do sleep 0.2; done
"""
SLOW_WRITE = 'sleep 8; touch "$dir/step-$((step + 1))"'
# The checkpoint file appears at once and grows for about 7 s: a reader that took the first sight
# of it for a checkpoint would take the node DOWN mid-write, and KillWait would truncate it.
PARTIAL_WRITE = 'for i in $(seq 140); do printf "%0100d" 0 >> "$dir/step-$((step + 1))"; sleep 0.05; done'


def alive_policy(stack: Stack, **overrides: Any) -> Policy:
    """XID 79 as if it left the job alive (catalog `job_lost` off): the job is signalled and given
    its grace, not killed before the lease (that path: tests/test_protective_first.py)."""
    return stack.policy(xid={"catalog": {79: {"job_lost": False}}}, **overrides)


def job_on_the_node(stack: Stack, root: str, write: str = SLOW_WRITE) -> int:
    """A checkpointing job on NODE, running; `write`: what it does on SIGTERM."""
    job = stack.slurm.submit(SLOW_JOB.format(root=root, write=write), "-w", NODE)
    assert job_on(stack.slurm, job) == NODE
    return job


def job_log(stack: Stack, root: str, job: int) -> list[str]:
    return (Path(root) / f"{job}.log").read_text().splitlines()


def slurm_writes(stack: Stack) -> list[str]:
    log = (stack.slurm.dir / "log" / "slurmctld.log").read_text()
    return re.findall(rf"update_node: node {NODE} state set to (\w+)", log)


async def test_a_job_slower_than_killwait_still_checkpoints_before_the_node_goes_down(stack: Stack) -> None:
    policy = alive_policy(stack)
    root = policy.storage.root
    job = job_on_the_node(stack, root)
    report, handle = await stack.run(NODE, policy=policy)
    assert report.outcome == "remediated", report.decisions
    log = job_log(stack, root, job)
    assert any(line.startswith("checkpoint step=1") for line in log), log  # never SIGKILLed mid-write
    assert "start restarts=1 step=1" in log, log  # requeued, and resumed from the new checkpoint
    results = [d.result for d in report.decisions]
    signalled = next(i for i, r in enumerate(results) if r.startswith(f"signal Slurm job {job}"))
    checkpointed = next(i for i, r in enumerate(results) if r.startswith(f"job {job} checkpointed at step 1"))
    down = next(i for i, r in enumerate(results) if r.startswith(f"set DOWN Slurm node {NODE}"))
    assert signalled < checkpointed < down
    assert [s for s in slurm_writes(stack) if s in ("DRAINING", "DOWN")] == ["DRAINING", "DOWN"]
    assert_gated(await handle.fetch_history())


async def test_a_half_written_checkpoint_does_not_count(stack: Stack) -> None:
    policy = alive_policy(stack)
    root = policy.storage.root
    job = job_on_the_node(stack, root, PARTIAL_WRITE)
    report, _ = await stack.run(NODE, policy=policy)
    assert report.outcome == "remediated", report.decisions
    assert (Path(root) / str(job) / "step-1").stat().st_size == 140 * 100  # written out, not truncated
    assert "start restarts=1 step=1" in job_log(stack, root, job)


@pytest.mark.parametrize("runbook", sorted(START))
async def test_every_destructive_call_passes_the_gate_of_its_step(stack: Stack, runbook: str) -> None:
    """The history of a whole remediation, with a Slurm job on the node: each destructive activity
    came right after the opt-out check of its own step."""
    policy = alive_policy(stack)
    job = stack.slurm.submit(CHECKPOINTING_JOB.format(root=policy.storage.root), "-w", NODE)
    assert job_on(stack.slurm, job) == NODE
    with hot_agent() if runbook == "hot-gpu-pull" else nullcontext() as agent:  # it confirms the GPU is hot
        report, handle = await stack.run(NODE, runbook=runbook, policy=policy, agent=agent)
    assert report.outcome == "remediated", report.decisions
    history = await handle.fetch_history()
    seen = assert_gated(history)
    assert {"protect.node", "slurm.set_node_state", "k8s.evict_pods", "provider.request"} <= seen, seen
    # Protective first: the cordon (or taint) and DRAIN before the lease was even asked for.
    names = [name for name, _, _ in scheduled(history)]
    assert names.index("protect.node") < names.index("guard.request"), names
    if runbook == "xid-recovery":
        assert {"slurm.signal_job", "slurm.requeue_job"} <= seen, seen


async def test_an_opt_out_set_mid_run_stops_before_the_next_destructive_step(stack: Stack) -> None:
    """The label lands while the job writes its checkpoint (after the cordon, before DOWN)."""
    policy = alive_policy(stack)
    root = policy.storage.root
    job_on_the_node(stack, root)

    async def opt_out_mid_run(handle: WorkflowHandle[Any, Any]) -> None:
        await status_when(handle, lambda s: s.step == "grace for checkpoints")
        node = stack.node(NODE)
        node["metadata"].setdefault("labels", {})["fleetmedic.io/remediation"] = "disabled"
        stack.kube.put(node)

    report, _ = await stack.run(NODE, policy=policy, during=opt_out_mid_run)
    assert report.outcome == "opted-out", report.decisions
    outcome = next(d.result for d in report.decisions if d.step == "record outcome")
    assert "opted out before take the node DOWN" in outcome, outcome
    assert stack.slurm_state(NODE)[0] in ("drain", "drng")  # drained, never DOWN
    assert "DOWN" not in slurm_writes(stack)
    assert stack.evicted() == [] and stack.provider.requests == []


async def test_a_fleet_pause_mid_run_holds_the_next_destructive_step(stack: Stack) -> None:
    policy = alive_policy(stack)
    root = policy.storage.root
    job_on_the_node(stack, root)

    async def pause_fleet_mid_run(handle: WorkflowHandle[Any, Any]) -> None:
        await status_when(handle, lambda s: s.step == "grace for checkpoints")
        guard = stack.client.get_workflow_handle(guard_workflow_id(stack.cluster))
        await guard.signal("pause", Operator(by="carol", reason="bad driver push"))
        status = await status_when(handle, lambda s: s.waiting_for is not None and "fleet paused" in s.waiting_for,
                                   timeout=60)
        assert status.step == "take the node DOWN" and status.paused is not None
        await asyncio.sleep(2)
        assert "DOWN" not in slurm_writes(stack) and stack.evicted() == []
        await guard.signal("resume", Operator(by="carol"))

    report, _ = await stack.run(NODE, policy=policy, during=pause_fleet_mid_run)
    assert report.outcome == "remediated", report.decisions


async def test_slurm_controller_gone_mid_run_escalates_and_never_reads_as_no_jobs(stack: Stack) -> None:
    policy = alive_policy(stack, retries={"reads": {"attempts": 2, "initial_interval": "200ms", "max_interval": "1s"}})
    root = policy.storage.root
    job_on_the_node(stack, root)

    async def stop_slurmctld(handle: WorkflowHandle[Any, Any]) -> None:
        await status_when(handle, lambda s: s.step == "grace for checkpoints")
        stack.slurm.stop_controller()
        status = await status_when(handle, lambda s: s.escalation is not None, timeout=120)
        # squeue gives up on an unreachable slurmctld after ~9 s (Unavailable), and reading one job
        # by its ID after twice that, past the call's timeout: either names slurmctld.
        assert status.escalation is not None and status.escalation.error.startswith(("Unavailable", "Timeout"))
        assert "slurmctld at " in status.escalation.error
        assert stack.evicted() == [] and stack.provider.requests == []  # nothing went on as if no job ran
        await handle.signal("answer", EscalationAnswer(action="abort", by="sre", reason="slurmctld down"))

    report, _ = await stack.run(NODE, policy=policy, during=stop_slurmctld, timeout=240)
    assert report.outcome == "aborted", report.decisions
