"""hot-gpu-pull end to end: real Temporal dev server, real Slurm, the real Kubernetes control plane, stand-ins."""

from __future__ import annotations

import re
from pathlib import Path

from devstack.standins import AgentStandIn
from tests.alerts import hot_alert
from tests.harness import CHECKPOINTING_JOB, job_on
from tests.runbook_stack import Stack

# A training job that checkpoints every few seconds on its own (and once more on SIGTERM), like a
# real one: at-checkpoint mode waits for its next periodic checkpoint.
PERIODIC_JOB = """#!/bin/bash
#SBATCH --requeue
dir="{root}/$SLURM_JOB_ID"
mkdir -p "$dir"
step=$(ls "$dir" 2>/dev/null | sed 's/step-//' | sort -n | tail -1)
step=${{step:-0}}
echo "start host=$SLURMD_NODENAME restarts=${{SLURM_RESTART_COUNT:-0}} step=$step" >> "$dir.log"
trap 'echo "sigterm $(date +%s.%N)" >> "$dir.log"; exit 0' TERM
touch "$dir/step-$step"
while true; do
  for i in $(seq {every_ticks}); do sleep 0.2; done
  step=$((step + 1))
  touch "$dir/step-$step"
  echo "checkpoint step=$step $(date +%s.%N)" >> "$dir.log"
done
"""


def hot_agent(node_gpu: int = 3, celsius: float = 84.0) -> AgentStandIn:
    agent = AgentStandIn()
    agent.temperatures[node_gpu] = celsius
    return agent


async def test_hot_gpu_immediate_requeues_the_job_and_replaces_the_node_once(stack: Stack) -> None:
    policy = stack.policy(thermal={"pull_mode": "immediate"})
    job = stack.slurm.submit(CHECKPOINTING_JOB.format(root=policy.storage.root))
    node = job_on(stack.slurm, job)
    with hot_agent() as agent:
        report, _ = await stack.run(node, runbook="hot-gpu-pull", policy=policy, agent=agent, replace_s=8)
    assert report.outcome == "remediated", report.decisions
    assert any(d.step == "confirm still hot" and d.result == "still hot: GPU 3 84 °C, above 78 °C"
               for d in report.decisions)
    # Slurm DOWN (SIGTERM), a checkpoint, a requeue; the job runs again.
    log = (Path(policy.storage.root) / f"{job}.log").read_text().splitlines()
    assert log[1].startswith("sigterm") and "restarts=1 step=1" in log[2]
    reason = f"fleetmedic: GPU 3 hot, 84 °C (hot-gpu-pull/{stack.cluster}/{node})"
    assert any(d.result == f"set DOWN Slurm node {node}: {reason}" for d in report.decisions)
    assert any(f"job {job} runs again" in d.result for d in report.decisions)
    # Replaced exactly once, with the reason the provider shows its people; back in service.
    accepted = stack.provider.accepted()
    assert [(r["node"], r["action"]) for r in accepted] == [(node, "replace")]
    assert accepted[0]["reason"] == f"GPU 3 on {node} runs at 84 °C"
    assert stack.evicted() == sorted([f"inference/serve-{node}", f"training/trainer-{node}"])
    assert not stack.node(node)["spec"].get("unschedulable")
    assert stack.slurm_state(node)[1] == "none"


async def test_hot_gpu_at_checkpoint_waits_for_the_next_checkpoint_then_requeues(stack: Stack) -> None:
    policy = stack.policy(thermal={"pull_mode": "at-checkpoint", "at_checkpoint_deadline": "60s"})
    job = stack.slurm.submit(PERIODIC_JOB.format(root=policy.storage.root, every_ticks=30))  # every 6 s
    node = job_on(stack.slurm, job)
    with hot_agent() as agent:
        report, _ = await stack.run(node, runbook="hot-gpu-pull", policy=policy, agent=agent)
    assert report.outcome == "remediated", report.decisions
    results = [d.result for d in report.decisions]
    assert any(r.startswith(f"set DRAIN Slurm node {node}") for r in results)
    checkpointed = next(i for i, r in enumerate(results) if r.startswith(f"job {job} checkpointed at step 1"))
    requeued = next(i for i, r in enumerate(results) if "requeue" in r and f"job {job}" in r)
    assert checkpointed < requeued
    # The job was not signalled by the DRAIN: it ran on to its periodic checkpoint, and only the
    # requeue after it stopped it.
    log = (Path(policy.storage.root) / f"{job}.log").read_text().splitlines()
    first_term = next(i for i, line in enumerate(log) if line.startswith("sigterm"))
    assert log[first_term - 1].startswith("checkpoint step=1")
    sigterm_at = float(log[first_term].split()[1])
    checkpoint_at = float(log[first_term - 1].split()[2])
    assert sigterm_at > checkpoint_at
    assert any(f"job {job} runs again" in r for r in results)


async def test_hot_gpu_at_checkpoint_deadline_requeues_a_job_that_never_checkpoints(stack: Stack) -> None:
    policy = stack.policy(thermal={"pull_mode": "at-checkpoint", "at_checkpoint_deadline": "4s"})
    job = stack.slurm.submit(PERIODIC_JOB.format(root=policy.storage.root, every_ticks=100000))
    node = job_on(stack.slurm, job)
    with hot_agent() as agent:
        report, _ = await stack.run(node, runbook="hot-gpu-pull", policy=policy, agent=agent)
    assert report.outcome == "remediated", report.decisions
    results = [d.result for d in report.decisions]
    assert any(re.match(rf"grace of 0:00:04 ended without a fresh checkpoint from job\(s\) \[{job}\]", r)
               for r in results), results
    assert any(f"job {job} resumes from step 0" in r for r in results)
    assert any(f"job {job} runs again" in r for r in results)


async def test_a_gpu_that_cooled_down_ends_the_run_without_touching_anything(stack: Stack) -> None:
    with AgentStandIn() as agent:  # every GPU at 55 °C
        report, _ = await stack.run("gpu-node-1", runbook="hot-gpu-pull", agent=agent)
    assert report.outcome == "recovered"
    assert any(d.step == "record outcome" and "GPU 3 cooled down before any action (GPU 3 55 °C)" in d.result
               for d in report.decisions)
    mutations = stack.kube.mutations()
    assert [m.url.path for m in mutations] == ["/api/v1/namespaces/default/events"]  # the outcome, and only it
    assert stack.slurm_state("gpu-node-1") == ("idle", "none")
    assert stack.provider.requests == []


async def test_another_gpu_hot_in_the_first_alerts_notification_is_pulled_when_the_first_cooled(
        stack: Stack) -> None:
    """Alertmanager groups a node's alerts (deploy/alertmanager: one group per node): GPU 3's and GPU
    5's hot alerts come in one notification. GPU 3's starts the run, GPU 5's is signalled to it
    before its first workflow task (answered attached), and Alertmanager sends it again only after
    the route's repeat_interval. GPU 3 has cooled down when the run reads the agent, GPU 5 has not:
    the node is pulled for GPU 5, not left in service as `recovered`."""
    node = "gpu-node-1"
    with hot_agent(node_gpu=5) as agent:  # GPU 3 back at the stand-in's 55 °C
        report, _ = await stack.run(node, runbook="hot-gpu-pull", agent=agent, alerts=[
            hot_alert(node, stack.cluster, 3), hot_alert(node, stack.cluster, 5, celsius=83)])
    assert report.outcome == "remediated", report.decisions
    assert any(d.step == "confirm still hot" and d.result == "still hot: GPU 5 84 °C, above 78 °C"
               for d in report.decisions), report.decisions
    # Out of service, seen from the outside: the cordon in the API server's audit log, once; the
    # provider asked to replace the node for GPU 5.
    cordons = [r for r in stack.node_writes(node)
               if r.code < 300 and (r.data or {}).get("spec", {}).get("unschedulable") is True]
    assert len(cordons) == 1, [r.data for r in stack.node_writes(node)]
    assert [(r["node"], r["action"], r["reason"]) for r in stack.provider.accepted()] == [
        (node, "replace", f"GPU 5 on {node} runs at 84 °C")]


async def test_thermal_margin_mode_pulls_a_gpu_near_its_slowdown_limit(stack: Stack) -> None:
    policy = stack.policy(thermal={"mode": "margin", "margin_c": 5})
    with hot_agent(celsius=83.5) as agent:  # 3.5 °C from the stand-in's 87 °C slowdown
        report, _ = await stack.run("gpu-node-2", runbook="hot-gpu-pull", policy=policy, agent=agent)
    assert report.outcome == "remediated"
    assert any("3.5 °C from slowdown, under the 5 °C margin" in d.result for d in report.decisions)


async def test_hot_gpus_count_towards_the_lemon_rule(stack: Stack) -> None:
    policy = stack.policy(lemon={"count": 2, "window": "7d"})
    first, _ = await stack.run("gpu-node-0", runbook="hot-gpu-pull", policy=policy)
    second, _ = await stack.run("gpu-node-0", runbook="hot-gpu-pull", policy=policy)
    assert (first.outcome, second.outcome) == ("remediated", "lemon")
    assert [r["action"] for r in stack.provider.accepted()] == ["replace", "rma"]
