"""Helpers shared by the workflow tests: a worker wired to the stand-ins, a quick policy, a Slurm job."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from temporalio.client import Client
from temporalio.testing import ActivityEnvironment

from devstack.controllers import provider_controller, set_ready
from devstack.kube_world import RealKube
from devstack.slurm_cluster import LocalSlurmCluster
from devstack.standins import ProviderStandIn, SlackStandIn
from fleetmedic.policy import Policy, parse_policy
from fleetmedic.settings import Settings
from workers.worker import FleetWorker, build_worker

# A job that checkpoints like a training job: on start it resumes from its newest step, and on
# SIGTERM it writes one more step before it exits. Slurm requeues it after the node goes DOWN.
CHECKPOINTING_JOB = """#!/bin/bash
#SBATCH --requeue
dir="{root}/$SLURM_JOB_ID"
mkdir -p "$dir"
step=$(ls "$dir" 2>/dev/null | sed 's/step-//' | sort -n | tail -1)
step=${{step:-0}}
echo "start host=$SLURMD_NODENAME restarts=${{SLURM_RESTART_COUNT:-0}} step=$step" >> "$dir.log"
on_term() {{
  echo "sigterm $(date +%s.%N) host=$SLURMD_NODENAME" >> "$dir.log"
  touch "$dir/step-$((step + 1))"
  exit 0
}}
trap on_term TERM
touch "$dir/step-$step"
while true; do sleep 0.2; done
"""


def own_taints(node: dict[str, Any]) -> list[dict[str, Any]]:
    """A node's taints less the node lifecycle controller's (node.kubernetes.io/not-ready and the
    like, which come and go with the Ready condition on a real control plane: a kwok heartbeat
    late on a busy machine is enough)."""
    return [t for t in node["spec"].get("taints") or [] if not t["key"].startswith("node.kubernetes.io/")]


def run_activity(fn: Any, *args: Any) -> Any:
    """Run one activity (sync or async) in Temporal's activity test context (heartbeats work)."""
    result = ActivityEnvironment().run(fn, *args)
    return asyncio.run(result) if inspect.iscoroutine(result) else result


def quick_policy(tmp_path: Path, **overrides: Any) -> Policy:
    """The default policy with short deadlines, so a test waits seconds, not minutes."""
    doc: dict[str, Any] = {
        "grace": {"checkpoint": "20s", "eviction_deadline": "30s", "node_ready_deadline": "60s",
                  "job_resume_deadline": "90s"},
        "storage": {"root": str(tmp_path / "checkpoints"), "layout": "{job_id}/step-*", "step_pattern": r"(\d+)",
                    "stable_interval": "200ms"},
        "escalation": {"slack_mention": "@oncall", "reminder": "1h"},
        "retries": {"reads": {"attempts": 8, "initial_interval": "200ms", "max_interval": "2s"},
                    "writes": {"attempts": 5, "initial_interval": "200ms", "max_interval": "1s"}},
        # The cordon breaker wide open: tests of other things take many nodes out at once on purpose
        # (tests/test_cordon_breaker.py sets its bounds).
        "budget": {"protective": {"max_out_fraction": 1.0, "max_per_minute": 1000}},
        # Kueue's admission does not start traffic runbooks: the control plane's Workloads are written
        # by hand there (tests/test_kueue_admission.py runs Kueue itself, and turns it on).
        "traffic": {"start_from_kueue": False},
    }
    for key, value in overrides.items():
        doc[key] = {**doc.get(key, {}), **value} if isinstance(value, dict) else value
    (tmp_path / "checkpoints").mkdir(exist_ok=True)
    return parse_policy(yaml.safe_dump(doc), "test policy")


def settings_for(task_queue: str, kube: RealKube, *, slurm: LocalSlurmCluster | None = None,
                  slack: SlackStandIn | None = None, provider: ProviderStandIn | None = None,
                  **extra: Any) -> Settings:
    values: dict[str, Any] = {
        "task_queue": task_queue, "cluster": "test",
        "kubeconfig": str(kube.kubeconfig),  # type: ignore[attr-defined]
        "slurm": "on" if slurm else "off",
        "slurm_conf": str(slurm.conf) if slurm else None,
        "slack_bot_token": "xoxb-test" if slack else None, "slack_channel": "#gpu-fleet" if slack else None,
        "slack_api_url": slack.api_url if slack else "https://slack.invalid/api/",
        "provider_token": provider.token if provider else None,
        "metrics_port": 0, "activity_threads": 16,
    }
    values.update(extra)
    return Settings.model_validate(values)


def worker_for(client: Client, settings: Settings, policy: Policy) -> FleetWorker:
    """A worker serving the test's own cluster (tests name their cluster after their task queue)."""
    return build_worker(client, settings, policy.serving(settings.task_queue))


def job_on(slurm: LocalSlurmCluster, job_id: int, timeout_s: float = 20) -> str:
    """Wait until the job runs and return its node."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        out = slurm.run("squeue", "-h", "-j", str(job_id), "-o", "%T %N", check=False).stdout.split()
        if len(out) == 2 and out[0] == "RUNNING":
            return out[1]
        time.sleep(0.2)
    detail = slurm.run("squeue", "-h", "-j", str(job_id), "-o", "%T %r %N", check=False).stdout
    nodes = slurm.run("sinfo", "-N", "-h", "-o", "%N %t %E", check=False).stdout
    raise AssertionError(f"job {job_id} did not start within {timeout_s}s: {detail} / {nodes}")


async def until_quiet(count: Callable[[], int], quiet_s: float, what: str, within_s: float = 60) -> None:
    """Wait until `count()` (requests an API server saw) stays the same for `quiet_s`; fail when it
    has not within `within_s`: the worker went on with `what` after the run let it go."""
    loop = asyncio.get_running_loop()
    began = last_change = loop.time()
    seen = count()
    while loop.time() - last_change < quiet_s:
        assert loop.time() - began < within_s, f"the worker went on with {what} after the run was aborted"
        await asyncio.sleep(0.5)
        if (now := count()) != seen:
            seen, last_change = now, loop.time()


__all__ = ["provider_controller", "set_ready"]
