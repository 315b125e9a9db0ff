"""Replacements as providers really make them: a new machine under a new node name.

For each provider (cluster-api, karpenter, http, manual) an xid-recovery whose node is replaced
by `gpu-node-41`: the run follows the replacement, holds it out of Slurm and Kubernetes until it
is validated, returns it, and the training job resumes there (the only other Slurm node is the
bad one); and one where no replacement comes (escalation). Then burn-in: a job that passes, and
one that fails (back to the provider, then quarantine). Real control plane with the real CRDs,
real Slurm (a spare host whose slurmd starts when its machine boots), the Temporal dev server.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from temporalio.api.history.v1 import HistoryEvent
from temporalio.api.sdk.v1 import WorkflowMetadata
from temporalio.client import Client, WorkflowHandle, WorkflowHistory

from devstack import fleet
from devstack.controllers import set_ready
from devstack.kube_world import RealKube
from devstack.provider_controllers import (
    Replacing,
    cluster_api_controller,
    http_replacing_controller,
    karpenter_controller,
)
from devstack.slurm_cluster import LocalSlurmCluster, missing_binaries
from devstack.standins import ProviderStandIn, SlackStandIn
from fleetmedic.models import EscalationAnswer, Operator, Replaced, RunbookStatus
from fleetmedic.policy import Policy
from tests.conftest import require
from tests.gate_check import cancels_requested, scheduled_events
from tests.harness import CHECKPOINTING_JOB, job_on, quick_policy, until_quiet
from tests.runbook_stack import Stack, status_when
from workers.audit import render_markdown, timeline

OLD, NEW, NEWER = "gpu-node-0", "gpu-node-41", "gpu-node-42"
PROVIDERS = ["cluster-api", "karpenter", "http", "manual"]
CAPI_NAMESPACE = "capi"


@pytest.fixture
async def replacing(client: Client, task_queue: str, kube: RealKube, slack: SlackStandIn,
                    provider_http: ProviderStandIn, tmp_path: Path) -> AsyncIterator[Stack]:
    """One Slurm node in service (the bad one) and spare hosts the provider brings: a requeued job
    can only resume on the replacement."""
    missing = missing_binaries()
    require(not missing, f"Debian's Slurm and munge ({', '.join(missing)})")
    workdir = tmp_path / "slurm"
    workdir.mkdir()
    with LocalSlurmCluster((OLD,), workdir=workdir, spare_nodes=(NEW, NEWER)) as slurm:
        stack = Stack(client, task_queue, kube, slurm, slack, provider_http, tmp_path)
        stack.seed()
        # No other replica runs (one GPU node): the inference PDB would hold the drain up to its deadline.
        kube.remove("policy/v1", "PodDisruptionBudget", "serve", "inference")
        yield stack


def provider_policy(stack: Stack, provider: str) -> dict[str, Any]:
    """The policy's provider section, and the old node as that provider knows it."""
    kube = stack.kube
    if provider == "cluster-api":
        kube.put(fleet.capi_cluster(namespace=CAPI_NAMESPACE))
        machine_set = kube.put(fleet.machine_set("gpu-md-0", namespace=CAPI_NAMESPACE))
        kube.put(fleet.machine_health_check("gpu-mhc", namespace=CAPI_NAMESPACE))
        kube.put(fleet.machine("gpu-md-0-abc12", namespace=CAPI_NAMESPACE, node=OLD, machine_set=machine_set,
                               finalizer=True))
        kube.put(fleet.node(OLD, annotations={
            "cluster.x-k8s.io/machine": "gpu-md-0-abc12", "cluster.x-k8s.io/cluster-namespace": CAPI_NAMESPACE,
            "cluster.x-k8s.io/owner-kind": "MachineSet", "cluster.x-k8s.io/owner-name": "gpu-md-0"}))
        return {"kind": "cluster-api", "cluster_api": {"namespace": CAPI_NAMESPACE}}
    if provider == "karpenter":
        kube.put(fleet.nodeclaim("gpu-x7k2p", node=OLD, finalizer=True))
        kube.put(fleet.node(OLD, labels={"karpenter.sh/nodepool": "gpu"}))
        return {"kind": "karpenter"}
    if provider == "http":
        return {"kind": "http", "http": {"url": stack.provider.url}}
    return {"kind": "manual"}


def world(stack: Stack, provider: str, names: list[str], replace: bool = True) -> AbstractContextManager[Replacing]:
    """The provider's controller: what makes (or never makes) the new machine."""
    boot = stack.slurm.boot
    if provider == "cluster-api":
        return cluster_api_controller(stack.kube, names, namespace=CAPI_NAMESPACE, boot=boot, replace=replace)
    if provider == "karpenter":
        return karpenter_controller(stack.kube, names, boot=boot, replace=replace)
    if provider == "http":
        return http_replacing_controller(stack.kube, stack.provider, names, boot=boot, replace=replace)
    return nothing()


@contextmanager
def nothing() -> Iterator[Replacing]:
    yield Replacing()  # the manual provider: a person does it (see person_replaces)


def person_replaces(stack: Stack, new: str, waits_for: str = "`replaced`") -> Callable[[WorkflowHandle[Any, Any]], Any]:
    """The manual provider's person (or one who gives up on the provider's): swaps the machine,
    then says so with the CLI, once the run waits for `waits_for`."""
    async def during(handle: WorkflowHandle[Any, Any]) -> None:
        await status_when(handle, lambda s: waits_for in (s.waiting_for or ""), timeout=90)
        set_ready(stack.kube, OLD, False)
        stack.kube.put(fleet.node(new))
        done = await asyncio.to_thread(stack.cli, "replaced", handle.id, "--new-node", new, "--by", "alice")
        assert done.returncode == 0, done.stderr
        # The new host's slurmd starts once the run holds the node (docs/providers.md, manual).
        await status_when(handle, lambda s: any(d.step == "take in replacement" and "DRAIN" in d.result
                                                for d in s.decisions), timeout=60)
        stack.slurm.boot(new)
    return during


def job_log(policy: Policy, job: int) -> list[str]:
    return (Path(policy.storage.root) / f"{job}.log").read_text().splitlines()


async def run_xid(stack: Stack, provider: str, policy: Policy, names: list[str], *, replace: bool = True,
                  during: Any = None) -> tuple[RunbookStatus, WorkflowHandle[Any, RunbookStatus], Replacing]:
    if provider == "manual" and replace and during is None:
        during = person_replaces(stack, names[0])
    with world(stack, provider, names, replace) as done:
        report, handle = await stack.run(OLD, policy=policy, controller=False, during=during, timeout=150)
    return report, handle, done


@pytest.mark.parametrize("provider", PROVIDERS)
async def test_a_replacement_under_a_new_name_serves_and_training_resumes_there(replacing: Stack,
                                                                                 provider: str) -> None:
    stack = replacing
    policy = quick_policy(stack.tmp_path, provider=provider_policy(stack, provider))
    job = stack.slurm.submit(CHECKPOINTING_JOB.format(root=policy.storage.root))
    assert job_on(stack.slurm, job) == OLD

    report, handle, done = await run_xid(stack, provider, policy, [NEW])

    assert report.outcome == "remediated", report
    outcome = next(d.result for d in report.decisions if d.step == "record outcome")
    assert f"{OLD} replaced by {NEW}" in outcome, outcome
    assert any(d.step == "take in replacement" and d.result == f"{OLD} replaced by {NEW}" for d in report.decisions)
    # Training resumed from its checkpoint on the new node (Slurm had no other node to run it on).
    log = job_log(policy, job)
    assert log[0].startswith(f"start host={OLD} restarts=0")
    assert log[-1].startswith(f"start host={NEW} restarts=1 step=1"), log
    # Slurm: the new node serves; the old one stays DOWN and says why.
    assert stack.slurm_state(NEW)[0] in ("idle", "mix", "alloc")
    assert "DOWN" in stack.slurm.node_states(OLD)
    assert stack.slurm_state(OLD)[1].startswith(f"fleetmedic: replaced by {NEW}")
    # Kubernetes: the new node schedulable and not a remediated node; the old Node object gone —
    # deleted by Cluster API and Karpenter themselves, by FleetMedic where the provider left it NotReady.
    new = stack.node(NEW)
    assert not new["spec"].get("unschedulable")
    assert not {"fleetmedic.io/workflow", "fleetmedic.io/remediations"} & set(new["metadata"].get("annotations", {}))
    assert stack.kube.get("v1", "Node", OLD) is None
    node_deletes = [r for r in stack.kube.mutations() if r.verb == "delete" and r.url.path == f"/api/v1/nodes/{OLD}"]
    assert len(node_deletes) == (1 if provider in ("http", "manual") else 0)
    # What the provider did, counted from its side.
    if provider == "cluster-api":
        assert done.removed == ["gpu-md-0-abc12"] and len(done.created) == 1
        machines = stack.kube.list("cluster.x-k8s.io/v1beta2", "Machine", CAPI_NAMESPACE)
        assert [m["metadata"]["annotations"]["fleetmedic.io/replaces"] for m in machines] == [OLD]
    elif provider == "karpenter":
        assert done.removed == ["gpu-x7k2p"] and len(done.created) == 1
    elif provider == "http":
        assert [(r["node"], r["action"]) for r in stack.provider.accepted()] == [(OLD, "replace")]
    # The Slack thread and the audit say it in words.
    assert any(f"`{OLD}` replaced by `{NEW}`" in m["text"] for m in stack.slack.messages)
    audit = render_markdown(timeline(stack.client, await handle.fetch_history()))
    assert f"{OLD} replaced by {NEW}" in audit
    assert await (await handle.describe()).memo_value("outcome") == "remediated"  # the UI's list tells it apart


@pytest.mark.parametrize("provider", PROVIDERS)
async def test_no_replacement_within_the_deadline_escalates(replacing: Stack, provider: str) -> None:
    stack = replacing
    policy = quick_policy(stack.tmp_path, provider=provider_policy(stack, provider),
                          grace={"node_ready_deadline": "6s"})
    job = stack.slurm.submit(CHECKPOINTING_JOB.format(root=policy.storage.root))
    job_on(stack.slurm, job)

    escalated: list[str] = []

    async def operator_gives_up(handle: WorkflowHandle[Any, Any]) -> None:
        status = await status_when(handle, lambda s: s.escalation is not None, timeout=120)
        assert status.escalation is not None
        escalated.append(status.escalation.error)
        # The UI's Current Details say why the run waits and the command that answers it.
        details = (await handle.query("__temporal_workflow_metadata", result_type=WorkflowMetadata)).current_details
        assert status.escalation.error in details and f"fleetmedic answer {handle.id} retry|skip|abort" in details
        if provider == "manual":
            assert status.escalation.step == "replace"
            assert "nobody signalled `replaced` within" in status.escalation.error
        else:
            assert status.escalation.step == "find replacement"
            assert f"no replacement of {OLD} from {provider} within" in status.escalation.error
        await handle.signal("answer", EscalationAnswer(action="skip", by="alice", reason="hardware team on it"))

    report, _, _ = await run_xid(stack, provider, policy, [NEW], replace=False, during=operator_gives_up)

    assert report.outcome == "quarantined", report
    assert any("@oncall" in m["text"] and escalated[0] in m["text"] for m in stack.slack.messages)
    # Nothing was brought in: no job ran anywhere else, and the spare host stayed out of it.
    assert not any(line.startswith(f"start host={NEW}") for line in job_log(policy, job))
    assert "DOWN" in stack.slurm.node_states(OLD)
    assert stack.kube.get("v1", "Node", NEW) is None


SEARCHING = "cluster-api to bring the replacement"


def searches(history: WorkflowHistory) -> list[HistoryEvent]:
    return scheduled_events(history, "provider.find_replacement")


async def test_an_abort_ends_the_search_for_a_replacement_at_once(replacing: Stack) -> None:
    """The search for the new machine is one activity up to the run's deadline (30 minutes here),
    not a 5-minute window asked again: an operator's abort does not wait for it. The run ends
    `aborted` at once, and the search stops at its next heartbeat — the provider is asked no more."""
    stack = replacing
    policy = quick_policy(stack.tmp_path, provider=provider_policy(stack, "cluster-api"),
                          grace={"node_ready_deadline": "30m"}, retries={"wait_heartbeat": "10s"})
    job_on(stack.slurm, stack.slurm.submit(CHECKPOINTING_JOB.format(root=policy.storage.root)))

    machines = f"/apis/cluster.x-k8s.io/v1beta2/namespaces/{CAPI_NAMESPACE}/machines"

    def provider_looks() -> int:  # the search's looks, as the API server saw them
        return sum(1 for r in stack.kube.requests(("worker",)) if r.verb == "list" and r.url.path == machines)

    async def operator_aborts(handle: WorkflowHandle[Any, Any]) -> None:
        await status_when(handle, lambda s: SEARCHING in (s.waiting_for or ""), timeout=120)
        await handle.signal("abort", Operator(by="alice", reason="the rack is being decommissioned"))
        await asyncio.wait_for(handle.result(), 60)
        # The worker (still running) hears of the cancel with the search's next heartbeat (every
        # 8 s at 10 s) and stops it: no look at the Machines for longer than three 2-second looks.
        assert provider_looks() > 0
        await until_quiet(provider_looks, 6, "the search for a replacement")

    with world(stack, "cluster-api", [NEW], replace=False):
        report, handle = await stack.run(OLD, policy=policy, controller=False, during=operator_aborts, timeout=60)

    assert report.outcome == "aborted", report
    assert any("alice" in d.result and "decommissioned" in d.result for d in report.decisions), report.decisions
    history = await handle.fetch_history()
    [search] = searches(history)  # one search for the whole deadline, cancelled
    timeout = search.activity_task_scheduled_event_attributes.start_to_close_timeout.ToTimedelta()
    assert timeout > timedelta(minutes=29), timeout
    assert cancels_requested(history) == [search.event_id]
    assert "DOWN" in stack.slurm.node_states(OLD)  # what the run did stays


async def test_an_operator_who_names_the_replacement_ends_the_providers_search(replacing: Stack) -> None:
    """Cluster API never brings a machine; a person does and says so (`fleetmedic replaced
    --new-node`) while the run searches: the run follows that node at once, not at its deadline.
    A name that is no node's (the UI's signal form takes any text) is ignored, and the run says so."""
    stack = replacing
    policy = quick_policy(stack.tmp_path, provider=provider_policy(stack, "cluster-api"),
                          grace={"node_ready_deadline": "30m"})
    job = stack.slurm.submit(CHECKPOINTING_JOB.format(root=policy.storage.root))
    job_on(stack.slurm, job)

    person = person_replaces(stack, NEW, waits_for=SEARCHING)

    async def during(handle: WorkflowHandle[Any, Any]) -> None:
        # First a name that is no node's, as the UI's signal form would send it: ignored, said so.
        await status_when(handle, lambda s: SEARCHING in (s.waiting_for or ""), timeout=90)
        await handle.signal("replaced", Replaced(by="mallory", new_node="gpu-node-41 --all"))
        status = await status_when(handle, lambda s: any("ignored mallory's" in d.result for d in s.decisions),
                                   timeout=30)
        assert SEARCHING in (status.waiting_for or ""), status
        await person(handle)

    with world(stack, "cluster-api", [NEW], replace=False):
        report, handle = await stack.run(OLD, policy=policy, controller=False, timeout=120, during=during)

    assert report.outcome == "remediated", report
    assert any("not a valid Kubernetes node name" in d.result for d in report.decisions), report.decisions
    assert any(d.step == "find replacement" and d.result == f"alice named the replacement: {NEW}"
               for d in report.decisions), report.decisions
    assert any(d.step == "take in replacement" and d.result == f"{OLD} replaced by {NEW}" for d in report.decisions)
    assert job_log(policy, job)[-1].startswith(f"start host={NEW} restarts=1"), job_log(policy, job)
    [search] = searches(await handle.fetch_history())
    assert search.activity_task_scheduled_event_attributes.start_to_close_timeout.ToTimedelta() > timedelta(minutes=29)


BURN_IN = """#!/bin/sh
echo "burn-in host=$SLURMD_NODENAME" >> {log}
echo "dcgmi diag -r 2: {verdict}"
exit {code}
"""


def training_and_burn_in(stack: Stack, verdict: str, code: int, **burn_in: Any) -> tuple[int, Policy]:
    """A training job on the bad node, and a burn-in that writes into the job's log (so the order of
    burn-in and training on the new node is read from one file) and prints its verdict."""
    root = stack.tmp_path / "checkpoints"
    job = stack.slurm.submit(CHECKPOINTING_JOB.format(root=root))
    job_on(stack.slurm, job)
    policy = quick_policy(stack.tmp_path, provider=provider_policy(stack, "http"), burn_in={
        "enabled": True, "script": BURN_IN.format(log=root / f"{job}.log", verdict=verdict, code=code),
        "deadline": "60s", "output_dir": str(stack.tmp_path / "burn-in"), **burn_in})
    return job, policy


async def test_burn_in_passes_before_the_replacement_takes_training(replacing: Stack) -> None:
    stack = replacing
    job, policy = training_and_burn_in(stack, "Pass", 0, pass_pattern=r"diag -r 2: Pass")

    report, _, _ = await run_xid(stack, "http", policy, [NEW])

    assert report.outcome == "remediated", report
    assert any(d.step == "burn-in" and d.result.startswith("passed: job") for d in report.decisions)
    # The burn-in ran on the new node before the training job could start there: the job's own log.
    log = job_log(policy, job)
    assert log[-2:][0] == f"burn-in host={NEW}" and log[-1].startswith(f"start host={NEW} restarts=1"), log
    # The reservation that kept every other job off is gone.
    assert "fleetmedic-burnin" not in stack.slurm.run("scontrol", "show", "reservation").stdout


async def test_an_abort_during_the_burn_in_cancels_its_job(replacing: Stack) -> None:
    """The burn-in is a Slurm job up to its deadline (10 minutes here). An operator who aborts
    while it runs ends the run at once, and the worker cancels the job in Slurm at the burn-in's
    next heartbeat: the node is not tested for nobody, and it stays out of service."""
    stack = replacing
    root = stack.tmp_path / "checkpoints"
    job = stack.slurm.submit(CHECKPOINTING_JOB.format(root=root))
    job_on(stack.slurm, job)
    policy = quick_policy(stack.tmp_path, provider=provider_policy(stack, "http"), retries={"call_timeout": "10s"},
                          burn_in={"enabled": True, "deadline": "10m", "output_dir": str(stack.tmp_path / "burn-in"),
                                   "script": "#!/bin/sh\necho started\nsleep 600\n"})

    def burn_in_jobs() -> dict[str, str]:  # job id → state, as Slurm has them
        out = stack.slurm.run("squeue", "-h", "-t", "all", "-o", "%i %j %T").stdout.split("\n")
        return {f[0]: f[2] for f in (line.split() for line in out) if len(f) == 3 and "burnin" in f[1]}

    async def operator_aborts(handle: WorkflowHandle[Any, Any]) -> None:
        await status_when(handle, lambda s: "the burn-in job" in (s.waiting_for or "")
                          and "RUNNING" in burn_in_jobs().values(), timeout=120)
        aborted = await asyncio.to_thread(stack.cli, "abort", handle.id, "--by", "alice",
                                          "--reason", "the rack is being decommissioned")
        assert aborted.returncode == 0, aborted.stderr
        await asyncio.wait_for(handle.result(), 30)
        # The worker (still running) hears of the cancel at the burn-in's next heartbeat (every 8 s
        # at 10 s) and cancels the job.
        for _ in range(60):
            if "RUNNING" not in burn_in_jobs().values():
                break
            await asyncio.sleep(0.5)

    with world(stack, "http", [NEW]):
        report, handle = await stack.run(OLD, policy=policy, controller=False, during=operator_aborts, timeout=150)

    assert report.outcome == "aborted", report
    assert list(burn_in_jobs().values()) == ["CANCELLED"], burn_in_jobs()
    history = await handle.fetch_history()
    [burn_in] = scheduled_events(history, "slurm.burn_in")
    assert cancels_requested(history) == [burn_in.event_id]
    # Out of service as the run held it, and no reservation left behind.
    assert "DRAIN" in stack.slurm.node_states(NEW)
    assert "fleetmedic-burnin" not in stack.slurm.run("scontrol", "show", "reservation").stdout


async def test_a_failed_burn_in_goes_back_to_the_provider_then_quarantines(replacing: Stack) -> None:
    stack = replacing
    job, policy = training_and_burn_in(stack, "Fail (NVLink bandwidth)", 1, rounds=2)

    report, _, _ = await run_xid(stack, "http", policy, [NEW, NEWER])

    assert report.outcome == "quarantined", report
    failed = [d.result for d in report.decisions if d.step == "burn-in"]
    assert len(failed) == 2 and all(r.startswith("failed: job") and "exit code 1" in r for r in failed), failed
    assert "dcgmi diag -r 2: Fail (NVLink bandwidth)" in failed[0]
    # Back to the provider once, for the replacement that failed; then out of service.
    assert [(r["node"], r["action"]) for r in stack.provider.accepted()] == [(OLD, "replace"), (NEW, "replace")]
    assert stack.node(NEWER)["spec"]["unschedulable"] is True
    assert "failed its burn-in 2 time(s)" in stack.node(NEWER)["metadata"]["annotations"][
        "fleetmedic.io/quarantine-reason"]
    assert "DRAIN" in stack.slurm.node_states(NEWER)
    # Training never started on a machine that failed: only the burn-ins ran there.
    log = job_log(policy, job)
    assert [line for line in log if "host=gpu-node-4" in line] == [f"burn-in host={NEW}", f"burn-in host={NEWER}"]
