"""An upgrade while runbooks are in flight: runs that the previous release's worker started are
finished by this checkout's worker (docs/upgrading.md).

The previous release is installed from git into a virtualenv of its own (its source, this
checkout's locked dependencies). Its `fleetmedic worker` starts the runs, and is killed while each
waits — in line for a lease, for an approval, for the provider's replacement, in a burn-in, at an
escalation; then this checkout's `fleetmedic worker` takes over, and the operator (or the world)
gives the run what it waited for. Each run must end as it would have, with its effects once —
counted where the systems record them (the apiserver's audit log, slurmctld's log, the provider's
record) — and no workflow task may fail: a change to a step that the old histories do not replay
fails here (shown with an unguarded extra timer before the lease, not committed).
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from temporalio.api.enums.v1 import EventType
from temporalio.client import WorkflowHandle

from devstack import fleet
from devstack.controllers import provider_controller
from devstack.processes import FleetMedicProcess
from fleetmedic.ids import node_workflow_id
from fleetmedic.models import Approval, NodeRunbookInput, RunbookStatus
from fleetmedic.policy import Policy
from tests.conftest import require
from tests.harness import quick_policy
from tests.runbook_stack import Stack, status_when

ROOT = Path(__file__).resolve().parent.parent
RELEASE_HEADING = re.compile(r"^## (\d+\.\d+\.\d+)\b", re.M)


# What a test does with the runs it started: wait for them to reach a wait, or give them what they wait for.
Step = Callable[[list[WorkflowHandle[Any, RunbookStatus]]], Awaitable[None]]


@dataclass(frozen=True)
class Release:
    version: str
    commit: str
    python: str  # the interpreter of its virtualenv
    root: Path  # where it is installed: its workers start there


def git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=60,
                          check=True).stdout.strip()


def previous_release() -> tuple[str, str] | None:
    """(version, commit) of the newest release in CHANGELOG.md: its tag `v<version>`, or — on a
    clone that did not fetch tags — the commit that added its heading to CHANGELOG.md."""
    found = RELEASE_HEADING.search((ROOT / "CHANGELOG.md").read_text())
    if found is None or shutil.which("git") is None or not (ROOT / ".git").exists():
        return None
    version = found.group(1)
    try:
        return version, git("rev-parse", f"v{version}^{{commit}}")
    except subprocess.CalledProcessError:
        added = git("log", "--format=%H", "--reverse", "-S", f"## {version} ", "--", "CHANGELOG.md").split()
        return (version, added[0]) if added else None


@pytest.fixture(scope="session")
def release(tmp_path_factory: pytest.TempPathFactory) -> Release:
    """The previous release's own code in a virtualenv of its own. Its dependencies are this
    checkout's (a .pth line to this virtualenv's site-packages, whose editable FleetMedic is not
    loaded from there): a release that changed a locked dependency needs that lock installed instead."""
    found = previous_release()
    require(found is not None, "the previous release's commit (a v* tag, or CHANGELOG.md's history in git)")
    assert found is not None
    version, commit = found
    root = tmp_path_factory.mktemp(f"release-{version}")
    archive = root / "source.tar"
    with open(archive, "wb") as out:
        subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", commit], stdout=out, check=True, timeout=60)
    source = root / "source"
    with tarfile.open(archive) as tar:
        tar.extractall(source, filter="data")
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True, timeout=30).stdout.strip()
    Path(site, "fleetmedic-release.pth").write_text(f"{source}\n{sysconfig.get_paths()['purelib']}\n")
    # The worker it runs is the release's, not this checkout's.
    where = subprocess.run([str(python), "-P", "-c", "import workflows, fleetmedic; print(workflows.__file__); "
                            "print(fleetmedic.__version__)"], capture_output=True, text=True, timeout=60,
                           cwd=ROOT)  # even from this checkout's root
    assert where.returncode == 0, where.stderr
    path, installed = where.stdout.split()
    assert Path(path).is_relative_to(source) and installed == version, where.stdout
    return Release(version, commit, str(python), root)


# Policy keys added since the previous release (a site adds them once every old worker is gone).
NEWER_POLICY_KEYS = {"budget": ["protective"], "traffic": ["start_from_kueue", "kueue_resync"]}
NEWER_POLICY_SECTIONS = ("crash", "slurm")  # the job-failures runbook's, the Slurm mapping (0.2.0)


@dataclass
class Upgrade:
    """One test's two workers over the same Temporal, Kubernetes and Slurm: the release's, then ours."""

    stack: Stack
    release: Release
    policy: Policy

    def env(self) -> dict[str, str]:
        stack = self.stack
        policy_file = stack.tmp_path / "policy.yaml"
        # The policy file both workers read, as a site's ConfigMap is during a rollout: keys the
        # previous release does not know yet are left out (it refuses unknown keys, on purpose).
        policy = self.policy.serving(stack.task_queue).model_dump(mode="json", by_alias=True)
        for section, keys in NEWER_POLICY_KEYS.items():
            for key in keys:
                policy.get(section, {}).pop(key, None)
        for section in NEWER_POLICY_SECTIONS:
            policy.pop(section, None)
        policy_file.write_text(yaml.safe_dump(policy))
        return {**os.environ, "TEMPORAL_ADDRESS": stack.client.service_client.config.target_host,
                "FLEETMEDIC_TASK_QUEUE": stack.task_queue, "FLEETMEDIC_POLICY": str(policy_file),
                "KUBECONFIG": str(stack.kube.kubeconfig), "FLEETMEDIC_KUBE_TIMEOUT": "4",
                "FLEETMEDIC_SLURM": "on", "SLURM_CONF": str(stack.slurm.conf), "FLEETMEDIC_SLURM_TIMEOUT": "6",
                "SLACK_BOT_TOKEN": "xoxb-test", "FLEETMEDIC_SLACK_CHANNEL": "#fleet",
                "FLEETMEDIC_SLACK_API_URL": stack.slack.api_url, "FLEETMEDIC_METRICS_PORT": "0",
                "FLEETMEDIC_PROVIDER_TOKEN": stack.provider.token or ""}

    async def start(self, node: str) -> WorkflowHandle[Any, RunbookStatus]:
        stack = self.stack
        return await stack.client.start_workflow(
            "xid-recovery", NodeRunbookInput(cluster=stack.cluster, node=node, gpu=3, xid=79),
            id=node_workflow_id("xid-recovery", stack.cluster, node), task_queue=stack.task_queue,
            result_type=RunbookStatus)

    async def run(self, nodes: list[str], waiting: Step, then: Step, timeout: float = 240) -> list[RunbookStatus]:
        """Start a run per node on the release's worker; once `waiting` says they wait where the test
        wants them, kill that worker (as a rollout's kill -9 would) and start ours; `then` gives the
        runs what they wait for. Returns how each ended."""
        env, log = self.env(), self.stack.tmp_path / "worker.log"
        old = FleetMedicProcess(["worker"], env, log, python=self.release.python, cwd=self.release.root)
        new = FleetMedicProcess(["worker"], env, log)
        old.start()
        handles: list[WorkflowHandle[Any, RunbookStatus]] = []
        try:
            handles = [await self.start(node) for node in nodes]
            await waiting(handles)
            old.kill()
            new.start()
            await then(handles)
            return [await asyncio.wait_for(h.result(), timeout) for h in handles]
        except BaseException:
            for handle in handles:
                status = await handle.query("status", result_type=RunbookStatus)
                print(f"{handle.id} left at {status.step}, waiting for {status.waiting_for}: {status.decisions}")
                await handle.terminate("test failed")
            print(log.read_text()[-4000:])
            raise
        finally:
            old.stop(5)
            new.stop(10)


@pytest.fixture
def upgrade(stack: Stack, release: Release) -> Callable[..., Upgrade]:
    def make(**policy: Any) -> Upgrade:
        return Upgrade(stack, release, quick_policy(
            stack.tmp_path, provider={"kind": "http", "http": {"url": stack.provider.url}},
            xid={"catalog": {79: {"job_lost": False}}},
            # A killed worker's activities move on after 8 s, not the default 2 minutes.
            retries={"call_timeout": "8s", "wait_heartbeat": "10s"}, **policy))
    return make


async def no_task_failed(handle: WorkflowHandle[Any, Any]) -> None:
    history = await handle.fetch_history()
    failed = [e for e in history.events if e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED]
    assert not failed, [e.workflow_task_failed_event_attributes.failure.message for e in failed]


DRAIN_DOWN_IDLE = [["DRAINED", "DOWN", "IDLE"], ["DRAINING", "DOWN", "IDLE"]]


def effects_once(stack: Stack, node: str, states: list[list[str]] = DRAIN_DOWN_IDLE) -> None:
    """The node cordoned and uncordoned once (the apiserver's audit log), its Slurm states once each
    in order (slurmctld's log: DRAIN, DOWN, back to IDLE), the provider asked once."""
    writes = [r for r in stack.kube.mutations() if r.url.path == f"/api/v1/nodes/{node}" and r.code < 300]
    cordons = [w for w in writes if (w.data or {}).get("spec", {}).get("unschedulable") is True]
    uncordons = [w for w in writes if "unschedulable" in (w.data or {}).get("spec", {})
                 and not w.data["spec"]["unschedulable"]]
    assert (len(cordons), len(uncordons)) == (1, 1), [w.data for w in writes]
    log = (stack.slurm.dir / "log" / "slurmctld.log").read_text()
    seen = re.findall(rf"update_node: node {node} state set to (\w+)", log)
    assert [s for s in seen if s in ("DRAINING", "DRAINED", "DOWN", "IDLE")] in states, seen
    assert [r["node"] for r in stack.provider.accepted()].count(node) == 1, stack.provider.accepted()


async def approve(handle: WorkflowHandle[Any, Any]) -> None:
    await status_when(handle, lambda s: s.awaiting_approval == "replace", 90, worker_swapped=True)
    await handle.execute_update("approve", Approval(by="erin", reason="after the upgrade"))


async def test_a_run_in_line_for_its_lease_and_one_waiting_for_approval(stack: Stack,
                                                                        upgrade: Callable[..., Upgrade]) -> None:
    """One run holds the only lease and waits for an approval; the other waits in line behind it."""
    up = upgrade(approvals={"steps": ["replace"]}, budget={"max_concurrent": 1})
    started: list[WorkflowHandle[Any, RunbookStatus]] = []
    order: list[WorkflowHandle[Any, RunbookStatus]] = []  # the lease holder first

    async def waiting(handles: list[WorkflowHandle[Any, RunbookStatus]]) -> None:
        started.extend(handles)
        deadline = asyncio.get_running_loop().time() + 90
        while not order:
            statuses = [await h.query("status", result_type=RunbookStatus) for h in handles]
            holder = [h for h, s in zip(handles, statuses, strict=True) if s.awaiting_approval == "replace"]
            in_line = [h for h, s in zip(handles, statuses, strict=True) if (s.waiting_for or "").startswith("lease")]
            if holder and in_line:
                order.extend(holder + in_line)
            assert asyncio.get_running_loop().time() < deadline, statuses
            await asyncio.sleep(0.3)

    async def then(handles: list[WorkflowHandle[Any, RunbookStatus]]) -> None:
        await approve(order[0])
        await approve(order[1])  # granted the lease once the first gave it back

    with provider_controller(stack.kube, stack.provider):
        reports = await up.run(["gpu-node-0", "gpu-node-1"], waiting, then)

    assert [r.outcome for r in reports] == ["remediated", "remediated"], [r.decisions for r in reports]
    for node, report in zip(["gpu-node-0", "gpu-node-1"], reports, strict=True):
        assert any(d.result == "approved by erin: after the upgrade" for d in report.decisions), report.decisions
        effects_once(stack, node)
    for handle in started:
        await no_task_failed(handle)


async def test_a_run_waiting_for_the_providers_replacement(stack: Stack, upgrade: Callable[..., Upgrade]) -> None:
    """The provider took the request under the release's worker; the machine comes back under ours."""
    up = upgrade()
    handles: list[WorkflowHandle[Any, RunbookStatus]] = []

    async def waiting(started: list[WorkflowHandle[Any, RunbookStatus]]) -> None:
        handles.extend(started)
        await status_when(started[0], lambda s: bool(stack.provider.accepted()) and s.waiting_for is not None
                          and s.step in ("find replacement", "wait for node Ready"), timeout=90)

    controller = provider_controller(stack.kube, stack.provider)

    async def then(started: list[WorkflowHandle[Any, RunbookStatus]]) -> None:
        controller.__enter__()

    try:
        [report] = await up.run(["gpu-node-1"], waiting, then)
    finally:
        controller.__exit__(None, None, None)

    assert report.outcome == "remediated", report.decisions
    effects_once(stack, "gpu-node-1")
    await no_task_failed(handles[0])


async def test_a_run_in_its_burn_in(stack: Stack, upgrade: Callable[..., Upgrade]) -> None:
    """The burn-in job runs in Slurm when the release's worker dies: ours takes the job over (one
    job, not a second one) and returns the node when it passes."""
    up = upgrade(burn_in={"enabled": True, "deadline": "2m", "output_dir": str(stack.tmp_path / "burn-in"),
                          "script": "#!/bin/sh\nsleep 25\necho 'dcgmi diag -r 2: Pass'\n",
                          "pass_pattern": r"diag -r 2: Pass"})
    handles: list[WorkflowHandle[Any, RunbookStatus]] = []

    def burn_in_jobs() -> list[str]:
        out = stack.slurm.run("squeue", "-h", "-t", "all", "-o", "%i %j %T").stdout.split("\n")
        return [f[2] for f in (line.split() for line in out) if len(f) == 3 and "burnin" in f[1]]

    async def waiting(started: list[WorkflowHandle[Any, RunbookStatus]]) -> None:
        handles.extend(started)
        await status_when(started[0], lambda s: "the burn-in job" in (s.waiting_for or "")
                          and "RUNNING" in burn_in_jobs(), timeout=120)

    async def then(started: list[WorkflowHandle[Any, RunbookStatus]]) -> None:
        pass

    with provider_controller(stack.kube, stack.provider):
        [report] = await up.run(["gpu-node-2"], waiting, then)

    assert report.outcome == "remediated", report.decisions
    assert any(d.step == "burn-in" and d.result.startswith("passed") for d in report.decisions), report.decisions
    assert burn_in_jobs() == ["COMPLETED"], burn_in_jobs()  # one job: the new worker followed it
    # The burn-in resumed the node inside its reservation once and DRAINed it again once.
    effects_once(stack, "gpu-node-2", [["DRAINED", "DOWN", "IDLE", "DRAINED", "IDLE"]])
    await no_task_failed(handles[0])


async def test_a_run_waiting_for_an_answer_to_its_escalation(stack: Stack, upgrade: Callable[..., Upgrade]) -> None:
    """A pod whose PodDisruptionBudget allows no eviction holds the drain past its deadline: the run
    escalates under the release's worker, and the operator's `skip` reaches ours."""
    stack.kube.put(fleet.pdb("frozen", namespace="inference", match_labels={"app": "frozen"}, min_available=1))
    stack.kube.put(fleet.pod("frozen-0", "gpu-node-0", namespace="inference", labels={"app": "frozen"}))
    up = upgrade(grace={"checkpoint": "5s", "eviction_deadline": "5s"})
    handles: list[WorkflowHandle[Any, RunbookStatus]] = []

    async def waiting(started: list[WorkflowHandle[Any, RunbookStatus]]) -> None:
        handles.extend(started)
        await status_when(started[0], lambda s: "escalation of drain" in (s.waiting_for or ""), timeout=120)

    async def then(started: list[WorkflowHandle[Any, RunbookStatus]]) -> None:
        # The CLI asks the run first: once the new worker answers (not the dead one's sticky queue).
        await status_when(started[0], lambda s: s.escalation is not None, 90, worker_swapped=True)
        answered = await asyncio.to_thread(stack.cli, "answer", started[0].id, "skip", "--by", "erin",
                                           "--reason", "frozen-0 is a test pod")
        assert answered.returncode == 0, answered.stderr

    with provider_controller(stack.kube, stack.provider):
        [report] = await up.run(["gpu-node-0"], waiting, then)

    assert report.outcome == "remediated", report.decisions
    assert "past their PodDisruptionBudget: inference/frozen-0" in report.decisions[-1].result, report.decisions
    effects_once(stack, "gpu-node-0")
    await no_task_failed(handles[0])


REPLAY = """
import asyncio, sys
from temporalio.client import WorkflowHistory
from temporalio.worker import Replayer
from fleetmedic.converter import data_converter
from workflows.fleet_guard import FleetGuard

async def main() -> None:
    history = WorkflowHistory.from_json("fleet-guard/upgrade", open(sys.argv[1]).read())
    result = await Replayer(workflows=[FleetGuard], data_converter=data_converter).replay_workflow(
        history, raise_on_replay_failure=False)
    print(type(result.replay_failure).__name__, result.replay_failure)

asyncio.run(main())
"""


def without_newer_policy_keys(history: dict[str, Any]) -> int:
    """The policy a run read, as the site's is during a roll: without the keys the previous release
    does not know (it refuses them). Returns how many policy reads were changed."""
    changed = 0
    for event in history["events"]:
        result = event.get("markerRecordedEventAttributes", {}).get("details", {}).get("result")
        for payload in (result or {}).get("payloads", []):
            policy = json.loads(base64.b64decode(payload["data"]))
            if not (isinstance(policy, dict) and "budget" in policy):
                continue
            for section, keys in NEWER_POLICY_KEYS.items():
                for key in keys:
                    policy[section].pop(key, None)
            for section in NEWER_POLICY_SECTIONS:
                policy.pop(section, None)
            payload["data"] = base64.b64encode(json.dumps(policy).encode()).decode()
            changed += 1
    return changed


def test_the_previous_release_cannot_run_a_guard_that_takes_batches(release: Release, tmp_path: Path) -> None:
    """The rollout rule of the guard's batch signals (workflows/fleet_guard.py BATCH_SIGNALS): a
    worker sends `requests` / `releases` only to a guard run whose memo says it takes them, and only
    a run whose own code published that says it. Here the previous release's code replays such a
    run, recorded by this checkout: it must stop at the run's first patch marker (the worker's task
    fails and is given to a new worker, the batches still in the history), not go on without a
    handler for them."""
    history = json.loads((ROOT / "tests/histories/fleet-guard-takes-batches.json").read_text())
    assert without_newer_policy_keys(history) == 1
    assert any(e.get("workflowExecutionSignaledEventAttributes", {}).get("signalName") == "requests"
               for e in history["events"])
    path = tmp_path / "guard.json"
    path.write_text(json.dumps(history))
    replayed = subprocess.run([release.python, "-P", "-c", REPLAY, str(path)], capture_output=True, text=True,
                              timeout=120, cwd=release.root)
    assert replayed.returncode == 0, replayed.stderr[-2000:]
    verdict = replayed.stdout.strip().splitlines()[-1]  # (the SDK's core logs to stdout before it)
    assert verdict.startswith("NondeterminismError"), replayed.stdout[-2000:]
    assert "TMPRL1100" in verdict and "patch marker" in verdict, verdict


async def test_the_previous_release_runs_a_run_this_webhook_started_with_its_alert(stack: Stack,
                                                                                   release: Release) -> None:
    """This checkout's webhook starts a run with the alert in its input and no start signal
    (workers/open_runs.py), and during a roll the previous release's worker may run it: that worker
    must take the input's alert as the run's first. Then a copy of it from another webhook replica,
    a signal while the run watches for repeats, is no new occurrence; were the input's alert not
    taken, the copy would be classified as a second XID 13."""
    from fleetmedic.models import Alert
    from fleetmedic.policy import RoutingPolicy
    from tests.alerts import xid_alert
    from workers.webhook import AlertReceiver, available_runbooks

    def replica() -> AlertReceiver:  # each with its own memory of runs and copies
        return AlertReceiver(stack.client, RoutingPolicy(clusters=[stack.cluster]), stack.task_queue, None,
                             available_runbooks())

    up = Upgrade(stack, release, quick_policy(stack.tmp_path, xid={"application_burst": {"count": 5, "window": "8s"}}))
    old = FleetMedicProcess(["worker"], up.env(), stack.tmp_path / "worker.log", python=release.python,
                            cwd=release.root)
    old.start()
    try:
        alert = Alert.model_validate(xid_alert("gpu-node-0", stack.cluster, xid=13, fingerprint="fp-13"))
        first = await replica().handle(alert)
        assert (first.action, first.code) == ("started", "new_run"), first
        handle = stack.client.get_workflow_handle(str(first.workflow_id), result_type=RunbookStatus)
        await status_when(handle, lambda s: s.step == "watch for repeats", 30)
        copy = await replica().handle(alert)  # the other replica finds the run open and signals it
        assert (copy.action, copy.code) == ("attached", "running_run"), copy
        report = await asyncio.wait_for(handle.result(), 90)
        assert report.outcome == "notified", report.decisions
        assert [d.step for d in report.decisions].count("classify") == 1, report.decisions
        await no_task_failed(handle)
    except BaseException:
        print((stack.tmp_path / "worker.log").read_text()[-4000:])
        raise
    finally:
        old.stop(5)
