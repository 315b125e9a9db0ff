"""The Alertmanager webhook: routing, dedup, answers, and bad input (property-based)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from temporalio.client import Client

from fleetmedic.policy import RoutingPolicy
from workers.webhook import AlertReceiver, available_runbooks

TOKEN = "webhook-secret"


def payload(*alerts: dict[str, Any], status: str = "firing") -> dict[str, Any]:
    return {"version": "4", "groupKey": "{}:{node=\"n\"}", "status": status, "receiver": "fleetmedic",
            "groupLabels": {}, "commonLabels": {}, "commonAnnotations": {}, "externalURL": "http://am",
            "truncatedAlerts": 0, "alerts": list(alerts)}


def xid_alert(node: str, cluster: str, xid: int = 79, gpu: int = 3, status: str = "firing",
              fingerprint: str = "fp1") -> dict[str, Any]:
    return {"status": status, "labels": {"alertname": "FleetMedicGpuXid", "node": node, "xid": str(xid),
                                          "gpu": str(gpu), "cluster": cluster},
            "annotations": {"summary": "XID"}, "startsAt": "2026-11-29T10:00:00Z",
            "endsAt": "0001-01-01T00:00:00Z", "generatorURL": "http://prom", "fingerprint": fingerprint}


@pytest.fixture
async def webhook(client: Client, task_queue: str) -> AsyncIterator[tuple[AlertReceiver, httpx.AsyncClient]]:
    receiver = AlertReceiver(client, RoutingPolicy(), task_queue, TOKEN, available_runbooks(), max_body=64 * 1024)
    transport = httpx.ASGITransport(app=receiver.app())
    async with httpx.AsyncClient(transport=transport, base_url="http://webhook",
                                 headers={"Authorization": f"Bearer {TOKEN}"}) as http:
        yield receiver, http


async def running(client: Client, cluster: str) -> list[str]:
    return [w.id async for w in client.list_workflows(f'FleetCluster = "{cluster}"')]


async def test_firing_alert_starts_the_runbook_and_a_repeat_attaches(webhook: Any, client: Client,
                                                                      task_queue: str) -> None:
    _, http = webhook
    first = await http.post("/v1/alerts/alertmanager", json=payload(xid_alert("gpu-7", task_queue)))
    assert first.status_code == 202
    [answer] = first.json()["alerts"]
    assert answer["action"] == "started" and answer["runbook"] == "xid-recovery"
    assert answer["workflow_id"] == f"xid-recovery/{task_queue}/gpu-7" and answer["fingerprint"] == "fp1"
    again = await http.post("/v1/alerts/alertmanager", json=payload(xid_alert("gpu-7", task_queue)))
    assert again.json()["alerts"][0]["action"] == "attached"
    resolved = await http.post("/v1/alerts/alertmanager",
                               json=payload(xid_alert("gpu-7", task_queue, status="resolved"), status="resolved"))
    assert resolved.json()["alerts"][0]["action"] == "attached"
    history = await client.get_workflow_handle(answer["workflow_id"]).fetch_history()
    signals = [e.workflow_execution_signaled_event_attributes for e in history.events
               if e.HasField("workflow_execution_signaled_event_attributes")]
    statuses = [json.loads(s.input.payloads[0].data)["status"] for s in signals]
    assert statuses == ["firing", "firing", "resolved"]
    assert await running(client, task_queue) == [answer["workflow_id"]]
    await client.get_workflow_handle(answer["workflow_id"]).terminate("test over")


async def test_twenty_concurrent_copies_make_one_workflow(webhook: Any, client: Client, task_queue: str) -> None:
    _, http = webhook
    body = payload(xid_alert("gpu-9", task_queue))
    answers = await asyncio.gather(*(http.post("/v1/alerts/alertmanager", json=body) for _ in range(20)))
    actions = [r.json()["alerts"][0]["action"] for r in answers]
    assert all(r.status_code == 202 for r in answers)
    assert actions.count("started") == 1 and actions.count("attached") == 19
    ids = await running(client, task_queue)
    assert ids == [f"xid-recovery/{task_queue}/gpu-9"]
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
    reasons = [(a["action"], a["reason"]) for a in answer.json()["alerts"]]
    assert [a for a, _ in reasons] == ["ignored"] * 5
    assert "no node label" in reasons[0][1]
    assert "no XID label" in reasons[1][1]
    assert "no route for alertname 'DiskFull'" in reasons[2][1]
    assert "no runbook is running" in reasons[3][1]
    assert reasons[4][1].startswith("gpu:")
    assert await running(client, task_queue) == []


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
    assert 'fleetmedic_alerts_received_total{alertname="DiskFull",status="firing"} 1.0' in metrics
    assert 'fleetmedic_webhook_runbooks_total{action="ignored",runbook="none"} 1.0' in metrics
    assert "fleetmedic_webhook_request_seconds_bucket" in metrics


def _mutations() -> st.SearchStrategy[Any]:
    """Payloads that are almost right, and plain garbage."""
    valid = payload(xid_alert("fuzz-node", "fuzz"))
    json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
                               lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner,
                                                                                            max_size=4),
                               max_leaves=12)
    dropped = st.sampled_from(sorted(valid)).map(lambda k: {key: v for key, v in valid.items() if key != k})
    retyped = st.tuples(st.sampled_from(["version", "status", "alerts", "groupKey", "receiver"]), json_values).map(
        lambda kv: {**valid, kv[0]: kv[1]})
    bad_alert = st.tuples(st.sampled_from(["status", "labels", "startsAt"]), json_values).map(
        lambda kv: {**valid, "alerts": [{**valid["alerts"][0], kv[0]: kv[1]}]})
    return st.one_of(json_values, dropped, retyped, bad_alert, st.binary(max_size=300))


@settings(max_examples=2000, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=_mutations())
def test_fuzzed_payloads_get_400_or_413_and_never_a_workflow(fuzz_http: Any, body: Any) -> None:
    http, counts, temporal = fuzz_http
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    calls_before = len(temporal.calls)
    response = http.post("/v1/alerts/alertmanager", content=content, headers={"Content-Type": "application/json"})
    if response.status_code == 202:
        # Still a valid Alertmanager v4 body (an optional field dropped): routed like any other.
        assert all(a["workflow_id"] in (None, "xid-recovery/fuzz/fuzz-node") for a in response.json()["alerts"])
        counts["accepted"] += 1
    else:
        assert response.status_code in (400, 413), (response.status_code, response.text)
        assert len(temporal.calls) == calls_before, "a refused payload reached Temporal"
        counts["refused"] += 1


@pytest.fixture(scope="module")
def fuzz_http() -> Any:
    from starlette.testclient import TestClient

    class RecordingTemporal:
        """Stands in for the client only here, where thousands of cases must run in seconds:
        it records every start, so a refused payload that reached Temporal is caught."""

        def __init__(self) -> None:
            self.calls: list[str] = []

        async def start_workflow(self, workflow: str, *args: Any, **kwargs: Any) -> Any:
            self.calls.append(kwargs["id"])
            return type("Handle", (), {"result_run_id": "run", "_start_workflow_response": None})()

        def get_workflow_handle(self, workflow_id: str) -> Any:
            calls = self.calls

            class Handle:
                async def signal(self, *args: Any) -> None:
                    calls.append(workflow_id)

            return Handle()

    temporal = RecordingTemporal()
    receiver = AlertReceiver(temporal, RoutingPolicy(), "fuzz", TOKEN,  # type: ignore[arg-type]
                             frozenset({"xid-recovery"}), max_body=16 * 1024)
    counts = {"accepted": 0, "refused": 0}
    with TestClient(receiver.app(), headers={"Authorization": f"Bearer {TOKEN}"},
                    raise_server_exceptions=False) as http:
        yield http, counts, temporal
    assert counts["refused"] > 1000, counts
