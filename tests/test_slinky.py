"""Slurm on Kubernetes as Crusoe runs it: Slinky's NodeSets (policy `slurm.mapping: slinky`).

The real control plane with a NodeSet CRD written from Slinky's API, the operator's stand-in
(devstack/slinky_operator.py: slurmd pods on the nodes, each a real slurmd registering as the
Slurm node named after its pod, cordon ↔ drain as its docs say), real Slurm, the Temporal dev
server. Counted from outside: slurmctld's log and scontrol, the apiserver's audit log, the job's
own log, the operator's record of its writes.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from kubernetes import client
from temporalio.client import Client

from devstack import fleet
from devstack.kube_world import RealKube
from devstack.provider_controllers import http_replacing_controller
from devstack.slinky_operator import POD_CORDON, SlinkyOperator, nodeset, slinky_operator
from devstack.slurm_cluster import LocalSlurmCluster, missing_binaries
from devstack.standins import ProviderStandIn, SlackStandIn
from fleetmedic.policy import Policy
from tests.conftest import require
from tests.harness import CHECKPOINTING_JOB, job_on, quick_policy
from tests.runbook_stack import Stack, wait_for

# Kubernetes names the machines; the NodeSet names the Slurm nodes after its pods, in the order of
# the nodes' names: h100-d4's slurmd pod is gpu-ns-3.
MACHINES = ("h100-a7", "h100-b2", "h100-c9", "h100-d4")
BAD, SLURM_BAD, NEW = "h100-d4", "gpu-ns-3", "h100-e1"
SLINKY = {"mapping": "slinky", "slinky": {"namespace": "slurm", "nodesets": ["gpu-ns"]}}


@pytest.fixture
async def slinky(client: Client, task_queue: str, kube: RealKube, slack: SlackStandIn,
                 provider_http: ProviderStandIn, tmp_path: Path) -> AsyncIterator[tuple[Stack, SlinkyOperator]]:
    missing = missing_binaries()
    require(not missing, f"Debian's Slurm and munge ({', '.join(missing)})")
    workdir = tmp_path / "slurm"
    workdir.mkdir()
    # No slurmd but the pods': the Slurm nodes are the names the NodeSet's pods take.
    pods = tuple(f"gpu-ns-{i}" for i in range(len(MACHINES) + 2))
    with LocalSlurmCluster((), workdir=workdir, spare_nodes=pods) as slurm:
        for name in MACHINES:
            kube.put(fleet.node(name))
        kube.ensure_namespace("slurm")
        kube.put(nodeset("gpu-ns", node_selector={fleet.GPU_LABEL: "true"}))
        with slinky_operator(kube, slurm) as operator:
            wait_for(lambda: all(in_service(slurm, f"gpu-ns-{i}") for i in range(4)), timeout=60)
            yield Stack(client, task_queue, kube, slurm, slack, provider_http, tmp_path), operator


def policy(stack: Stack) -> Policy:
    return quick_policy(stack.tmp_path, provider={"kind": "http", "http": {"url": stack.provider.url}},
                        slurm=SLINKY)


def in_service(slurm: LocalSlurmCluster, node: str) -> bool:
    try:
        return slurm.node_state(node)[0].rstrip("*") in ("idle", "mix", "alloc")
    except Exception:
        return False


def slurmctld_updates(slurm: LocalSlurmCluster) -> list[tuple[str, str]]:
    """(node, what) of every node update slurmctld logged: `reason set to: …`, `state set to …`."""
    log = (slurm.dir / "log" / "slurmctld.log").read_text(errors="replace")
    return re.findall(r"update_node: node (\S+) (reason set to: .*|state set to \S+)", log)


@contextmanager
def only_on(slurm: LocalSlurmCluster, node: str, others: list[str]) -> Iterator[None]:
    """A person holds the other nodes while a job starts, so it starts on `node`."""
    slurm.run("scontrol", "update", f"nodename={','.join(others)}", "state=DRAIN", "reason=test: job placement")
    try:
        yield
    finally:
        slurm.run("scontrol", "update", f"nodename={','.join(others)}", "state=RESUME")


async def test_xid79_on_a_slinky_node_takes_out_its_slurmd_pod_and_follows_the_replacement(
        slinky: tuple[Stack, SlinkyOperator]) -> None:
    stack, operator = slinky
    slurm, kube = stack.slurm, stack.kube
    pol = policy(stack)
    others = [f"gpu-ns-{i}" for i in range(3)]
    with only_on(slurm, SLURM_BAD, others):
        job = slurm.submit(CHECKPOINTING_JOB.format(root=pol.storage.root))
        assert job_on(slurm, job) == SLURM_BAD

    with http_replacing_controller(kube, stack.provider, [NEW]):
        report, handle = await stack.run(BAD, policy=pol, controller=False, timeout=150)

    assert report.outcome == "remediated", report.decisions
    assert any(d.step == "take in replacement" and d.result == f"{BAD} replaced by {NEW}" for d in report.decisions)
    # The job on gpu-ns-3 was signalled, checkpointed, requeued and resumed on another Slurm node.
    log = (Path(pol.storage.root) / f"{job}.log").read_text().splitlines()
    assert log[0].startswith(f"start host={SLURM_BAD} restarts=0"), log
    assert any(line.startswith("sigterm") and f"host={SLURM_BAD}" in line for line in log), log
    assert re.match(r"start host=gpu-ns-[0124] restarts=1 step=1", log[-1]), log
    # slurmctld: the bad node's slurmd pod DOWN, and nothing ever asked of a Slurm node named
    # after a Kubernetes node.
    updates = slurmctld_updates(slurm)
    assert not [u for u in updates if u[0].startswith("h100-")], updates
    assert "update_node: node h100-" not in (slurm.dir / "log" / "slurmctld.log").read_text()
    assert "DOWN" in slurm.node_states(SLURM_BAD)
    assert any(u == (SLURM_BAD, "state set to DOWN") for u in updates), updates
    # The replacement got a slurmd pod of its own (a new name), which the run held and then returned.
    new_pod = next(p for p in kube.list("v1", "Pod", "slurm") if p["spec"]["nodeName"] == NEW)
    slurm_new = new_pod["metadata"]["name"]
    assert slurm_new != SLURM_BAD and slurm_new in operator.log.created
    held = f"reason set to: fleetmedic: replaces {BAD}, held until validated"
    assert any(n == slurm_new and what.startswith(held) for n, what in updates), updates
    wait_for(lambda: in_service(slurm, slurm_new), timeout=30)  # the operator clears its own drain, if it put one
    assert any(d.step == "take in replacement" and f"Slurm node {slurm_new} registered" in d.result
               for d in report.decisions), report.decisions
    # Kubernetes: the bad node cordoned, drained (its slurmd pod left to Slurm), retired; the new one serves.
    assert stack.kube.get("v1", "Node", BAD) is None
    assert not stack.node(NEW)["spec"].get("unschedulable")
    assert not [p for p in stack.evicted() if p.startswith("slurm/")], stack.evicted()
    assert [r for r in stack.node_writes(BAD) if r.verb == "patch"], "the bad node was never cordoned"


async def test_the_operators_drain_and_fleetmedics_down_on_one_node(slinky: tuple[Stack, SlinkyOperator]) -> None:
    """A person cordons gpu-ns-1's pod (Slinky's pod-cordon annotation): the operator drains it.
    An XID 48 then takes the node out (DOWN), the provider reboots it, and the run returns it: the
    operator's drain is still there afterwards, cleared by the operator once the person lifts
    the annotation — never by FleetMedic."""
    stack, operator = slinky
    slurm, kube = stack.slurm, stack.kube
    node, slurm_node = "h100-b2", "gpu-ns-1"
    pod = kube.get("v1", "Pod", slurm_node, "slurm")
    assert pod is not None and pod["spec"]["nodeName"] == node
    pod["metadata"].setdefault("annotations", {})[POD_CORDON] = "true"
    kube.put(pod)
    wait_for(lambda: slurm.node_state(slurm_node)[1].startswith("slurm-operator:"), timeout=20)
    theirs = slurm.node_state(slurm_node)[1]

    report, _ = await stack.run(node, xid=48, policy=policy(stack), timeout=150)

    assert report.outcome == "remediated", report.decisions
    updates = [what for n, what in slurmctld_updates(slurm) if n == slurm_node]
    # FleetMedic's DOWN kept the operator's reason in its own, and its RESUME put the drain back.
    down = next(i for i, what in enumerate(updates) if what == "state set to DOWN")
    assert any(what.startswith("reason set to: fleetmedic:") and what.endswith(f" | kept: {theirs}")
               for what in updates[:down]), updates
    assert updates[-1].startswith("state set to DRAIN") and updates[-2] == f"reason set to: {theirs}", updates
    state, reason = slurm.node_state(slurm_node)
    assert state.rstrip("*") in ("drain", "drng") and reason == theirs
    assert not stack.node(node)["spec"].get("unschedulable")  # FleetMedic's own cordon is gone
    assert operator.log.undrained == []
    # The person lifts the annotation: the operator, and only it, returns the node to Slurm.
    lifted = {"metadata": {"annotations": {POD_CORDON: None}}}
    client.CoreV1Api(kube.api).patch_namespaced_pod(slurm_node, "slurm", lifted)
    wait_for(lambda: in_service(slurm, slurm_node), timeout=20)
    assert operator.log.undrained == [slurm_node]
