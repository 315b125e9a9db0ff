"""The Slurm activities under `slurm.mapping: slinky`, against a real Slurm 22.05: which Slurm node a
Kubernetes node is (its slurmd pod's), and the operator's drains worked with, never undone.

The pods are the API's answer (plain JSON) as slurm-operator leaves them on a NodeSet's nodes; the
end-to-end runs with the operator's stand-in are in tests/test_slinky.py."""

from __future__ import annotations

from typing import Any

import pytest
from temporalio.exceptions import ApplicationError

from activities.slurm import SlurmActivities, SlurmCli
from activities.slurm_names import SlinkyNames, slurmd_pods
from devstack.slurm_cluster import LocalSlurmCluster
from fleetmedic.models import SetSlurmNodeState, SlurmNodeState
from fleetmedic.policy import SlinkyPolicy
from tests.harness import job_on
from tests.harness import run_activity as run

OURS = "fleetmedic: XID 79 on GPU 3 (xid-recovery/test/h100-a7)"
THEIRS = "slurm-operator: Kubernetes node cordoned"


def pod(name: str, node: str | None, *, nodeset: str = "gpu-ns", kind: str = "NodeSet", hostname: str | None = None,
        phase: str = "Running", deleting: bool = False) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": "slurm", "ownerReferences": [
        {"apiVersion": "slinky.slurm.net/v1beta1" if kind == "NodeSet" else "apps/v1", "kind": kind,
         "name": nodeset, "uid": "u"}]}
    if deleting:
        meta["deletionTimestamp"] = "2026-12-04T00:00:00Z"
    spec = {k: v for k, v in (("nodeName", node), ("hostname", hostname)) if v}
    return {"metadata": meta, "spec": spec, "status": {"phase": phase}}


class Pods:
    """The API's pod list, and what was asked of it."""

    def __init__(self, items: list[dict[str, Any]]) -> None:
        self.items, self.asked = items, []

    def __call__(self, namespace: str, selector: str) -> list[dict[str, Any]]:
        self.asked.append((namespace, selector))
        return self.items


@pytest.fixture
def pods() -> Pods:
    # The static nodes of the `slurm` fixture are the pods' names; the machines are named otherwise.
    return Pods([pod("gpu-node-0", "h100-a7"), pod("gpu-node-1", "h100-b2"), pod("gpu-node-2", "h100-c9")])


@pytest.fixture
def acts(slurm: LocalSlurmCluster, pods: Pods) -> SlurmActivities:
    names = SlinkyNames(SlinkyPolicy(namespace="slurm", nodesets=["gpu-ns"]), pods)
    return SlurmActivities(SlurmCli(str(slurm.conf), timeout_s=10), names=names)


def test_only_a_nodesets_bound_running_pods_are_slurm_nodes() -> None:
    found = slurmd_pods([
        pod("gpu-ns-0", "h100-a7"),
        pod("other-0", "h100-b2", nodeset="cpu-ns"),  # another NodeSet: not ours
        pod("gpu-ns-1", "h100-c9", kind="DaemonSet"),  # not a NodeSet's
        pod("gpu-ns-2", None),  # not bound yet
        pod("gpu-ns-3", "h100-d4", phase="Failed"),
        pod("gpu-ns-4", "h100-e1", hostname="gpu-e1"),  # the Slurm name is the pod's hostname
    ], ["gpu-ns"])
    assert [(p.name, p.slurm, p.node) for p in found] == [("gpu-ns-0", "gpu-ns-0", "h100-a7"),
                                                          ("gpu-ns-4", "gpu-e1", "h100-e1")]


def test_a_node_and_its_slurmd_pod_map_both_ways(pods: Pods) -> None:
    pods.items.append(pod("gpu-ns-9", "h100-a7", deleting=True))  # the old pod of a node, on its way out
    names = SlinkyNames(SlinkyPolicy(), pods)
    assert names.slurm_node("h100-a7") == "gpu-node-0"
    assert names.slurm_node("h100-zz") is None
    # No pod: the name as Slurm gives it. One read of the pods for the lot.
    asked = len(pods.asked)
    assert names.kube_nodes(["gpu-node-1", "gpu-node-7"]) == {"gpu-node-1": "h100-b2", "gpu-node-7": "gpu-node-7"}
    assert len(pods.asked) == asked + 1
    assert pods.asked[0] == ("slurm", "app.kubernetes.io/name=slurmd")


def test_a_node_without_a_slurmd_pod_has_no_slurm_side(slurm: LocalSlurmCluster, acts: SlurmActivities) -> None:
    down = SetSlurmNodeState(node="h100-zz", state=SlurmNodeState.DOWN, reason=OURS)
    result = run(acts.set_node_state, down)
    assert not result.changed and "no slurmd pod of NodeSet(s) gpu-ns" in result.detail, result
    assert run(acts.jobs_on_node, "h100-zz") == []
    assert run(acts.get_node, "h100-zz").state == "unknown"  # a replacement waiting for its slurmd pod
    # Nothing was written to a Slurm node named after the Kubernetes node, nor to any other.
    assert all(slurm.node_state(n)[0] == "idle" for n in slurm.nodes)


def test_writes_go_to_the_pods_slurm_node(slurm: LocalSlurmCluster, acts: SlurmActivities) -> None:
    result = run(acts.set_node_state, SetSlurmNodeState(node="h100-b2", state=SlurmNodeState.DOWN, reason=OURS))
    assert result.changed and result.target == "Slurm node gpu-node-1 (slurmd pod on h100-b2)"
    # DOWN with the DRAIN flag too: the operator drains a cordoned node that lacks it, with a
    # reason of its own that would replace ours.
    assert {"DOWN", "DRAIN"} <= slurm.node_states("gpu-node-1")
    assert slurm.node_state("gpu-node-1")[1] == OURS
    assert run(acts.set_node_state, SetSlurmNodeState(node="h100-b2", state=SlurmNodeState.RESUME)).changed
    assert slurm.node_state("gpu-node-1")[0].rstrip("*") == "idle"


def test_the_operators_drain_is_kept_and_put_back(slurm: LocalSlurmCluster, acts: SlurmActivities) -> None:
    slurm.run("scontrol", "update", "nodename=gpu-node-0", "state=DRAIN", f"reason={THEIRS}")
    drain = run(acts.set_node_state, SetSlurmNodeState(node="h100-a7", state=SlurmNodeState.DRAIN, reason=OURS))
    assert drain.changed and slurm.node_state("gpu-node-0")[1] == f"{OURS} | kept: {THEIRS}"
    down = SetSlurmNodeState(node="h100-a7", state=SlurmNodeState.DOWN, reason=OURS)
    assert run(acts.set_node_state, down).changed
    assert not run(acts.set_node_state, down).changed  # idempotent, the kept drain still in it
    assert slurm.node_state("gpu-node-0")[1] == f"{OURS} | kept: {THEIRS}"
    resume = run(acts.set_node_state, SetSlurmNodeState(node="h100-a7", state=SlurmNodeState.RESUME))
    assert resume.changed and "put back" in resume.detail
    # FleetMedic's DOWN is gone; the operator's drain is as the operator left it, for it to clear.
    assert slurm.node_states("gpu-node-0") >= {"DRAIN"} and "DOWN" not in slurm.node_states("gpu-node-0")
    assert slurm.node_state("gpu-node-0")[1] == THEIRS
    again = run(acts.set_node_state, SetSlurmNodeState(node="h100-a7", state=SlurmNodeState.RESUME))
    assert not again.changed and "left to it" in again.detail
    assert slurm.node_state("gpu-node-0")[1] == THEIRS


def test_a_persons_drain_is_still_left_alone(slurm: LocalSlurmCluster, acts: SlurmActivities) -> None:
    slurm.run("scontrol", "update", "nodename=gpu-node-2", "state=DRAIN", "reason=alice: cable swap")
    with pytest.raises(ApplicationError) as down:
        run(acts.set_node_state, SetSlurmNodeState(node="h100-c9", state=SlurmNodeState.DOWN, reason=OURS))
    assert down.value.type == "NotOwned"
    assert slurm.node_state("gpu-node-2")[1] == "alice: cable swap"


def test_jobs_are_told_by_the_machines_they_run_on(slurm: LocalSlurmCluster, acts: SlurmActivities) -> None:
    job = slurm.submit("#!/bin/bash\nwhile true; do sleep 0.2; done\n", "--nodelist=gpu-node-1")
    try:
        assert job_on(slurm, job) == "gpu-node-1"
        found = run(acts.jobs_on_node, "h100-b2")
        assert [(j.job_id, j.nodes) for j in found] == [(job, ["h100-b2"])]
        assert run(acts.get_job, job).nodes == ["h100-b2"]
        assert run(acts.jobs_on_node, "gpu-node-1") == []  # a Slurm name is not a machine's
    finally:
        slurm.run("scancel", str(job))
