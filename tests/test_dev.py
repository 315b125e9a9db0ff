"""`fleetmedic dev` and `scripts/dev`: the UI and a polling worker on the real control plane, a runbook
runs, the README's tour as written, Ctrl-C stops everything."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
from temporalio.api.enums.v1 import TaskQueueType
from temporalio.api.taskqueue.v1 import TaskQueue
from temporalio.api.workflowservice.v1 import DescribeTaskQueueRequest
from temporalio.client import Client

from devstack.kube_cluster import BUILD_HINT as KUBE_BUILD_HINT
from devstack.kube_cluster import missing_binaries as missing_kube
from devstack.slurm_cluster import free_port
from fleetmedic.models import RunbookStatus
from tests.conftest import require

ROOT = Path(__file__).resolve().parent.parent


async def test_dev_stack_serves_the_ui_and_a_worker(tmp_path: Path) -> None:
    require(not missing_kube(), f"the Kubernetes control plane: {KUBE_BUILD_HINT}")
    port, ui_port, webhook_port = free_port(), free_port(), free_port()
    state = tmp_path / "state"
    proc = subprocess.Popen([sys.executable, "-m", "workers.cli", "dev", "--state-dir", str(state), "--port",
                             str(port), "--ui-port", str(ui_port), "--nodes", "3", "--webhook-port",
                             str(webhook_port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    started = time.monotonic()
    try:
        client = await _wait_for_worker(proc, port, ui_port, started)
        handle = await client.start_workflow(
            "xid-recovery", {"cluster": "default", "node": "gpu-node-1", "gpu": 2, "xid": 79, "dry_run": True},
            id="xid-recovery/default/gpu-node-1", task_queue="fleetmedic", result_type=RunbookStatus)
        report = await handle.result()
        assert report.outcome == "dry-run" and report.dry_run
        assert any(a.startswith("would cordon node gpu-node-1") for a in report.actions)
        # The dev webhook routes an alert to a runbook (an application XID: notify, touch nothing).
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{webhook_port}", timeout=10) as http:
            answer = await http.post("/v1/alerts/alertmanager", headers={"Authorization": "Bearer fleetmedic-dev"},
                                     json={"version": "4", "groupKey": "g", "status": "firing", "receiver": "r",
                                           "alerts": [{"status": "firing", "labels": {
                                               "alertname": "FleetMedicGpuXid", "node": "gpu-node-2", "xid": "13",
                                               "gpu": "0"}}]})
        assert answer.status_code == 202 and answer.json()["alerts"][0]["action"] == "started"
        # A second dev stack on the same ports stops at once and says why (it never attaches).
        second = subprocess.run([sys.executable, "-m", "workers.cli", "dev", "--state-dir", str(tmp_path / "two"),
                                 "--port", str(port), "--ui-port", str(ui_port), "--webhook-port", str(webhook_port)],
                                capture_output=True, text=True, timeout=60)
        assert second.returncode != 0 and f"port {port} (Temporal) is already in use" in second.stderr
        assert not (tmp_path / "two" / "temporal.db").exists()
    finally:
        proc.send_signal(signal.SIGINT)
        output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, output
    assert "Temporal UI  http://127.0.0.1:" in output
    assert (state / "temporal.db").exists()  # history kept across restarts
    leftovers = subprocess.run(["pgrep", "-f", str(state)], capture_output=True, text=True).stdout.split()
    assert [pid for pid in leftovers if int(pid) != os.getpid()] == []


async def _wait_for_worker(proc: subprocess.Popen[str], port: int, ui_port: int, started: float,
                           within: float = 60) -> Client:
    deadline = started + within
    client = None
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[0]
        try:
            if client is None:
                client = await Client.connect(f"127.0.0.1:{port}")
            ui = httpx.get(f"http://127.0.0.1:{ui_port}/", timeout=2)
            pollers = await client.workflow_service.describe_task_queue(DescribeTaskQueueRequest(
                namespace="default", task_queue=TaskQueue(name="fleetmedic"),
                task_queue_type=TaskQueueType.TASK_QUEUE_TYPE_WORKFLOW))
            if ui.status_code == 200 and pollers.pollers:
                from fleetmedic.converter import data_converter

                return await Client.connect(f"127.0.0.1:{port}", data_converter=data_converter)
        except (httpx.HTTPError, RuntimeError):
            pass
        await asyncio.sleep(0.5)
    raise AssertionError(f"the dev stack did not serve the UI with a polling worker within {within} s")


def test_dev_runs_under_a_site_policy_but_keeps_its_own_provider(tmp_path: Path) -> None:
    import yaml

    from devstack.dev import dev_policy_text
    from fleetmedic.policy import parse_policy

    site = tmp_path / "site.yaml"
    site.write_text("approvals: {steps: [replace]}\nprovider: {kind: cluster-api}\ngrace: {checkpoint: 10s}\n")
    policy = parse_policy(dev_policy_text(tmp_path, "http://127.0.0.1:9", site))
    assert policy.approvals.steps == ["replace"] and policy.grace.checkpoint.total_seconds() == 10
    assert policy.provider.kind == "http" and policy.provider.http.url == "http://127.0.0.1:9"
    assert policy.grace.node_ready_deadline.total_seconds() == 600  # the dev default under the site's
    assert yaml.safe_load(dev_policy_text(tmp_path, "u"))["storage"]["root"] == str(tmp_path / "checkpoints")


def listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


@contextlib.contextmanager
def default_state_dir_set_aside() -> Iterator[None]:
    """`scripts/dev` as written keeps its state in `.fleetmedic/dev` of the project: a developer's
    own state there is set aside while the test runs, and put back after."""
    state = ROOT / ".fleetmedic" / "dev"
    aside = ROOT / ".fleetmedic" / f"dev.aside-{os.getpid()}"
    had = state.exists()
    if had:
        state.rename(aside)
    try:
        yield
    finally:
        shutil.rmtree(state, ignore_errors=True)
        if had:
            aside.rename(state)


async def test_the_readme_tour_a_hot_gpu_confirmed_approved_replaced_and_validated(tmp_path: Path) -> None:
    """The README's first command and its tour, exactly as written: `scripts/dev --policy FILE` from
    the project root, on its default ports and state directory, on the real control plane; heat a GPU
    through the dev agents, start hot-gpu-pull from the CLI, approve it from the CLI; the agent's
    reading confirms the heat and, after the replacement, validates the node."""
    require(not missing_kube(), f"the Kubernetes control plane: {KUBE_BUILD_HINT}")
    taken = [port for port in (7233, 8233, 8080, 9400) if listening(port)]
    assert not taken, f"the README's ports {taken} are in use: the tour runs on the defaults"
    site = tmp_path / "approvals.yaml"
    site.write_text("approvals:\n  steps: [replace]\n")
    fleetmedic = str(ROOT / ".venv" / "bin" / "fleetmedic")

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([fleetmedic, *args], capture_output=True, text=True, timeout=120, cwd=ROOT)

    workflow_id = "hot-gpu-pull/default/gpu-node-1"
    with default_state_dir_set_aside():
        proc = subprocess.Popen(["scripts/dev", "--policy", str(site)], cwd=ROOT, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            client = await _wait_for_worker(proc, 7233, 8233, time.monotonic(), within=300)
            heated = httpx.post("http://127.0.0.1:9400/dev/gpu-node-1/gpus/3", json={"temperature_c": 84}, timeout=10)
            assert heated.status_code == 200, heated.text
            started = await asyncio.to_thread(cli, "run", "hot-gpu-pull", "--node", "gpu-node-1", "--gpu", "3",
                                              "--temperature", "84")
            assert started.returncode == 0, started.stdout + started.stderr
            handle = client.get_workflow_handle(workflow_id, result_type=RunbookStatus)
            deadline = time.monotonic() + 120
            while (status := await handle.query("status", result_type=RunbookStatus)).awaiting_approval is None:
                assert status.outcome is None and time.monotonic() < deadline, status
                await asyncio.sleep(0.5)
            assert status.awaiting_approval == "replace"
            waiting = await asyncio.to_thread(cli, "status")
            assert workflow_id in waiting.stdout and "approval" in waiting.stdout, waiting.stdout
            approved = await asyncio.to_thread(cli, "approve", workflow_id, "--by", "tour")
            assert approved.returncode == 0, approved.stdout + approved.stderr
            report = await asyncio.wait_for(handle.result(), 180)
            decided = {d.step: d.result for d in report.decisions}
            assert report.outcome == "remediated", report.decisions
            assert decided["confirm still hot"].startswith("still hot: GPU 3 84"), decided
            assert decided["validate"] == "passed", decided  # the new GPUs, read by the node agent
            audit = await asyncio.to_thread(cli, "audit", workflow_id)
            assert "| update | approve by tour |" in audit.stdout, audit.stdout  # who approved, in the audit
        finally:
            proc.send_signal(signal.SIGINT)  # Ctrl-C: scripts/dev exec'd fleetmedic dev, same PID
            output, _ = proc.communicate(timeout=90)
        assert proc.returncode == 0, output
        assert "Node agents  http://127.0.0.1:9400/<node>" in output
        # On the real control plane, started in the default state dir, said part by part.
        assert "real control plane" in output and "fleetmedic dev: starting Kubernetes" in output, output
        assert (ROOT / ".fleetmedic" / "dev" / "kube").is_dir()


def test_the_dev_server_ends_with_what_started_it(tmp_path: Path) -> None:
    """A benchmark or a test run killed mid-way (a timeout's SIGKILL) leaves no Temporal dev server
    behind, as it leaves no apiserver or slurmctld: the server gets SIGTERM when its starter dies."""
    starter = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from pathlib import Path\n"
         "from devstack.dev import DevOptions, start_temporal\n"
         "from devstack.slurm_cluster import free_port\n"
         f"server = start_temporal(DevOptions(state_dir=Path({str(tmp_path)!r}), port=free_port(), "
         "ui_port=free_port()), persist=False)\n"
         "print(server.pid, flush=True)\n"
         "time.sleep(120)\n"],
        cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert starter.stdout is not None
    server = int(starter.stdout.readline())
    try:
        os.kill(server, 0)  # it runs
        starter.kill()
        starter.wait()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                # Gone, or a zombie waiting for whichever process adopted it to reap it: it has ended.
                if Path(f"/proc/{server}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                    return
            except (FileNotFoundError, ProcessLookupError):
                return
            time.sleep(0.2)
        raise AssertionError(f"the dev server (pid {server}) was still running 30 s after its starter died")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(server, signal.SIGKILL)
