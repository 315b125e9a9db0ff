"""The command line: the commands of DESIGN.md, and honesty about what is not built yet."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from temporalio.client import Client

from activities.start import RUNBOOK_TASK_TIMEOUT
from fleetmedic.models import RunbookStatus

DESIGN_COMMANDS = ["dev", "worker", "webhook", "agent", "run", "pause", "resume", "status", "audit"]


def fleetmedic(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "workers.cli", *args], capture_output=True, text=True, timeout=60,
                          env=env)


def test_help_lists_every_command() -> None:
    done = fleetmedic("--help")
    assert done.returncode == 0
    for command in DESIGN_COMMANDS:
        assert command in done.stdout


def test_agent_without_its_node_name_stops_and_says_which_variable() -> None:
    done = fleetmedic("agent", "--port", "0", env={"PATH": "/usr/bin:/bin"})
    assert done.returncode == 2 and "NODE_NAME is not set" in done.stderr


def test_run_needs_a_node() -> None:
    done = fleetmedic("run", "xid-recovery")
    assert done.returncode == 2 and "--node" in done.stderr


def test_a_cluster_runbook_refuses_node_options_instead_of_ignoring_them() -> None:
    done = fleetmedic("run", "traffic-flip", "--node", "gpu-1")
    assert done.returncode == 2 and "takes no --node" in done.stderr


async def test_run_refuses_an_xid_recovery_without_its_xid_before_starting_anything(client: Client,
                                                                                     task_queue: str) -> None:
    address = client.service_client.config.target_host
    env = {"FLEETMEDIC_TASK_QUEUE": task_queue, "FLEETMEDIC_CLUSTER": f"c-{task_queue}", "PATH": "/usr/bin:/bin"}
    done = fleetmedic("run", "xid-recovery", "--node", "n1", "--gpu", "3", "--address", address, env=env)
    assert done.returncode == 2 and "--xid is required" in done.stderr, done.stderr
    assert [w async for w in client.list_workflows(f'WorkflowId = "xid-recovery/c-{task_queue}/n1"')] == []


async def test_run_starts_once_per_node_and_status_lists_it(client: Client, task_queue: str) -> None:
    # No worker polls this queue: the run stays open, as a runbook waiting for a worker would.
    address = client.service_client.config.target_host
    env = {"FLEETMEDIC_TASK_QUEUE": task_queue, "FLEETMEDIC_CLUSTER": f"c-{task_queue}", "PATH": "/usr/bin:/bin"}
    first = fleetmedic("run", "xid-recovery", "--node", "n1", "--gpu", "3", "--xid", "79", "--dry-run",
                       "--address", address, env=env)
    second = fleetmedic("run", "xid-recovery", "--node", "n1", "--gpu", "3", "--xid", "79",
                        "--address", address, env=env)
    assert first.returncode == 0 and second.returncode == 0, first.stderr + second.stderr
    workflow_id = f"xid-recovery/c-{task_queue}/n1"
    assert first.stdout.split()[0] == workflow_id
    assert first.stdout.split()[2] == second.stdout.split()[2]  # the same run: attached, not started twice
    status = fleetmedic("status", "--address", address, env=env)
    assert status.returncode == 0 and workflow_id in status.stdout, status.stdout + status.stderr
    assert "WORKFLOW" in status.stdout and "WAITING FOR" in status.stdout  # a header
    as_json = fleetmedic("status", "-o", "json", "--cluster", f"c-{task_queue}", "--address", address,
                         env={**env, "FLEETMEDIC_CLUSTER": "elsewhere"})
    assert as_json.returncode == 0, as_json.stderr
    listed = json.loads(as_json.stdout)
    assert listed["cluster"] == f"c-{task_queue}" and [r["workflow_id"] for r in listed["runs"]] == [workflow_id]
    # The UI's list shows what the run is about, not "No summary available".
    described = await client.get_workflow_handle(workflow_id).describe()
    assert await described.static_summary() == f"xid-recovery n1 in c-{task_queue} (XID 79, GPU 3) — " \
                                                "started by cli (shadow)"
    details = await described.static_details()
    assert details is not None and "**Node** n1" in details and "**Started by** `cli (fleetmedic run)`" in details
    assert "**Shadow mode**" in details and f"fleetmedic audit {workflow_id}" in details
    handle = client.get_workflow_handle(workflow_id, result_type=RunbookStatus)
    started = (await handle.fetch_history()).events[0].workflow_execution_started_event_attributes
    assert started.workflow_task_timeout.ToTimedelta() == RUNBOOK_TASK_TIMEOUT  # as the webhook starts it
    await handle.terminate("test over")


@pytest.mark.parametrize("runbook", ["traffic-flip", "migrate-back", "kueue-quota-sync"])
async def test_run_starts_a_cluster_runbook_under_its_cluster_id(client: Client, task_queue: str,
                                                                 runbook: str) -> None:
    address = client.service_client.config.target_host
    env = {"FLEETMEDIC_TASK_QUEUE": task_queue, "FLEETMEDIC_CLUSTER": f"c-{task_queue}", "PATH": "/usr/bin:/bin"}
    first = fleetmedic("run", runbook, "--dry-run", "--address", address, env=env)
    second = fleetmedic("run", runbook, "--address", address, env=env)
    assert first.returncode == 0 and second.returncode == 0, first.stderr + second.stderr
    workflow_id = f"{runbook}/c-{task_queue}"
    assert first.stdout.split()[0] == workflow_id and "shadow mode" in first.stdout
    assert first.stdout.split()[2] == second.stdout.split()[2]  # attached, not started twice
    await client.get_workflow_handle(workflow_id).terminate("test over")


def test_unreachable_temporal_is_a_clear_error() -> None:
    done = fleetmedic("status", "--address", "127.0.0.1:9")
    assert done.returncode == 1 and "Temporal" in done.stderr


def test_webhook_refuses_to_start_without_a_token() -> None:
    done = fleetmedic("webhook", "--port", "0", env={"PATH": "/usr/bin:/bin"})
    assert done.returncode == 2 and "FLEETMEDIC_WEBHOOK_TOKEN is not set" in done.stderr


def test_version() -> None:
    done = fleetmedic("--version")
    assert done.returncode == 0 and done.stdout.startswith("fleetmedic 0.1.0"), done.stdout + done.stderr


@pytest.mark.parametrize("command", [
    ["approve", "wf-1"], ["reject", "wf-1", "--by", "bob"], ["abort", "wf-1"], ["answer", "wf-1", "retry"],
    ["replaced", "wf-1", "--by", "a", "--new-node", "x/y"]])
def test_decisions_need_a_name_and_a_reason_before_anything_is_sent(command: list[str]) -> None:
    done = fleetmedic(*command, "--address", "127.0.0.1:1", env={"PATH": "/usr/bin:/bin", "USER": ""})
    assert done.returncode == 2 and done.stderr.count("\n") <= 3, done.stderr
    assert "--by is required" in done.stderr or "--reason is required" in done.stderr or "--new-node" in done.stderr


@pytest.mark.parametrize("command", [["status"], ["worker"]])
def test_an_unreachable_temporal_is_one_line_not_a_traceback(command: list[str]) -> None:
    done = fleetmedic(*command, "--address", "127.0.0.1:1", env={"PATH": "/usr/bin:/bin"})
    assert done.returncode == 1, (done.returncode, done.stderr[-500:])
    assert "cannot reach Temporal at 127.0.0.1:1" in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_a_closed_pipe_ends_quietly() -> None:
    """`fleetmedic audit … | head`: the reader goes away; no BrokenPipe traceback."""
    proc = subprocess.Popen([sys.executable, "-m", "workers.cli", "policy", "default"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # before it writes a byte
    err = proc.stderr.read()
    assert proc.wait(30) == 141 and "Traceback" not in err, err
