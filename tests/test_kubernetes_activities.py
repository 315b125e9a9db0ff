"""Kubernetes activities against the real API server (the `kube` fixture): happy paths and every
error path (failures injected by the fault proxy in front of it)."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from functools import cache

import pytest
import yaml
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

from activities.kube_client import load_api_client
from activities.kubernetes import PRE_CORDONED, KubernetesActivities
from activities.waits import window_left
from devstack import fleet
from devstack.kube_faults import FaultProxy
from devstack.kube_world import RealKube
from fleetmedic.models import EventRequest, EvictRequest, NodeTarget, Taint, TaintRequest, WaitNodeReady
from fleetmedic.policy import Policy
from tests.harness import own_taints
from tests.harness import run_activity as run

WF = "xid-recovery/test/n1"


@pytest.fixture
def k8s(kube: RealKube) -> Iterator[KubernetesActivities]:
    kube.put(fleet.node("n1"))
    activities = KubernetesActivities(cache(lambda: load_api_client(str(kube.kubeconfig))),  # type: ignore[attr-defined]
                                      Policy(), timeout_s=2)
    yield activities
    activities.node_watch.stop()  # a later test's count of watches is its own



def node(kube: RealKube, name: str = "n1") -> dict:  # type: ignore[type-arg]
    obj = kube.get("v1", "Node", name)
    assert obj is not None
    return obj


def test_get_node_and_pods(kube: RealKube, k8s: KubernetesActivities) -> None:
    kube.put(fleet.pod("train", "n1", gpus=8))
    kube.put(fleet.pod("other", "n2"))
    info = run(k8s.get_node, "n1")
    assert info.ready and info.gpu_allocatable == 8 and not info.unschedulable
    pods = run(k8s.list_pods_on_node, "n1")
    assert [(p.name, p.gpus) for p in pods] == [("train", 8)]


def test_a_missing_node_is_an_answer_not_an_error(k8s: KubernetesActivities) -> None:
    # The runbook ends `unknown-node` on it, instead of escalating an error for an hour.
    assert run(k8s.get_node, "ghost") is None
    verdict = run(k8s.check_opt_out, "ghost")
    assert verdict.missing and not verdict.opted_out


def test_opt_out_on_node_or_pod(kube: RealKube, k8s: KubernetesActivities) -> None:
    assert not run(k8s.check_opt_out, "n1").opted_out
    kube.put(fleet.pod("precious", "n1", labels={"fleetmedic.io/remediation": "disabled"}))
    verdict = run(k8s.check_opt_out, "n1")
    assert verdict.opted_out and "pod default/precious" in verdict.reasons[0]


def test_cordon_is_idempotent_and_annotated(kube: RealKube, k8s: KubernetesActivities) -> None:
    first = run(k8s.cordon_node, NodeTarget(node="n1", workflow_id=WF, reason="XID 79"))
    writes = len(kube.mutations())
    second = run(k8s.cordon_node, NodeTarget(node="n1", workflow_id=WF, reason="XID 79"))
    assert first.changed and not second.changed
    # Counted at the API (the node's resourceVersion moves with every kubelet heartbeat): no write.
    assert len(kube.mutations()) == writes
    assert node(kube)["spec"]["unschedulable"] is True
    assert node(kube)["metadata"]["annotations"]["fleetmedic.io/workflow"] == WF
    with pytest.raises(ApplicationError) as held:  # another run does not take over the node
        run(k8s.cordon_node, NodeTarget(node="n1", workflow_id="other/run", reason="x"))
    assert held.value.type == "NotOwned" and held.value.non_retryable
    assert run(k8s.uncordon_node, NodeTarget(node="n1", workflow_id=WF)).changed
    assert not node(kube)["spec"].get("unschedulable")
    assert "fleetmedic.io/workflow" not in node(kube)["metadata"]["annotations"]
    assert not run(k8s.uncordon_node, NodeTarget(node="n1", workflow_id=WF)).changed


def test_node_writes_keep_the_clients_connections(kube: RealKube, kube_proxy: FaultProxy,
                                                  k8s: KubernetesActivities) -> None:
    """Cordons and uncordons patch the node on the client's kept-alive connections, counted where
    they arrive (the proxy in front of the API server). A patch whose answer was left unread kept
    its connection out of the pool: every write opened a new one, a TLS handshake each for the
    worker and the API server (about 2.5 ms of the worker's CPU; found profiling 50 alerts at
    once), the old socket left to the garbage collector."""
    k8s.read_node("n1")  # the client's first connection
    before = kube_proxy.connections
    for _ in range(10):
        assert run(k8s.cordon_node, NodeTarget(node="n1", workflow_id=WF, reason="XID 79")).changed
        assert run(k8s.uncordon_node, NodeTarget(node="n1", workflow_id=WF)).changed
    assert kube_proxy.connections - before == 0, f"{kube_proxy.connections - before} new connections for 20 writes"


def test_someone_elses_cordon_is_kept(kube: RealKube, k8s: KubernetesActivities) -> None:
    kube.put(fleet.node("n1", unschedulable=True))
    run(k8s.cordon_node, NodeTarget(node="n1", workflow_id=WF, reason="XID 79"))
    assert node(kube)["metadata"]["annotations"][PRE_CORDONED] == "true"
    run(k8s.uncordon_node, NodeTarget(node="n1", workflow_id=WF))
    assert node(kube)["spec"]["unschedulable"] is True  # the human's cordon stays
    assert PRE_CORDONED not in node(kube)["metadata"]["annotations"]


def test_conflict_is_retried_on_the_fresh_object(kube: RealKube, k8s: KubernetesActivities) -> None:
    kube.inject("PATCH", "nodes", status=409, times=2)
    taint = Taint.parse("fleetmedic.io/degraded=nvlink:NoSchedule")
    assert run(k8s.add_taint, TaintRequest(node="n1", taint=taint)).changed
    assert own_taints(node(kube)) == [{"key": "fleetmedic.io/degraded", "value": "nvlink", "effect": "NoSchedule"}]
    assert not run(k8s.add_taint, TaintRequest(node="n1", taint=taint)).changed
    assert run(k8s.remove_taint, TaintRequest(node="n1", taint=taint)).changed
    assert not own_taints(node(kube))


def test_conflict_that_persists_is_a_retryable_error(kube: RealKube, k8s: KubernetesActivities) -> None:
    kube.inject("PATCH", "nodes", status=409, times=10)
    with pytest.raises(ApplicationError) as err:
        run(k8s.cordon_node, NodeTarget(node="n1", workflow_id=WF))
    assert err.value.type == "Conflict" and not err.value.non_retryable


@pytest.mark.parametrize(("status", "kind", "retryable"), [
    (500, "Unavailable", True), (503, "Unavailable", True), (403, "Forbidden", False), (422, "Invalid", False),
])
def test_api_errors_are_classified(kube: RealKube, k8s: KubernetesActivities, status: int, kind: str,
                                   retryable: bool) -> None:
    kube.inject("PATCH", "nodes", status=status)
    with pytest.raises(ApplicationError) as err:
        run(k8s.cordon_node, NodeTarget(node="n1", workflow_id=WF))
    assert err.value.type == kind and err.value.non_retryable is not retryable
    assert not node(kube)["spec"].get("unschedulable")


def test_timeout_is_retryable(kube: RealKube, k8s: KubernetesActivities) -> None:
    kube.inject("GET", "nodes", status=0, delay_s=4)
    with pytest.raises(ApplicationError) as err:
        run(k8s.get_node, "n1")
    assert err.value.type == "Timeout" and not err.value.non_retryable


def test_unreachable_api_is_retryable(kube: RealKube, tmp_path) -> None:  # type: ignore[no-untyped-def]
    # A fault proxy of its own in front of the real apiserver, stopped: the worker's kubeconfig now
    # points at a port nobody listens on, as when the API server is down or partitioned away.
    dead = FaultProxy(kube.cluster.port).start()
    kubeconfig = kube.write_kubeconfig(tmp_path / "kc")
    config = yaml.safe_load(kubeconfig.read_text())
    config["clusters"][0]["cluster"] = {"server": dead.url}
    kubeconfig.write_text(yaml.safe_dump(config))
    dead.stop()
    k8s = KubernetesActivities(lambda: load_api_client(str(kubeconfig)), Policy(), timeout_s=1)
    with pytest.raises(ApplicationError) as err:
        run(k8s.get_node, "n1")
    assert err.value.type == "Unavailable" and not err.value.non_retryable


def test_dry_run_sends_no_write(kube: RealKube, k8s: KubernetesActivities) -> None:
    kube.put(fleet.pod("train", "n1"))
    cordon = run(k8s.cordon_node, NodeTarget(node="n1", workflow_id=WF, reason="XID 79", dry_run=True))
    drain = run(k8s.evict_pods, EvictRequest(node="n1", dry_run=True))
    taint = run(k8s.add_taint, TaintRequest(node="n1", taint=Taint.parse("a=b:NoSchedule"), dry_run=True))
    event = run(k8s.record_event, EventRequest(name="n1", reason="R", message="m", dry_run=True))
    assert cordon.summary.startswith("would cordon node n1") and drain.evicted == ["default/train"]
    assert taint.dry_run and event.dry_run
    assert kube.mutations() == []


def test_forced_dry_run_of_the_process(kube: RealKube) -> None:
    k8s = KubernetesActivities(lambda: load_api_client(str(kube.kubeconfig)), Policy(),  # type: ignore[attr-defined]
                               force_dry_run=True)
    kube.put(fleet.node("n1"))
    assert run(k8s.cordon_node, NodeTarget(node="n1", workflow_id=WF)).dry_run
    assert kube.mutations() == []


def test_drain_skips_daemonsets_and_waits_out_a_pdb(kube: RealKube, k8s: KubernetesActivities) -> None:
    kube.put(fleet.pod("dcgm", "n1", owner_kind="DaemonSet"))
    kube.put(fleet.pod("static", "n1", mirror=True))
    kube.put(fleet.pod("web-0", "n1", labels={"app": "web"}))
    kube.put(fleet.node("n2"))  # the other replica's node
    kube.put(fleet.pod("web-1", "n2", labels={"app": "web"}, ready=False))
    kube.put(fleet.pdb("web", match_labels={"app": "web"}, min_available=1))

    def replica_becomes_ready() -> None:  # the controller's part: the other replica gets Ready
        kube.put(fleet.pod("web-1", "n2", labels={"app": "web"}, ready=True))

    timer = threading.Timer(1.0, replica_becomes_ready)
    timer.start()
    report = run(k8s.evict_pods, EvictRequest(node="n1", deadline_s=20))
    timer.join()
    assert report.evicted == ["default/web-0"] and report.complete
    assert sorted(p.pod for p in report.skipped) == ["default/dcgm", "default/static"]
    assert kube.get("v1", "Pod", "dcgm", "default") is not None
    refused = [r for r in kube.mutations() if r.url.path.endswith("/eviction")]
    assert len(refused) >= 2  # the first eviction got 429 and was retried


def test_drain_reports_what_it_could_not_evict(kube: RealKube, k8s: KubernetesActivities) -> None:
    kube.put(fleet.pod("solo", "n1", labels={"app": "solo"}))
    kube.put(fleet.pdb("solo", match_labels={"app": "solo"}, max_unavailable=0))
    report = run(k8s.evict_pods, EvictRequest(node="n1", deadline_s=1.5))
    assert not report.complete
    assert report.failed[0].pod == "default/solo" and "PodDisruptionBudget" in report.failed[0].reason


def test_drain_retries_server_errors(kube: RealKube, k8s: KubernetesActivities) -> None:
    kube.put(fleet.pod("train", "n1"))
    kube.inject("POST", "pods", subresource="eviction", status=500, times=2)
    report = run(k8s.evict_pods, EvictRequest(node="n1", deadline_s=20))
    assert report.evicted == ["default/train"] and report.complete


def test_drain_with_a_selector_leaves_other_pods(kube: RealKube, k8s: KubernetesActivities) -> None:
    kube.put(fleet.pod("train", "n1", labels={"fleetmedic.io/workload": "training"}))
    kube.put(fleet.pod("serve", "n1", labels={"fleetmedic.io/workload": "inference"}))
    report = run(k8s.evict_pods, EvictRequest(node="n1", selector="fleetmedic.io/workload!=inference"))
    assert report.evicted == ["default/train"]
    assert kube.get("v1", "Pod", "serve", "default") is not None


def test_event_is_recorded_once(kube: RealKube, k8s: KubernetesActivities) -> None:
    request = EventRequest(name="n1", reason="FleetMedicRemediated", message="XID 79: replaced")
    first = ActivityEnvironment()
    assert first.run(k8s.record_event, request).changed
    assert not first.run(k8s.record_event, request).changed  # a retried activity finds its Event
    events = kube.list("v1", "Event")
    assert len(events) == 1 and events[0]["involvedObject"]["name"] == "n1"


def test_wait_node_ready_watches_until_the_node_is_back(kube: RealKube, k8s: KubernetesActivities) -> None:
    from datetime import UTC, datetime

    from devstack.controllers import set_ready
    from fleetmedic.models import WaitNodeReady

    since = datetime.now(UTC).replace(microsecond=0)
    set_ready(kube, "n1", False)
    threading.Timer(1.0, set_ready, (kube, "n1", True)).start()
    back = run(k8s.wait_node_ready, WaitNodeReady(node="n1", since=since, timeout_s=20))
    assert back is not None and back.ready and back.ready_since is not None and back.ready_since >= since
    gets = [r for r in kube.requests() if r.verb == "watch"]
    assert gets, "the activity watches instead of polling"


def test_a_retried_wait_waits_only_what_is_left_of_the_runs_window(kube: RealKube,
                                                                   k8s: KubernetesActivities) -> None:
    """A wait spans the run's deadline. When the worker running it dies (its heartbeat times out),
    the next attempt waits what is left of the window counted from the run's request, not the whole
    window again: the run's deadline must not slip by as long as the first attempt waited."""
    asked = datetime.now(UTC) - timedelta(minutes=10)
    retry = ActivityEnvironment()
    retry.info = dataclasses.replace(retry.info, attempt=2, scheduled_time=asked)
    assert retry.run(window_left, 3600.0) == pytest.approx(3000, abs=30)
    assert retry.run(window_left, 600.0) == 1.0  # past its window: one last look
    first = ActivityEnvironment()
    first.info = dataclasses.replace(first.info, attempt=1, scheduled_time=asked)
    assert first.run(window_left, 600.0) == 600.0  # the first attempt waits its whole window, whatever the clocks say
    # The wait itself: a retry past its window looks once and answers "not yet", it does not wait 10 minutes.
    never = WaitNodeReady(node="n1", since=datetime.now(UTC).replace(year=2030), timeout_s=600)
    assert asyncio.run(asyncio.wait_for(retry.run(k8s.wait_node_ready, never), 60)) is None


def test_wait_node_ready_times_out_and_waits_for_a_missing_node(kube: RealKube,
                                                                k8s: KubernetesActivities) -> None:
    from datetime import UTC, datetime

    from fleetmedic.models import WaitNodeReady

    assert run(k8s.wait_node_ready, WaitNodeReady(node="n1", since=datetime.now(UTC).replace(year=2030),
                                                  timeout_s=1.5)) is None
    threading.Timer(1.0, lambda: kube.put(fleet.node("replacement"))).start()
    back = run(k8s.wait_node_ready, WaitNodeReady(node="replacement", timeout_s=20))
    assert back is not None and back.name == "replacement"


def test_a_wait_heartbeats_every_quarter_of_its_heartbeat_timeout(kube: RealKube, k8s: KubernetesActivities) -> None:
    """A waiting run heartbeats often enough that the SDK has one to send in every window of its
    throttle (0.8 of the heartbeat timeout: the server must hear it before the timeout), and not
    more: the SDK drops the calls in between, and each call is work on the worker's event loop,
    for every one of an incident's thousands of waits. The calls, as the SDK's API receives them."""
    never = WaitNodeReady(node="n1", since=datetime.now(UTC).replace(year=2030), timeout_s=5.5)

    def heartbeats(heartbeat_timeout: timedelta) -> int:
        env = ActivityEnvironment()
        env.info = dataclasses.replace(env.info, heartbeat_timeout=heartbeat_timeout)
        calls: list[tuple[object, ...]] = []
        env.on_heartbeat = lambda *details: calls.append(details)
        assert asyncio.run(asyncio.wait_for(env.run(k8s.wait_node_ready, never), 60)) is None
        return len(calls)

    assert heartbeats(timedelta(seconds=4)) >= 4  # one a second: 5 in 5.5 s, less only on a busy machine
    assert heartbeats(timedelta(minutes=2)) == 0  # the policy's default: one every 30 s (before: every 5 s, 2 here)


def test_many_waits_share_one_watch_and_hold_no_thread(kube: RealKube, k8s: KubernetesActivities) -> None:
    """Forty runs waiting for their nodes cost one list and one watch at the API server, not one
    watch (and one activity thread) each; each wait returns when its own node is back."""
    import asyncio
    from datetime import UTC, datetime

    from devstack.controllers import set_ready
    from fleetmedic.models import WaitNodeReady

    names = [f"w{i}" for i in range(40)]
    for name in names:
        kube.put(fleet.node(name, ready=False))
    since = datetime.now(UTC).replace(microsecond=0)
    before = threading.active_count()

    async def all_waits() -> list[object]:
        env = ActivityEnvironment()
        waits = [asyncio.ensure_future(env.run(k8s.wait_node_ready, WaitNodeReady(node=n, since=since, timeout_s=60)))
                 for n in names]
        await asyncio.sleep(1)
        assert threading.active_count() <= before + 2  # the one watch thread (and nothing per wait)
        for name in names[:20]:
            set_ready(kube, name, True)
        done = await asyncio.gather(*waits[:20])
        assert not any(w.done() for w in waits[20:])  # the others still wait for their own nodes
        for w in waits[20:]:
            w.cancel()
        return done

    back = asyncio.run(all_waits())
    assert sorted(b.name for b in back) == sorted(names[:20])  # type: ignore[attr-defined]
    watches = [r for r in kube.requests() if r.verb == "watch" and r.url.path == "/api/v1/nodes"]
    assert len(watches) == 1, len(watches)


def test_a_stopped_watch_lets_go_of_the_api(kube: RealKube, k8s: KubernetesActivities) -> None:
    """A worker stopped in a process that goes on (the dev stack, a test session) ends its node
    watch: no thread left renewing a watch against the API server every five minutes for ever."""
    from fleetmedic.models import WaitNodeReady

    def watching() -> set[threading.Thread]:
        return {t for t in threading.enumerate() if t.name == "fleetmedic-node-watch"}

    before = watching()
    assert run(k8s.wait_node_ready, WaitNodeReady(node="n1", since=None, timeout_s=30)) is not None
    [ours] = watching() - before
    k8s.node_watch.stop()
    kube.put(fleet.node("n2"))  # an event: the open watch sees the stop
    ours.join(20)
    assert not ours.is_alive()
