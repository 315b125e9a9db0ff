"""The Alertmanager webhook: routing, dedup, answers, and bad input (property-based)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from temporalio.client import Client

from activities.start import RUNBOOK_TASK_TIMEOUT
from fleetmedic.models import RunbookStatus
from fleetmedic.policy import RoutingPolicy
from tests.alerts import TOKEN, alerts_in, payload, post, replica, xid_alert
from tests.runbook_stack import save_history, status_when
from workers.webhook import AlertReceiver, available_runbooks


@pytest.fixture
async def webhook(client: Client, task_queue: str) -> AsyncIterator[tuple[AlertReceiver, httpx.AsyncClient]]:
    async with replica(client, task_queue) as served:
        yield served


async def running(client: Client, cluster: str) -> list[str]:
    """The cluster's runs as visibility lists them. A production server writes visibility after the
    run's own transaction (a moment later under load): wait up to 10 s for a first one."""
    for _ in range(50):
        listed = [w.id async for w in client.list_workflows(f'FleetCluster = "{cluster}"')]
        if listed:
            return listed
        await asyncio.sleep(0.2)
    return []


@pytest.mark.temporal_production
async def test_firing_alert_starts_the_runbook_and_a_repeat_attaches(webhook: Any, client: Client,
                                                                      task_queue: str) -> None:
    _, http = webhook
    first = await http.post("/v1/alerts/alertmanager", json=payload(xid_alert("gpu-7", task_queue)))
    assert first.status_code == 202
    [answer] = first.json()["alerts"]
    assert answer["action"] == "started" and answer["runbook"] == "xid-recovery", str(answer)
    assert answer["workflow_id"] == f"xid-recovery/{task_queue}/gpu-7" and answer["fingerprint"] == "fp1"
    # The same alert from Alertmanager's other replica: the webhook that sent it on answers itself.
    again = await http.post("/v1/alerts/alertmanager", json=payload(xid_alert("gpu-7", task_queue)))
    assert (again.json()["alerts"][0]["action"], again.json()["alerts"][0]["code"]) == ("ignored", "resend")
    async with replica(client, task_queue) as (_, other):  # a webhook replica that had not seen it
        again = await other.post("/v1/alerts/alertmanager", json=payload(xid_alert("gpu-7", task_queue)))
    assert again.json()["alerts"][0]["action"] == "attached"
    resolved = await http.post("/v1/alerts/alertmanager",
                               json=payload(xid_alert("gpu-7", task_queue, status="resolved"), status="resolved"))
    assert resolved.json()["alerts"][0]["action"] == "attached"
    history = await client.get_workflow_handle(answer["workflow_id"]).fetch_history()
    # A task the server hands out and never hears of again is given out anew within this, not 10 s.
    started = history.events[0].workflow_execution_started_event_attributes
    assert started.workflow_task_timeout.ToTimedelta() == RUNBOOK_TASK_TIMEOUT
    # The first alert is in the start's input (no signal beside it); the other replica's copy and
    # the resolution are one signal each.
    assert [a["status"] for a in alerts_in(history)] == ["firing", "firing", "resolved"]
    assert sum(e.HasField("workflow_execution_signaled_event_attributes") for e in history.events) == 2
    assert await running(client, task_queue) == [answer["workflow_id"]]
    await client.get_workflow_handle(answer["workflow_id"]).terminate("test over")


@pytest.mark.temporal_production
async def test_twenty_concurrent_copies_make_one_workflow(webhook: Any, client: Client, task_queue: str) -> None:
    _, http = webhook
    body = payload(xid_alert("gpu-9", task_queue))
    answers = await asyncio.gather(*(http.post("/v1/alerts/alertmanager", json=body) for _ in range(20)))
    actions = [r.json()["alerts"][0]["action"] for r in answers]
    assert all(r.status_code == 202 for r in answers)
    assert actions.count("started") == 1 and actions.count("attached") == 19
    ids = await running(client, task_queue)
    assert ids == [f"xid-recovery/{task_queue}/gpu-9"]
    # Every copy reached the run (they arrived together, before the resend memory knew the first):
    # the first in the start's input, each other as one signal.
    alerts = alerts_in(await client.get_workflow_handle(ids[0]).fetch_history())
    assert [a["fingerprint"] for a in alerts] == ["fp1"] * 20
    await client.get_workflow_handle(ids[0]).terminate("test over")


def test_each_gpu_alert_routes_to_its_runbook() -> None:
    from fleetmedic.models import Alert
    from fleetmedic.routing import Routed, route
    from workers.webhook import available_runbooks

    def routed(labels: dict[str, str], annotations: dict[str, str] | None = None) -> tuple[str, str]:
        decision = route(Alert(status="firing", labels={"node": "gpu-1", **labels}, annotations=annotations or {}),
                         RoutingPolicy(), available_runbooks())
        assert isinstance(decision, Routed), decision
        return decision.runbook, decision.workflow_id

    assert routed({"alertname": "FleetMedicGpuXid", "xid": "79"}) == ("xid-recovery", "xid-recovery/default/gpu-1")
    assert routed({"alertname": "FleetMedicGpuXid", "xid": "74"})[0] == "nvlink-fault-replace"
    # dcgm-exporter's XID alert carries the XID in an annotation: XID 74 still reaches NVLink.
    assert routed({"alertname": "FleetMedicGpuXid"}, {"xid": "74"})[0] == "nvlink-fault-replace"
    assert routed({"alertname": "FleetMedicGpuHot", "gpu": "2"}) == ("hot-gpu-pull", "hot-gpu-pull/default/gpu-1")
    assert routed({"alertname": "FleetMedicNvlinkErrors"})[0] == "nvlink-fault-replace"
    assert routed({"alertname": "FleetMedicNvlinkDown"})[0] == "nvlink-fault-replace"
    assert routed({"alertname": "FleetMedicTrainingStarted"}) == ("traffic-flip", "traffic-flip/default")
    assert routed({"alertname": "FleetMedicTrainingFinished"}) == ("migrate-back", "migrate-back/default")
    # A route to a runbook this worker version does not run is answered, never started into a void.
    older = route(Alert(status="firing", labels={"alertname": "FleetMedicGpuHot", "node": "gpu-1"}),
                  RoutingPolicy(), frozenset({"xid-recovery"}))
    assert not isinstance(older, Routed) and "hot-gpu-pull is not available" in older.reason


async def test_unroutable_alerts_are_answered_ignored_with_a_reason(webhook: Any, client: Client,
                                                                     task_queue: str) -> None:
    _, http = webhook
    no_node = xid_alert("x", task_queue)
    del no_node["labels"]["node"]
    no_xid = {**xid_alert("gpu-1", task_queue), "labels": {"alertname": "FleetMedicGpuXid", "node": "gpu-1",
                                                            "cluster": task_queue}}
    unknown = {**xid_alert("gpu-1", task_queue), "labels": {"alertname": "DiskFull", "node": "gpu-1"}}
    resolved_alone = xid_alert("gpu-2", task_queue, status="resolved")
    bad_gpu = xid_alert("gpu-3", task_queue, gpu=999)
    answer = await http.post("/v1/alerts/alertmanager",
                             json=payload(no_node, no_xid, unknown, resolved_alone, bad_gpu))
    answers = answer.json()["alerts"]
    assert [(a["action"], a["code"]) for a in answers] == [
        ("refused", "no_node_label"), ("refused", "no_xid"), ("ignored", "no_route"),
        ("ignored", "resolved_not_running"), ("refused", "invalid_label")]
    reasons = [a["reason"] for a in answers]
    assert "no node label" in reasons[0]
    assert "no XID label" in reasons[1]
    assert "no route for alertname 'DiskFull'" in reasons[2]
    assert "no runbook is running" in reasons[3]
    assert reasons[4] == "label gpu=999 is outside 0..63"
    assert await running(client, task_queue) == []
    # Every alert not acted on is counted where an operator looks, by reason.
    metrics = (await http.get("/metrics")).text
    for outcome, code in (("refused", "no_node_label"), ("refused", "no_xid"), ("ignored", "no_route"),
                          ("ignored", "resolved_not_running"), ("refused", "invalid_label")):
        assert f'fleetmedic_webhook_alerts_total{{outcome="{outcome}",reason="{code}"}} 1.0' in metrics


async def test_authentication(webhook: Any) -> None:
    receiver, http = webhook
    body = payload(xid_alert("gpu-1", "c"))
    assert (await http.post("/v1/alerts/alertmanager", json=body, headers={"Authorization": ""})).status_code == 401
    wrong = await http.post("/v1/alerts/alertmanager", json=body, headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401
    basic = await http.post("/v1/alerts/alertmanager", json=body, headers={"Authorization": f"Basic {TOKEN}"})
    assert basic.status_code == 401
    metrics = (await http.get("/metrics")).text
    assert 'fleetmedic_webhook_rejected_total{reason="unauthorized"} 3.0' in metrics


async def test_body_limit(webhook: Any) -> None:
    _, http = webhook
    huge = payload(*[xid_alert(f"gpu-{i}", "c", fingerprint="x" * 200) for i in range(400)])
    answer = await http.post("/v1/alerts/alertmanager", json=huge)
    assert answer.status_code == 413


async def test_health_and_metrics(webhook: Any, task_queue: str) -> None:
    _, http = webhook
    assert (await http.get("/healthz")).json() == {"ok": True, "temporal": "serving"}
    await http.post("/v1/alerts/alertmanager", json=payload({**xid_alert("gpu-1", task_queue),
                                                             "labels": {"alertname": "DiskFull"}}))
    metrics = (await http.get("/metrics")).text
    # Alert names are untrusted: names no route knows share one series instead of one each.
    assert 'fleetmedic_alerts_received_total{alertname="other",status="firing"} 1.0' in metrics
    assert 'fleetmedic_webhook_runbooks_total{action="ignored",runbook="none"} 1.0' in metrics
    assert "fleetmedic_webhook_request_seconds_bucket" in metrics


# --- hostile input against the real server ---------------------------------------------------------

VALID_NODES = [f"fz-{i}" for i in range(12)]
INJECTIONS = ['default" OR FleetCluster != "zz', "x' OR '1'='1", "a\\b", "gpu-node-0\n", "gpu\x00node", "*",
              "../../etc/passwd", "GPU_NODE", "ünïcode", "-lead", "trail-", "a..b"]


class HostileAlerts:
    """Deterministic generator of the request classes an attacker or a broken relabelling sends:
    valid alerts and their resends, injection strings, invalid and over-long node names, unknown
    clusters, missing and non-numeric labels, resolutions, and payloads that are no Alertmanager
    body at all. Each alert is remembered with the answer it must get."""

    def __init__(self, cluster: str, seed: int = 15) -> None:
        import random

        self.rng = random.Random(seed)
        self.cluster = cluster
        self.sent_valid: dict[str, dict[str, Any]] = {}  # the last valid firing alert per node, for resends

    def alert(self) -> tuple[dict[str, Any], str]:
        """One alert and the class it belongs to: valid, resend, resolved, refused or ignored."""
        rng, cluster = self.rng, self.cluster
        kind = rng.choice(["valid", "valid", "resend", "resolved", "injection", "bad_node", "long", "cluster",
                           "no_node", "bad_number", "no_route", "no_xid"])
        node = rng.choice(VALID_NODES)
        labels = {"alertname": "FleetMedicGpuXid", "node": node, "xid": "79", "gpu": str(rng.randrange(8)),
                  "cluster": cluster}
        alert: dict[str, Any] = {"status": "firing", "labels": labels, "annotations": {},
                                 "startsAt": f"2026-11-29T10:{rng.randrange(60):02d}:00Z",
                                 "fingerprint": f"{rng.getrandbits(48):012x}"}
        if kind == "valid":
            self.sent_valid[node] = alert
        elif kind == "resend" and node in self.sent_valid:
            return dict(self.sent_valid[node]), "valid"
        elif kind == "resend":
            self.sent_valid[node] = alert
            kind = "valid"
        elif kind == "resolved":
            alert["status"] = "resolved"
        elif kind == "injection":
            where = rng.choice(["node", "cluster", "gpu", "xid"])
            labels[where] = rng.choice(INJECTIONS)
        elif kind == "bad_node":
            labels["node"] = rng.choice(INJECTIONS + ["", " ", "a" * 254, "x/y", "node\r\n"])
            if labels["node"] == "":
                kind = "no_node"  # an empty label is no label
        elif kind == "long":
            where = rng.choice(["node", "cluster", "alertname", "gpu"])
            labels[where] = "n" * rng.choice([254, 300, 1000, 4000])
            alert["fingerprint"] = "f" * rng.choice([10, 2000])
            if where == "alertname":
                kind = "no_route"
        elif kind == "cluster":
            labels["cluster"] = rng.choice(["c0", "c9", "default", "prod", cluster.upper()])
        elif kind == "no_node":
            del labels["node"]
        elif kind == "bad_number":
            labels[rng.choice(["gpu", "xid"])] = rng.choice(["x", "-1", "1e9", "99999999999", "3.5"])
        elif kind == "no_route":
            labels["alertname"] = rng.choice(["DiskFull", "", "FleetMedicGpuXid2", "x" * 500])
        elif kind == "no_xid":
            del labels["xid"]
        return alert, kind

    def request(self) -> tuple[bytes, list[str]]:
        """A request body and the class of each of its alerts ([] for a body that is no payload)."""
        rng = self.rng
        roll = rng.random()
        if roll < 0.05:
            return rng.choice([b"", b"{", b"null", b"[]", bytes(rng.getrandbits(8) for _ in range(64)),
                               b'{"version": "4"}', json.dumps(payload()).encode()]), []
        if roll < 0.08:
            body = payload(xid_alert(VALID_NODES[0], self.cluster))
            body[rng.choice(["version", "alerts", "status"])] = rng.choice([None, 5, "3", [], {"a": 1}])
            return json.dumps(body).encode(), []
        alerts, kinds = zip(*(self.alert() for _ in range(rng.randint(1, 5))), strict=True)
        return json.dumps(payload(*alerts)).encode(), list(kinds)


async def test_ten_thousand_hostile_requests_never_5xx_never_start_an_invalid_run(
        client: Client, task_queue: str, kube: Any, tmp_path: Any) -> None:
    """10,000 requests against the real dev server and a real worker (every run in shadow mode, on a
    fleet with none of the nodes, so each started run ends `unknown-node` while the storm goes on)."""
    from prometheus_client.parser import text_string_to_metric_families

    from tests.harness import quick_policy, settings_for, worker_for

    receiver = AlertReceiver(client, RoutingPolicy(clusters=[task_queue]), task_queue, TOKEN, available_runbooks(),
                             max_body=64 * 1024, temporal_timeout=10)
    generator = HostileAlerts(task_queue)
    counts: dict[str, int] = {}
    answers: list[dict[str, Any]] = []
    statuses: dict[int, int] = {}
    policy = quick_policy(tmp_path, shadow={"global": True})
    transport = httpx.ASGITransport(app=receiver.app())
    async with worker_for(client, settings_for(task_queue, kube), policy), \
            httpx.AsyncClient(transport=transport, base_url="http://webhook", timeout=60,
                              headers={"Authorization": f"Bearer {TOKEN}"}) as http:
        requests = [generator.request() for _ in range(10_000)]

        async def send(body: bytes, kinds: list[str]) -> None:
            for _ in range(20):  # Alertmanager resends after a 503; nothing else is retried
                response = await http.post("/v1/alerts/alertmanager", content=body,
                                           headers={"Content-Type": "application/json"})
                statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
                if response.status_code != 503:
                    break
                assert "retry" in response.json()["error"]
            if not kinds:
                assert response.status_code in (400, 413), (response.status_code, body[:200])
                return
            assert response.status_code == 202, (response.status_code, response.text[:300])
            got = response.json()["alerts"]
            assert len(got) == len(kinds)
            for kind, answer in zip(kinds, got, strict=True):
                counts[kind] = counts.get(kind, 0) + 1
                answers.append({**answer, "kind": kind})

        queue = list(reversed(requests))

        async def sender() -> None:
            while queue:
                await send(*queue.pop())

        await asyncio.gather(*(sender() for _ in range(8)))
        metrics = (await http.get("/metrics")).text
        runs = [w async for w in client.list_workflows(f'TaskQueue = "{task_queue}"')]
        # Every start ends `unknown-node` in the runbook, not in an escalation waiting for an operator.
        for run in runs[:20]:
            handle = client.get_workflow_handle(run.id, result_type=RunbookStatus)
            report = await asyncio.wait_for(handle.result(), 60)
            assert report.outcome == "unknown-node", (run.id, report.outcome, report.decisions[-3:])

    assert not [code for code in statuses if code >= 500 and code != 503], statuses
    # Valid alerts start or attach to a run, or are a resend of a closed incident; nothing else does.
    for answer in answers:
        if answer["kind"] == "valid":
            assert answer["action"] in ("started", "attached", "ignored"), answer
            if answer["action"] == "ignored":  # a closed incident's, or a copy this webhook answered before
                assert answer["code"] in ("already_remediated", "resend"), answer
        elif answer["kind"] == "resolved":
            assert answer["action"] in ("attached", "ignored"), answer
        elif answer["kind"] == "no_route":
            assert (answer["action"], answer["code"]) == ("ignored", "no_route"), answer
        else:
            assert answer["action"] == "refused" and answer["workflow_id"] is None, answer
    # No workflow for an invalid alert, counted from Temporal: every run on this task queue is an
    # xid-recovery of a valid node in the test's cluster, and no other fleet guard was created.
    assert runs, "no valid alert started a run"
    for run in runs:
        assert run.id.startswith(f"xid-recovery/{task_queue}/fz-"), run.id
        assert run.id.split("/")[-1] in VALID_NODES
    started = sum(1 for a in answers if a["action"] == "started")
    assert started == len(runs)
    # Every refused or ignored alert is counted in /metrics, by reason.
    counted: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(metrics):
        for sample in family.samples:
            if sample.name == "fleetmedic_webhook_alerts_total":
                counted[(sample.labels["outcome"], sample.labels["reason"])] = sample.value
    expected: dict[tuple[str, str], float] = {}
    for answer in answers:
        key = (answer["action"], answer["code"])
        expected[key] = expected.get(key, 0) + 1
    assert counted == expected
    assert sum(v for (outcome, _), v in counted.items() if outcome in ("refused", "ignored")) > 5000


async def test_alert_labels_cannot_pick_a_fleet_guard_of_their_own(webhook: Any, client: Client, task_queue: str,
                                                                   kube: Any, tmp_path: Any) -> None:
    """The guard of the real cluster is at its cap (one lease, held by a run waiting for a person
    to replace its node); alerts naming ten other clusters must cordon nothing and start nothing."""
    from devstack import fleet
    from tests.harness import quick_policy, settings_for, worker_for

    _, http = webhook
    nodes = [f"gpu-{i}" for i in range(11)]
    for name in nodes:
        kube.put(fleet.node(name))
    policy = quick_policy(tmp_path, budget={"max_concurrent": 1, "max_per_hour": 1}, provider={"kind": "manual"})
    async with worker_for(client, settings_for(task_queue, kube), policy):
        [first] = await post(http, xid_alert(nodes[0], task_queue))
        assert first["action"] == "started"
        holder = client.get_workflow_handle(first["workflow_id"])
        await status_when(holder, lambda s: s.waiting_for is not None and "replaced" in s.waiting_for)
        answers = await post(http, *(xid_alert(n, f"c{i}", fingerprint=f"fp-{n}")
                                      for i, n in enumerate(nodes[1:])))
        assert {(a["action"], a["code"]) for a in answers} == {("refused", "unknown_cluster")}
        # A start that bypasses the webhook (the UI's form) with an unknown cluster ends at once.
        direct = await client.start_workflow(
            "xid-recovery", {"cluster": "c5", "node": nodes[5], "xid": 79, "gpu": 0}, id=f"xid-recovery/c5/{nodes[5]}",
            task_queue=task_queue, result_type=RunbookStatus)
        report = await asyncio.wait_for(direct.result(), 60)
        assert report.outcome == "invalid-input" and "not served" in report.decisions[-1].result
        # Counted from outside: the Kubernetes API and Temporal's list of workflows.
        cordoned = [n for n in nodes if (kube.get("v1", "Node", n) or {}).get("spec", {}).get("unschedulable")]
        assert cordoned == [nodes[0]]
        guards = [w.id async for w in client.list_workflows('WorkflowType = "fleet-guard"')]
        assert not [g for g in guards if g.startswith("fleet-guard/c")], guards
        await holder.terminate("test over")
        await client.get_workflow_handle(f"fleet-guard/{task_queue}").terminate("test over")


@pytest.mark.temporal_production
async def test_a_resent_alert_is_one_occurrence_and_a_closed_incident_is_not_reopened(
        webhook: Any, client: Client, task_queue: str, kube: Any, tmp_path: Any) -> None:
    """Alertmanager resends a firing alert every repeat_interval, and each of its HA replicas sends
    every notification: five deliveries of one XID 13 over two webhook replicas are one occurrence
    (a burst needs five). Each replica sends its first copy to Temporal and answers the later ones
    itself, writing nothing; the run counts the second replica's copy as no new occurrence. After
    the run closed the same incident starts nothing, on a replica that saw it or on a new one."""
    from devstack import fleet
    from tests.harness import quick_policy, settings_for, worker_for

    _, http = webhook
    kube.put(fleet.node("gpu-r"))
    policy = quick_policy(tmp_path, xid={"application_burst": {"count": 5, "window": "6s"}})
    alert = xid_alert("gpu-r", task_queue, xid=13, fingerprint="fp-13")
    async with worker_for(client, settings_for(task_queue, kube), policy), replica(client, task_queue) as (_, other):
        answers = [(await post(side, alert))[0] for side in (http, other, http, other, http)]
        assert [(a["action"], a["code"]) for a in answers] == [
            ("started", "new_run"), ("attached", "running_run")] + [("ignored", "resend")] * 3, answers
        handle = client.get_workflow_handle(answers[0]["workflow_id"], result_type=RunbookStatus)
        report = await asyncio.wait_for(handle.result(), 60)
        assert report.outcome == "notified", report.decisions  # a burst would have escalated
        classified = [d for d in report.decisions if d.step == "classify"]
        assert len(classified) == 1, classified  # the second replica's copy was no new occurrence
        history = await handle.fetch_history()
        # The start's input and the second replica's signal: the three copies answered at the edge wrote nothing.
        assert len(alerts_in(history)) == 2
        assert sum(e.HasField("workflow_execution_signaled_event_attributes") for e in history.events) == 1
        # The rule stays firing (dcgm's XID gauge holds the last XID): the resend starts nothing,
        # answered from the memory of the replica that saw it, or by Temporal on a new replica.
        [again] = await post(http, alert)
        assert (again["action"], again["code"]) == ("ignored", "resend"), again
        async with replica(client, task_queue) as (_, new):
            [again] = await post(new, alert)
        assert (again["action"], again["code"]) == ("ignored", "already_remediated"), again
        runs = [w async for w in client.list_workflows(f'WorkflowId = "{handle.id}"')]
        assert len(runs) == 1
        # A new incident (a later startsAt) is a new run, on the replica that remembers the closed
        # one open (workers/open_runs.py): its signal there finds the run closed, and the start decides.
        [later] = await post(http, {**alert, "startsAt": "2099-01-01T00:00:00Z", "fingerprint": "fp-13b"})
        assert later["action"] == "started"
        await client.get_workflow_handle(later["workflow_id"]).terminate("test over")


async def test_the_runs_a_replica_remembers_are_bounded_and_alerts_for_one_run_take_turns() -> None:
    from workers.open_runs import OpenRuns
    from workers.temporal_client import WebhookBusy

    now = [0.0]
    runs = OpenRuns(max_entries=2, max_age_s=10, clock=lambda: now[0])
    for workflow_id, run_id in (("a", "r1"), ("b", "r2"), ("c", "r3")):
        runs.opened(workflow_id, run_id)
    assert (runs.run_id("a"), runs.run_id("b"), runs.run_id("c")) == (None, "r2", "r3")  # the oldest went
    now[0] = 11.0
    assert runs.run_id("b") is None  # too old to trust: the alert takes the start path
    order: list[str] = []

    async def deliver(name: str, workflow_id: str, hold_s: float) -> None:
        async with runs.turn(workflow_id, within_s=5):
            order.append(f"{name} in")
            await asyncio.sleep(hold_s)
            order.append(f"{name} out")

    await asyncio.gather(deliver("first", "x", 0.05), deliver("second", "x", 0), deliver("third", "x", 0),
                         deliver("another run's", "y", 0))
    # One at a time for one workflow ID, in arrival order; another ID never waits for it.
    assert order == ["first in", "another run's in", "another run's out", "first out", "second in", "second out",
                     "third in", "third out"]
    assert runs.turns == {}
    # A turn that does not come is the webhook's own queue: busy, not Temporal.
    async with runs.turn("x", within_s=5):
        with pytest.raises(WebhookBusy, match="alerts for x waited 0.05 s"):
            async with runs.turn("x", within_s=0.05):
                pass


async def test_a_destructive_xid_that_came_with_the_runs_first_alert_is_acted_on(
        webhook: Any, client: Client, task_queue: str, kube: Any, tmp_path: Any) -> None:
    """Alertmanager groups a node's alerts (deploy/alertmanager: one group per node), so two GPUs'
    XIDs come in one request: an XID 13 (notify, then watch for repeats) starts the run, and an XID
    79 on another GPU is signalled to it, both before its first workflow task (here: no worker yet).
    The run must act on the 79 — it was answered `attached`, and Alertmanager sends it again only
    after the route's repeat_interval — not end `notified` once the watch window passes."""
    from devstack import fleet
    from tests.harness import quick_policy, settings_for, worker_for

    _, http = webhook
    kube.put(fleet.node("gpu-two"))
    policy = quick_policy(tmp_path, xid={"application_burst": {"count": 5, "window": "60s"}})
    answers = await post(http, xid_alert("gpu-two", task_queue, xid=13, gpu=3, fingerprint="fp-13"),
                          xid_alert("gpu-two", task_queue, xid=79, gpu=5, fingerprint="fp-79"))
    assert [a["action"] for a in answers] == ["started", "attached"], answers
    handle = client.get_workflow_handle(answers[0]["workflow_id"], result_type=RunbookStatus)
    async with worker_for(client, settings_for(task_queue, kube), policy):
        status = await status_when(handle, lambda s: any(d.step == "protect" for d in s.decisions), 30)
        classified = [d.result for d in status.decisions if d.step == "classify"]
        assert [r.split(" (")[0] for r in classified] == ["XID 13", "XID 79"], status.decisions
        # Out of service as the 79 asks: the cordon, in the API server's audit log.
        cordons = [r for r in kube.mutations() if r.url.path == "/api/v1/nodes/gpu-two" and r.code < 300
                   and (r.data or {}).get("spec", {}).get("unschedulable") is True]
        assert len(cordons) == 1, status.decisions
        await save_history(handle, "xid-recovery-early-alert-acted-on")
        await handle.terminate("test over")
