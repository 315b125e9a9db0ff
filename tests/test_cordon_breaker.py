"""The cordon breaker, the fleet pause over cordons, and a protective step's failure said by name.

Protective steps (cordon + Slurm DRAIN ahead of the lease) are bounded: a storm of alerts for many
nodes — a broken exporter, a fleet-wide event — trips the breaker at its bound, counted here from
the apiserver's audit log, and it stays tripped until a person resets it. A fleet pause holds new
cordons too (tests/test_protective_first.py). A protective step that cannot reach Slurm says so,
naming slurmctld, in the run's status while it retries.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from temporalio.client import Client, WorkflowHandle

from activities.breaker import CordonBreaker, GuardView
from activities.out_of_service import OutOfService
from devstack import fleet
from devstack.kube_world import RealKube
from devstack.standins import ProviderStandIn, SlackStandIn
from fleetmedic.ids import node_workflow_id
from fleetmedic.models import BreakerState, NodeInfo, NodeRunbookInput, Operator, RunbookStatus
from fleetmedic.policy import Policy
from tests.harness import quick_policy, settings_for, worker_for
from tests.runbook_stack import Stack, fleetmedic_cli, status_when
from tests.test_fleet_guard import guard_when

# --- the breaker's arithmetic, on a node watch's snapshot ------------------------------------------


def gpu_node(name: str, *, out: bool = False) -> NodeInfo:
    return NodeInfo(name=name, ready=True, unschedulable=out, gpu_allocatable=8,
                    labels={"nvidia.com/gpu.present": "true"})


def breaker_over(nodes: list[NodeInfo], out_since: dict[str, float], view: GuardView | None = None,
                 **protective: Any) -> tuple[CordonBreaker, list[float], OutOfService]:
    """A breaker over `nodes`, those in `out_since` cordoned then (the watch's monotonic clock), and
    the watch's record, to file what it sees next."""
    clock = [1000.0]
    policy = Policy.model_validate({"budget": {"protective": {"max_out_fraction": 0.1, "min_nodes": 1, **protective}}})
    nodes = [n.model_copy(update={"unschedulable": True}) if n.name in out_since else n for n in nodes]
    fleet = OutOfService.of(nodes, out_since, policy.labels.gpu_node_selector, policy.labels.workflow_annotation)
    breaker = CordonBreaker(policy, lambda: fleet, lambda _: view or GuardView(), clock=lambda: clock[0])
    return breaker, clock, fleet


def test_the_bound_counts_nodes_gone_out_within_the_window_and_this_workers_own_cordons() -> None:
    nodes = [gpu_node(f"n{i}") for i in range(20)]  # bound: 10 % of 20 = 2
    out_since = {"old": float("-inf")}  # out before the watch started: not counted
    nodes.append(gpu_node("old", out=True))
    breaker, clock, fleet = breaker_over(nodes, out_since)
    assert breaker.decide("c", "n0").held is None
    assert breaker.decide("c", "n1").held is None  # n0 pending (this worker cordons it): 1 + 1 ≤ 2
    third = breaker.decide("c", "n2")
    assert third.held is not None and third.held_by == "breaker" and third.trip is not None
    assert (third.trip.out, third.trip.gpu_nodes, third.trip.bound) == (2, 21, 2)
    assert "look at the exporter or a fleet-wide event first" in third.trip.reason
    assert breaker.decide("c", "n0").held is None  # a retry of a step already counted passes
    # The watch shows n0 and n1 out, one of them long ago: past the window it no longer counts.
    fleet.seen(gpu_node("n0", out=True), clock[0] - 700)
    fleet.seen(gpu_node("n1", out=True), clock[0])
    assert breaker.decide("c", "n2").held is None


def test_a_reset_counts_from_the_reset_and_a_tripped_guard_or_a_pause_holds_every_step() -> None:
    nodes = [gpu_node(f"n{i}") for i in range(10)]  # bound: min_nodes 1
    out_since = {"n0": 990.0}
    breaker, _, _ = breaker_over(nodes, out_since, GuardView(reset_at=datetime.now(UTC)))
    assert breaker.decide("c", "n1").held is None  # n0 went out before the reset
    tripped = GuardView(breaker=BreakerState(out=3, gpu_nodes=10, bound=1, reason="x", tripped_at=datetime.now(UTC),
                                             by="xid-recovery/c/n0"))
    assert breaker_over(nodes, {}, tripped)[0].decide("c", "n5").held_by == "breaker"
    paused = GuardView(paused=Operator(by="alice", reason="maintenance"))
    decision = breaker_over(nodes, {}, paused)[0].decide("c", "n5")
    assert decision.held_by == "pause" and "alice" in (decision.held or "") and decision.trip is None


def test_protective_cordons_a_minute_are_bounded_fleet_wide() -> None:
    nodes = [gpu_node(f"n{i}") for i in range(100)]
    for node in nodes[:3]:
        node.annotations["fleetmedic.io/workflow"] = f"xid-recovery/c/{node.name}"
    breaker, _, _ = breaker_over(nodes, {n.name: 999.0 for n in nodes[:3]}, max_out_fraction=1.0, max_per_minute=4)
    assert breaker.decide("c", "n50").held is None  # 3 of ours in the last minute, + this one
    held = breaker.decide("c", "n51")
    assert held.trip is not None and "protective cordons in the last minute" in held.trip.reason


# --- a false storm against the real control plane ----------------------------------------------------


def cordoned_by_worker(kube: RealKube) -> list[str]:
    """Nodes the worker cordoned, in order, from the apiserver's audit log."""
    seen: list[str] = []
    for r in kube.mutations():
        if r.url.path.startswith("/api/v1/nodes/") and r.code < 300 and r.user == kube.cluster.identity_user("worker") \
                and (r.data or {}).get("spec", {}).get("unschedulable") is True:
            name = r.url.path.rsplit("/", 1)[1]
            if name not in seen:
                seen.append(name)
    return seen


async def cordoned_at_least(kube: RealKube, count: int, timeout: float) -> None:
    """Until the worker has cordoned `count` nodes (the audit log), at most `timeout` seconds."""
    deadline = asyncio.get_running_loop().time() + timeout
    while len(cordoned_by_worker(kube)) < count and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.5)


async def start(client: Client, task_queue: str, node: str) -> WorkflowHandle[Any, RunbookStatus]:
    return await client.start_workflow(
        "xid-recovery", NodeRunbookInput(cluster=task_queue, node=node, gpu=0, xid=79),
        id=node_workflow_id("xid-recovery", task_queue, node), task_queue=task_queue, result_type=RunbookStatus)


async def test_a_false_storm_for_30_percent_of_the_fleet_trips_the_breaker_at_its_bound(
        client: Client, task_queue: str, kube: RealKube, provider_http: ProviderStandIn, slack: SlackStandIn,
        tmp_path: Path) -> None:
    """30 of 100 GPU nodes alert within seconds under a 10 % breaker: 10 are cordoned ahead of their
    lease, no more; the breaker trips once and says so (Slack, `fleetmedic status`, the guard); the
    other 20 runs keep their alert and wait. After `fleetmedic breaker reset` they go on, under the
    lease budget (20 leases: each run waits at its approval of `replace` holding one)."""
    for i in range(100):
        kube.put(fleet.node(f"gpu-{i:03d}"))
    policy = quick_policy(tmp_path, provider={"kind": "http", "http": {"url": provider_http.url}},
                          approvals={"steps": ["replace"]},
                          budget={"max_concurrent": 20, "max_unavailable_fraction": 0.5, "max_per_hour": 1000,
                                  "topology_label": None,
                                  "protective": {"max_out_fraction": 0.10, "min_nodes": 1, "max_per_minute": 1000}})
    settings = settings_for(task_queue, kube, slack=slack, provider=provider_http)
    storm = [f"gpu-{i:03d}" for i in range(0, 90, 3)]  # 30 nodes
    handles: list[WorkflowHandle[Any, RunbookStatus]] = []
    try:
        async with worker_for(client, settings, policy):
            for node in storm:
                handles.append(await start(client, task_queue, node))
            state = await guard_when(client, task_queue, lambda s: s.breaker is not None and len(s.queue) >= 20,
                                     "the breaker tripped and 20 runs in line", timeout=180)
            cordoned = cordoned_by_worker(kube)
            # Exactly the bound: one worker reserves each step's place under a lock (race margin 0).
            assert len(cordoned) == 10, cordoned
            assert state.breaker is not None and state.breaker.bound == 10 and state.breaker.gpu_nodes == 100
            held = [h for h in handles if h.id.rsplit("/", 1)[1] not in cordoned]
            for handle in held[:3]:
                status = await status_when(handle, lambda s: "held by the cordon breaker" in (s.waiting_for or ""),
                                           timeout=60)
                assert any("nothing cordoned ahead of the lease: cordon breaker" in d.result
                           for d in status.decisions), status.decisions
            tripped = [m for m in slack.messages if "cordon breaker tripped" in m["text"]]
            assert tripped and "@oncall" in tripped[0]["text"], slack.messages
            said = await asyncio.to_thread(cli, client, task_queue, "status")
            assert "CORDON BREAKER TRIPPED" in said.stdout, said.stdout
            assert "10 of 100 GPU nodes went out (bound 10)" in said.stdout, said.stdout
            # It never resets by itself: later alerts are held too, and nothing more is cordoned.
            handles.append(await start(client, task_queue, "gpu-099"))
            await status_when(handles[-1], lambda s: any("cordon breaker tripped" in d.result for d in s.decisions),
                              timeout=60)
            assert len(cordoned_by_worker(kube)) == 10

            reset = await asyncio.to_thread(cli, client, task_queue, "breaker", "reset", "--by", "alice", "--reason",
                                            "exporter fixed")
            assert reset.returncode == 0 and "reset by alice" in reset.stdout, reset.stdout + reset.stderr
            state = await guard_when(client, task_queue, lambda s: len(s.holders) == 20,
                                     "20 leases held after the reset", timeout=180)
            assert state.breaker is None and state.breaker_reset_by == Operator(by="alice", reason="exporter fixed")
            assert state.max_held <= 20  # the lease budget
            # Held runs that got a lease take their node out under it, a workflow task or two after
            # the grant (more than 2 s on a busy machine: a suite run once saw 19); nobody else does.
            await cordoned_at_least(kube, 20, timeout=60)
            await asyncio.sleep(2)  # a 21st would follow at once
            after = cordoned_by_worker(kube)
            assert len(after) == 20 and set(after) <= set(storm) | {"gpu-099"}, after
    finally:
        for handle in handles:
            await handle.terminate("test over")


def cli(client: Client, task_queue: str, *args: str) -> subprocess.CompletedProcess[str]:
    """`fleetmedic <args>` as an operator runs it, for the test's cluster (named after its queue)."""
    return fleetmedic_cli(client, task_queue, task_queue, *args)


async def test_a_protective_step_that_cannot_reach_slurm_says_so_while_it_retries(stack: Stack) -> None:
    """slurmctld is down: the run's status names it at the protective step's first failed try
    (not "Activity timed out" after every retry), and the escalation says the same."""
    stack.slurm.stop_controller()
    policy = stack.policy(retries={"writes": {"attempts": 3, "initial_interval": "2s", "max_interval": "2s"}})

    async def watch(handle: WorkflowHandle[Any, Any]) -> None:
        status = await status_when(handle, lambda s: "slurmctld at" in (s.waiting_for or ""), timeout=90)
        assert "unreachable" in (status.waiting_for or "") and "try 2 of 3" in (status.waiting_for or ""), \
            status.waiting_for
        said = await asyncio.to_thread(stack.cli, "status")
        assert "slurmctld at" in said.stdout, said.stdout
        status = await status_when(handle, lambda s: s.escalation is not None, timeout=120)
        assert status.escalation is not None and "slurmctld at" in status.escalation.error, status.escalation
        assert "timed out" not in status.escalation.error.lower() or "slurmctld" in status.escalation.error
        aborted = await asyncio.to_thread(stack.cli, "answer", handle.id, "abort", "--by", "alice")
        assert aborted.returncode == 0, aborted.stderr

    report, _ = await stack.run("gpu-node-2", policy=policy, during=watch, timeout=240)
    assert report.outcome == "aborted", report.decisions


def test_a_reset_needs_a_name() -> None:
    done = subprocess.run([sys.executable, "-m", "workers.cli", "breaker", "reset", "--by", " ", "--address",
                           "127.0.0.1:9"], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and done.stderr.strip(), done

