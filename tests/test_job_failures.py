"""Let it crash; if it persists, find the node — against real Slurm (its jobcomp script posting to
the real webhook), the real control plane and Temporal, counted from outside: scontrol, the
apiserver's audit log, the runs' histories."""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.service import RPCError

from devstack import fleet
from devstack.controllers import provider_controller
from devstack.kube_world import RealKube
from devstack.slurm_cluster import LocalSlurmCluster, missing_binaries
from devstack.standins import ProviderStandIn, SlackStandIn
from devstack.webhook_thread import WebhookThread
from fleetmedic.ids import cluster_workflow_id, node_workflow_id
from fleetmedic.job_failures import SuspectNodeInput
from fleetmedic.models import RunbookStatus
from fleetmedic.policy import Policy, RoutingPolicy
from tests.conftest import require
from tests.harness import quick_policy, settings_for, worker_for
from tests.runbook_stack import fleetmedic_cli, save_history, wait_for
from workers.audit import audit_command
from workers.webhook import AlertReceiver, available_runbooks
from workflows.job_failures import JobsReport

TOKEN = "webhook-secret"
NODES = tuple(f"gpu-{i}" for i in range(1, 7))
BAD = "gpu-3"
JOBCOMP = Path(__file__).resolve().parents[1] / "deploy" / "slurm" / "fleetmedic-jobcomp"
# A 3-node training job: with the bad node in its allocation, its collective times out.
TRAINING = """#!/bin/sh
nodes=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | tr '\\n' ' ')
echo "restart=${SLURM_RESTART_COUNT:-0} nodes=$nodes"
sleep 1
case " $nodes " in %s)
  echo "[rank 4] NCCL WARN Timeout: watchdog caught collective operation timeout after 600000 ms"
  exit 1 ;;
esac
echo "epoch done"
"""
ALWAYS_FAILS = TRAINING % "*"


def jobcomp_wrapper(tmp_path: Path, url: str) -> Path:
    """The shipped script as a site installs it: its settings in a root-only env file."""
    token = tmp_path / "webhook-token"
    token.write_text(TOKEN)
    env = tmp_path / "jobcomp.env"
    env.write_text(f"FLEETMEDIC_URL={url}\nFLEETMEDIC_TOKEN_FILE={token}\n")
    wrapper = tmp_path / "jobcomp"
    wrapper.write_text(f"#!/bin/sh\nFLEETMEDIC_JOBCOMP_ENV={env} exec {JOBCOMP}\n")
    wrapper.chmod(0o755)
    return wrapper


class World:
    def __init__(self, client: Client, task_queue: str, kube: RealKube, slurm: LocalSlurmCluster,
                 webhook: WebhookThread, tmp_path: Path, slack: SlackStandIn, provider: ProviderStandIn) -> None:
        self.client, self.task_queue, self.kube, self.slurm = client, task_queue, kube, slurm
        self.webhook, self.tmp_path, self.slack, self.provider = webhook, tmp_path, slack, provider

    @property
    def cluster(self) -> str:
        return self.task_queue

    def policy(self, **overrides: Any) -> Policy:
        crash = {"output_roots": [str(self.slurm.dir / "log")], "reconcile_every": "2s", **overrides.pop("crash", {})}
        return quick_policy(self.tmp_path, crash=crash, provider={"kind": "http", "http": {"url": self.provider.url}},
                            **overrides)

    def worker(self, policy: Policy) -> Any:
        settings = settings_for(self.task_queue, self.kube, slurm=self.slurm, slack=self.slack, provider=self.provider)
        return worker_for(self.client, settings, policy)

    def job(self, job_id: int) -> dict[str, str]:
        line = self.slurm.run("scontrol", "show", "job", "-o", str(job_id)).stdout.strip()
        return dict(f.split("=", 1) for f in line.split() if "=" in f)

    async def report(self) -> JobsReport:
        handle = self.client.get_workflow_handle(cluster_workflow_id("job-failures", self.cluster))
        return await handle.query("jobs", result_type=JobsReport)

    async def report_or_none(self) -> JobsReport:
        try:
            return await self.report()
        except RPCError:
            return JobsReport(cluster=self.cluster, now=datetime.now(UTC), jobs=[], ettr=None, trials=[], held=[],
                              decisions=[])

    async def report_when(self, ready: Any, what: str, timeout: float = 90) -> JobsReport:
        deadline = time.monotonic() + timeout
        report: JobsReport | None = None
        while time.monotonic() < deadline:
            try:
                report = await self.report()
                if ready(report):
                    return report
            except RPCError:
                pass
            await asyncio.sleep(0.5)
        raise AssertionError(f"not within {timeout:g} s: {what}; the runbook has "
                             f"{report.decisions if report else 'not started'}")

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        return fleetmedic_cli(self.client, self.task_queue, self.cluster, *args)

    async def stop_runs(self) -> None:
        await stop_open_runs(self.client, self.task_queue)


@pytest.fixture
async def world(client: Client, task_queue: str, kube: RealKube, slack: SlackStandIn, provider_http: ProviderStandIn,
                tmp_path: Path) -> AsyncIterator[World]:
    missing = missing_binaries()
    require(not missing, f"Debian's Slurm and munge ({', '.join(missing)})")
    for name in NODES:
        kube.put(fleet.node(name))
    with WebhookThread(client.service_client.config.target_host, task_queue, TOKEN,
                       routing=RoutingPolicy(clusters=[task_queue], default_cluster=task_queue)) as webhook:
        workdir = tmp_path / "slurm"
        workdir.mkdir()
        with LocalSlurmCluster(NODES, workdir=workdir, job_comp_script=jobcomp_wrapper(tmp_path, webhook.url)) as slurm:
            w = World(client, task_queue, kube, slurm, webhook, tmp_path, slack, provider_http)
            try:
                yield w
            finally:
                await w.stop_runs()


def steer(world: World, job: int, plan: dict[int, str]) -> None:
    """Plays a busy cluster: each time the job waits for its restart, the nodes others hold (as
    `ExcNodeList`) make Slurm give it another allocation. `plan`: restart count → nodes held."""
    state = world.job(job)
    restarts = int(state.get("Restarts", "0"))
    if state.get("JobState") == "PENDING" and restarts in plan and state.get("ExcNodeList") != plan[restarts]:
        world.slurm.run("scontrol", "update", f"jobid={job}", f"ExcNodeList={plan[restarts]}")


async def test_a_job_that_keeps_failing_on_one_node_names_it_and_then_runs_to_completion(world: World) -> None:
    # Allocations vary ({2,3,4}, {1,3,4}, {1,2,3}): only gpu-3 is in all three failed ones.
    plan = {0: "gpu-1,gpu-5,gpu-6", 1: "gpu-2,gpu-5,gpu-6", 2: "gpu-4,gpu-5,gpu-6", 3: "gpu-5,gpu-6"}
    policy = world.policy(burn_in={"enabled": True, "script": "#!/bin/sh\nexit 1\n", "deadline": "60s",
                                   "output_dir": str(world.tmp_path / "burn-in")})
    async with world.worker(policy):
        job = world.slurm.submit(TRAINING % f'*" {BAD} "*', "-N", "3", "--exclude", plan[0])
        deadline = time.monotonic() + 150
        while world.job(job).get("JobState") != "COMPLETED":
            assert time.monotonic() < deadline, f"job {job} did not complete: {world.job(job)}"
            steer(world, job, plan)
            await asyncio.sleep(0.2)
        report = await world.report_when(lambda r: any(t.node == BAD for t in r.trials) and any(
            x["job"] == str(job) and x["state"] == "completed" for x in r.jobs), "the trial of gpu-3, the job's end")
        suspect = world.client.get_workflow_handle(node_workflow_id("suspect-node", world.cluster, BAD))
        status = await suspect.query("status", result_type=RunbookStatus)
        await save_history(world.client.get_workflow_handle(cluster_workflow_id("job-failures", world.cluster)),
                      "job-failures-restarted-then-trial")
        table = await asyncio.to_thread(world.cli, "jobs", "--cluster", world.cluster)
        as_json = await asyncio.to_thread(world.cli, "jobs", "--cluster", world.cluster, "-o", "json")

    final = world.job(job)
    # scontrol: FleetMedic restarted it after each failure, and it finished away from the bad node.
    assert final["JobState"] == "COMPLETED" and int(final["Restarts"]) == 3, final
    assert BAD not in world.slurm.run("scontrol", "show", "hostnames", final["NodeList"]).stdout.split()
    # The suspect is out of service in Slurm and Kubernetes (the apiserver's audit log: FleetMedic cordoned it).
    assert "DRAIN" in world.slurm.node_states(BAD) or "DOWN" in world.slurm.node_states(BAD)
    cordons = [r for r in world.kube.mutations() if r.url.path == f"/api/v1/nodes/{BAD}"
               and (r.data or {}).get("spec", {}).get("unschedulable") is True]
    assert cordons, "the suspect was not cordoned"
    assert not any(r.url.path in (f"/api/v1/nodes/{n}" for n in NODES if n != BAD) for r in world.kube.mutations())
    # Why, with the numbers: in the job-failures runbook and in the suspect's own run.
    [trial] = report.trials
    assert trial.why == (f"{BAD} was in 3 of the last 3 failed allocations of job {job} (NCCL timeout); "
                         "the other 3 node(s) varied")
    assert any(d.step == "classify" and trial.why in d.result for d in status.decisions)
    [row] = [r for r in report.jobs if r["job"] == str(job)]
    assert row["failures"] == 3 and row["restarts"] == 3 and row["by_cause"] == {"nccl": 3}
    assert row["state"] == "completed" and 0 < row["ettr"] < 1
    # `fleetmedic jobs`: the job, its failures and ETTR, the trial and why.
    assert table.returncode == 0, table.stderr
    [line] = [ln for ln in table.stdout.splitlines() if ln.startswith(f"{job} ")]
    assert line.split()[1:4] == ["completed", "3", "3"] and "nccl ×3" in line
    assert f"trial  {BAD}" in table.stdout and "3 of the last 3 failed allocations" in table.stdout
    assert json.loads(as_json.stdout)["jobs"][0]["job"] == str(job)
    # Every end came from Slurm's own push (the reconciliation found nothing new to add).
    assert sum("let it crash" in d.what for d in report.decisions) == 3, [d.what for d in report.decisions]


async def test_failures_with_no_common_node_take_nobody_out_and_stop_at_the_restart_bound(world: World) -> None:
    # Bad code: it fails wherever it lands, and the allocations share no node.
    plan = {0: "gpu-4,gpu-5,gpu-6", 1: "gpu-1,gpu-2,gpu-3", 2: "gpu-1,gpu-2,gpu-3"}
    policy = world.policy(crash={"max_restarts": 2})
    async with world.worker(policy):
        job = world.slurm.submit(ALWAYS_FAILS, "-N", "3", "--exclude", plan[0])
        deadline = time.monotonic() + 120
        while not any(x["job"] == str(job) and x["stopped"] for x in (await world.report_or_none()).jobs):
            assert time.monotonic() < deadline, f"the restart bound was not reached: {world.job(job)}"
            steer(world, job, plan)
            await asyncio.sleep(0.2)
        report = await world.report()
        await save_history(world.client.get_workflow_handle(cluster_workflow_id("job-failures", world.cluster)),
                      "job-failures-restarts-stopped")
    assert report.trials == [] and report.held == []
    [row] = [r for r in report.jobs if r["job"] == str(job)]
    assert row["failures"] == 3 and row["restarts"] == 2 and row["stopped"].startswith("2 restarts within 1d")
    assert world.job(job)["JobState"] == "FAILED"  # not restarted a third time (scontrol)
    assert not [r for r in world.kube.mutations() if r.url.path.startswith("/api/v1/nodes/")]
    assert any("FleetMedic stopped restarting it" in m.get("text", "") for m in world.slack.messages)


async def test_a_job_that_failed_while_fleetmedic_was_down_is_still_counted(world: World) -> None:
    policy = world.policy()
    async with world.worker(policy):  # the runbook exists and has looked once
        await world.client.start_workflow("job-failures", {"cluster": world.cluster},
                                          id=cluster_workflow_id("job-failures", world.cluster),
                                          task_queue=world.task_queue)
        await world.report_when(lambda r: True, "the runbook's first look")
    # Worker and webhook down: Slurm's push is lost (the script gives up quietly).
    world.webhook.__exit__(None, None, None)
    job = world.slurm.submit(ALWAYS_FAILS, "-N", "1")
    deadline = time.monotonic() + 30
    while world.job(job).get("JobState") != "FAILED":
        assert time.monotonic() < deadline, world.job(job)
        await asyncio.sleep(0.2)
    async with world.worker(policy):
        report = await world.report_when(lambda r: any(x["job"] == str(job) for x in r.jobs), "the reconciled end")
        # FleetMedic restarted it (scontrol): wait_for fails the test if not within 30 s.
        await asyncio.to_thread(wait_for, lambda: int(world.job(job)["Restarts"]) >= 1, 30)
    assert report.jobs[0]["failures"] == 1


async def suspect_trial(world: World, policy: Policy, node: str, scenario: str) -> RunbookStatus:
    handle = await world.client.start_workflow(
        "suspect-node", SuspectNodeInput(cluster=world.cluster, node=node, evidence="named by the test").model_dump(),
        id=node_workflow_id("suspect-node", world.cluster, node), task_queue=world.task_queue,
        result_type=RunbookStatus)
    with provider_controller(world.kube, world.provider, 1.0):
        async with world.worker(policy):
            status = await asyncio.wait_for(handle.result(), 180)
    await save_history(handle, f"suspect-node-{scenario}")
    return status


async def test_a_suspect_that_passes_its_burn_in_returns_and_one_that_fails_is_replaced(world: World) -> None:
    burn_in = {"enabled": True, "deadline": "60s", "output_dir": str(world.tmp_path / "burn-in"), "rounds": 1}
    passing = await suspect_trial(world, world.policy(burn_in={**burn_in, "script": "#!/bin/sh\necho ok\n"}), "gpu-1",
                                  "burn-in-passed")
    assert passing.outcome == "recovered", passing
    assert any("cleared of suspicion" in d.result for d in passing.decisions), passing.decisions
    assert not world.kube.get("v1", "Node", "gpu-1")["spec"].get("unschedulable")
    assert world.slurm.node_states("gpu-1") & {"IDLE", "MIXED", "ALLOCATED"}, world.slurm.node_states("gpu-1")

    failing = await suspect_trial(world, world.policy(burn_in={**burn_in, "script": "#!/bin/sh\nexit 1\n"}), "gpu-2",
                                  "burn-in-failed-replaced")
    assert any(d.step == "burn-in" and d.result.startswith("failed") for d in failing.decisions), failing
    assert any(d.step == "replace" for d in failing.decisions), failing.decisions


async def test_a_suspect_with_no_burn_in_to_try_it_stays_out_for_a_person(world: World) -> None:
    """No trial, no sentence: without a burn-in nothing can clear the node or convict it."""
    # burn_in off, as the default policy has it
    report = await suspect_trial(world, world.policy(), "gpu-4", "no-burn-in")
    assert report.outcome == "quarantined", report
    assert any(d.step == "burn-in" and d.result.startswith("no trial possible: policy burn_in is off")
               for d in report.decisions), report.decisions
    assert world.kube.get("v1", "Node", "gpu-4")["spec"].get("unschedulable") is True
    assert "DOWN" in world.slurm.node_states("gpu-4") or "DRAIN" in world.slurm.node_states("gpu-4")
    assert world.provider.by_key == {}  # the provider was never asked (its own record)
    assert not any(d.step == "replace" for d in report.decisions)


async def test_hostile_job_failure_posts_are_refused_counted_and_start_nothing(client: Client, task_queue: str) -> None:
    receiver = AlertReceiver(client, RoutingPolicy(clusters=[task_queue], default_cluster=task_queue), task_queue,
                             TOKEN, available_runbooks(), max_body=64 * 1024)
    transport = httpx.ASGITransport(app=receiver.app())
    async with httpx.AsyncClient(transport=transport, base_url="http://webhook",
                                 headers={"Authorization": f"Bearer {TOKEN}"}) as http:
        assert (await http.post("/v1/jobs/ended", content=b"{not json")).status_code == 400
        assert (await http.post("/v1/jobs/ended", json={"jobs": "x"})).status_code == 400
        assert (await http.post("/v1/jobs/ended", json={"jobs": [{}] * 501})).status_code == 400
        assert (await http.post("/v1/jobs/ended", content=b"x" * 70000)).status_code == 413
        assert (await http.post("/v1/jobs/ended", json={"jobs": []}, headers={"Authorization": "Bearer no"})
                ).status_code == 401
        now = datetime.now(UTC).isoformat()
        bad = [{"job": "1", "nodes": ["../../etc"], "ended_at": now},
               {"job": "2", "nodes": ["n1"], "ended_at": now, "cluster": "someone-elses"},
               {"job": "3; rm -rf /", "nodes": ["n1"], "ended_at": now},
               {"job": "4", "nodes": ["n1"], "ended_at": now, "state": "EXPLODED"},
               {"job": "5", "nodes": ["n1"] * 5000, "ended_at": now},
               {"job": "7", "nodes": ["n1"], "ended_at": "2099-01-01T00:00:00Z"},
               {"job": "6", "nodes": ["n1"], "ended_at": now, "state": "RUNNING"},
               "not an object"]
        # A batch that is not a list of objects is refused whole; one bad entry among objects alone.
        assert (await http.post("/v1/jobs/ended", content=json.dumps({"jobs": bad}))).status_code == 400
        answer = await http.post("/v1/jobs/ended", content=json.dumps({"jobs": bad[:7]}))
        assert answer.status_code == 202
        entries = answer.json()["jobs"]
        assert [a["action"] for a in entries] == ["refused"] * 6 + ["ignored"]
        assert "is in the future" in entries[5]["reason"]
        assert "not a valid Kubernetes node name" in entries[0]["reason"]
        assert "not served by this FleetMedic" in entries[1]["reason"]
        # Slurm's form: a requeue is not an end; a hostlist that is not one is refused.
        form = {"JOBID": "9", "JOBSTATE": "PENDING", "NODES": "n1", "END": "1796357004"}
        assert (await http.post("/v1/jobs/slurm", data=form)).json()["jobs"][0]["action"] == "ignored"
        form.update(JOBSTATE="FAILED", NODES="gpu-[1")
        assert (await http.post("/v1/jobs/slurm", data=form)).json()["jobs"][0]["action"] == "refused"
        metrics = (await http.get("/metrics")).text
    assert 'fleetmedic_webhook_job_ends_total{action="refused",reason="invalid"} 7.0' in metrics
    assert 'fleetmedic_webhook_job_ends_total{action="ignored",reason="not_an_end"} 2.0' in metrics
    # Nothing was started by refused or ignored entries.
    with pytest.raises(RPCError):
        await client.get_workflow_handle(cluster_workflow_id("job-failures", task_queue)).describe()


async def test_widespread_failures_read_as_software(client: Client, task_queue: str, kube: RealKube,
                                                    tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for name in NODES:
        kube.put(fleet.node(name))
    receiver = AlertReceiver(client, RoutingPolicy(clusters=[task_queue], default_cluster=task_queue), task_queue,
                             TOKEN, available_runbooks())
    settings = settings_for(task_queue, kube)
    policy = quick_policy(tmp_path)
    transport = httpx.ASGITransport(app=receiver.app())
    async with worker_for(client, settings, policy), httpx.AsyncClient(
            transport=transport, base_url="http://webhook", headers={"Authorization": f"Bearer {TOKEN}"}) as http:
        now = datetime.now(UTC)
        # 6 different jobs fail within a minute, each on gpu-3 and one other node: software, not gpu-3.
        ends = [{"source": "framework", "job": f"team-a/run-{i}", "nodes": [BAD, NODES[i % 6]], "state": "FAILED",
                 "ended_at": (now + timedelta(seconds=i)).isoformat(),
                 "output_lines": ["NCCL WARN Timeout: collective operation timeout"]} for i in range(6)]
        answer = await http.post("/v1/jobs/ended", json={"jobs": ends})
        assert [a["action"] for a in answer.json()["jobs"]] == ["recorded"] * 6
        handle = client.get_workflow_handle(cluster_workflow_id("job-failures", task_queue))
        deadline = time.monotonic() + 60
        while True:
            report = await handle.query("jobs", result_type=JobsReport)
            if len(report.jobs) == 6:
                break
            assert time.monotonic() < deadline, report
            await asyncio.sleep(0.3)
        await save_history(handle, "job-failures-widespread")
        # The audit of the open run: its decisions, as for any runbook.
        capsys.readouterr()
        assert await audit_command(client, handle.id, "md") == 0
        audit = capsys.readouterr().out
        await handle.terminate("test over")
    assert report.trials == [] and report.held == []
    assert any(d.what.startswith("widespread failures: 6 jobs failed within 30m on 6 nodes: looks like software")
               for d in report.decisions), report.decisions
    assert all(r["by_cause"] == {"nccl": 1} for r in report.jobs)
    assert "widespread failures: 6 jobs failed within 30m" in audit
    assert not [r for r in kube.mutations() if r.url.path.startswith("/api/v1/nodes/")]
    assert (await handle.describe()).status == WorkflowExecutionStatus.TERMINATED


def training_pod(name: str, node: str, index: int, job: str = "llm-a") -> dict[str, Any]:
    pod = fleet.pod(name, node, namespace="training", owner_kind="Job", owner_name=job, gpus=8,
                    labels={"batch.kubernetes.io/job-name": job,
                            "batch.kubernetes.io/job-completion-index": str(index)})
    pod["metadata"]["ownerReferences"][0]["apiVersion"] = "batch/v1"
    return pod


def fail_pod(kube: RealKube, name: str, message: str, exit_code: int = 1) -> None:
    """What the kubelet writes when a pod's container fails (restartPolicy Never): the pod Failed, its
    container terminated with the exit code and, with FallbackToLogsOnError, its log's tail as message."""
    now = datetime.now(UTC).replace(microsecond=0)
    status = {"phase": "Failed", "conditions": [], "containerStatuses": [{
        "name": "main", "image": "busybox:1.36", "imageID": "", "ready": False, "restartCount": 0,
        "state": {"terminated": {"exitCode": exit_code, "reason": "Error", "message": message,
                                 "startedAt": (now - timedelta(minutes=30)).isoformat().replace("+00:00", "Z"),
                                 "finishedAt": now.isoformat().replace("+00:00", "Z")}}}]}
    kube.dynamic.request("patch", f"/api/v1/namespaces/training/pods/{name}/status", body={"status": status},
                         content_type="application/merge-patch+json")


async def test_failed_pods_of_an_indexed_job_are_a_job_failure_left_to_the_job_to_restart(
        client: Client, task_queue: str, kube: RealKube, tmp_path: Path) -> None:
    for name in NODES:
        kube.put(fleet.node(name))
    for index, node in enumerate(NODES[:3]):
        kube.put(training_pod(f"llm-a-{index}", node, index))
    kube.put(fleet.pod("web-0", NODES[4], namespace="training"))  # not a training workload
    settings = settings_for(task_queue, kube)
    policy = quick_policy(tmp_path, crash={"reconcile_every": "1s"})
    async with worker_for(client, settings, policy):
        handle = await client.start_workflow("job-failures", {"cluster": task_queue},
                                             id=cluster_workflow_id("job-failures", task_queue), task_queue=task_queue)
        fail_pod(kube, "llm-a-1", "[rank 1] NCCL WARN Timeout: watchdog caught collective operation timeout\nbye")
        deadline = time.monotonic() + 60
        while not (report := await handle.query("jobs", result_type=JobsReport)).jobs:
            assert time.monotonic() < deadline, report.decisions
            await asyncio.sleep(0.3)
        await asyncio.sleep(3)  # a few more looks: the same failure is not counted twice
        report = await handle.query("jobs", result_type=JobsReport)
        await save_history(handle, "job-failures-kubernetes-pods")
        await handle.terminate("test over")
    [job] = report.jobs
    assert job["job"] == "training/llm-a" and job["source"] == "kubernetes" and job["failures"] == 1
    assert job["by_cause"] == {"nccl": 1} and job["nodes"] == sorted(NODES[:3])
    assert any("left to its own restart (kubernetes)" in d.what for d in report.decisions), report.decisions
    # Counted, never acted on: FleetMedic wrote nothing to the API.
    assert not [r for r in kube.mutations() if "/pods/" in r.url.path or r.url.path.startswith("/api/v1/nodes/")]


async def storm(client: Client, task_queue: str, kube: RealKube, tmp_path: Path, **crash: Any) -> JobsReport:
    """20 jobs fail within a minute across 40 nodes, 4 of which are in half of the failures each."""
    nodes = [f"node-{i:02d}" for i in range(40)]
    for name in nodes:
        kube.put(fleet.node(name))
    receiver = AlertReceiver(client, RoutingPolicy(clusters=[task_queue], default_cluster=task_queue), task_queue,
                             TOKEN, available_runbooks())
    policy = quick_policy(tmp_path, crash=crash)
    now = datetime.now(UTC)
    ends = [{"job": f"team/run-{i}", "nodes": [nodes[i % 2], nodes[2 + i % 2], nodes[4 + i], nodes[24 + i % 16]],
             "ended_at": (now + timedelta(seconds=3 * i)).isoformat(),
             "output_lines": ["NCCL WARN Timeout: collective operation timeout"]} for i in range(20)]
    async with worker_for(client, settings_for(task_queue, kube), policy), httpx.AsyncClient(
            transport=httpx.ASGITransport(app=receiver.app()), base_url="http://webhook",
            headers={"Authorization": f"Bearer {TOKEN}"}) as http:
        answer = await http.post("/v1/jobs/ended", json={"jobs": ends})
        assert [a["action"] for a in answer.json()["jobs"]] == ["recorded"] * 20
        handle = client.get_workflow_handle(cluster_workflow_id("job-failures", task_queue))
        deadline = time.monotonic() + 90
        while len((report := await handle.query("jobs", result_type=JobsReport)).jobs) < 20:
            assert time.monotonic() < deadline, report.decisions
            await asyncio.sleep(0.3)
        await asyncio.sleep(2)  # trials started, their protective steps done
    return report


def cordoned_by_fleetmedic(kube: RealKube) -> set[str]:
    return {r.url.path.rsplit("/", 1)[-1] for r in kube.mutations() if r.url.path.startswith("/api/v1/nodes/")
            and (r.data or {}).get("spec", {}).get("unschedulable") is True}


async def test_a_storm_of_job_failures_reads_as_software_and_takes_nobody_out(
        client: Client, task_queue: str, kube: RealKube, tmp_path: Path) -> None:
    report = await storm(client, task_queue, kube, tmp_path)
    assert report.trials == [] and report.held == []
    assert any(d.what.startswith("widespread failures: ") for d in report.decisions)
    assert cordoned_by_fleetmedic(kube) == set()
    await stop_open_runs(client, task_queue)


async def test_a_storm_that_names_nodes_sends_no_more_to_trial_than_the_hourly_bound(
        client: Client, task_queue: str, kube: RealKube, tmp_path: Path) -> None:
    # A site that turned the widespread rule off (50 jobs): the four nodes in half the failures are
    # suspects, and crash.max_suspects_per_hour (2) is all that goes to trial; the others wait.
    report = await storm(client, task_queue, kube, tmp_path, widespread_jobs=50, max_suspects_per_hour=2)
    assert len(report.trials) == 2 and {t.node for t in report.trials} < {"node-00", "node-01", "node-02", "node-03"}
    hot = {"node-00", "node-01", "node-02", "node-03"}
    assert {h.node for h in report.held} == hot - {t.node for t in report.trials}
    assert all("different jobs" in t.why and "P = " in t.why for t in report.trials)
    # Counted from the API server: at most the two on trial were ever cordoned.
    assert cordoned_by_fleetmedic(kube) <= {t.node for t in report.trials}
    await stop_open_runs(client, task_queue)


async def stop_open_runs(client: Client, task_queue: str) -> None:
    async for run in client.list_workflows(f'TaskQueue = "{task_queue}" AND ExecutionStatus = "Running"'):
        await client.get_workflow_handle(run.id).terminate("test over")
