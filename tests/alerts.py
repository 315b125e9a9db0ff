"""Alertmanager webhook bodies (version 4) as the tests send them: the webhook's and the dashboard's;
and a webhook replica to send them to."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
from temporalio.client import Client, WorkflowHistory

from fleetmedic.policy import RoutingPolicy
from workers.webhook import AlertReceiver, available_runbooks

TOKEN = "webhook-secret"


@contextlib.asynccontextmanager
async def replica(client: Client, task_queue: str) -> AsyncIterator[tuple[AlertReceiver, httpx.AsyncClient]]:
    """One webhook replica of the cluster named after `task_queue` (each has its own memory of the
    alerts it answered), and an HTTP client to it."""
    receiver = AlertReceiver(client, RoutingPolicy(clusters=[task_queue]), task_queue, TOKEN, available_runbooks(),
                             max_body=64 * 1024)
    transport = httpx.ASGITransport(app=receiver.app())
    async with httpx.AsyncClient(transport=transport, base_url="http://webhook",
                                 headers={"Authorization": f"Bearer {TOKEN}"}) as http:
        yield receiver, http


async def post(http: httpx.AsyncClient, *alerts: dict[str, Any]) -> list[dict[str, Any]]:
    """One Alertmanager notification of `alerts`: the webhook's answer for each."""
    response = await http.post("/v1/alerts/alertmanager", json=payload(*alerts))
    assert response.status_code == 202, response.text
    return list(response.json()["alerts"])


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


def hot_alert(node: str, cluster: str, gpu: int, celsius: float = 84.0, fingerprint: str = "") -> dict[str, Any]:
    """The shipped hot-GPU rule's alert (deploy/prometheus): the reading in an annotation."""
    return {"status": "firing", "labels": {"alertname": "FleetMedicGpuHot", "node": node, "gpu": str(gpu),
                                           "cluster": cluster},
            "annotations": {"temperature_c": f"{celsius:g}"}, "startsAt": "2026-11-29T10:00:00Z",
            "endsAt": "0001-01-01T00:00:00Z", "generatorURL": "http://prom", "fingerprint": fingerprint or f"hot-{gpu}"}


def alerts_in(history: WorkflowHistory) -> list[dict[str, Any]]:
    """The alerts a run was given, from its history: the one its start's input carries (the webhook
    starts a run with the alert in its input), then each `alert` signal."""
    started = history.events[0].workflow_execution_started_event_attributes
    alerts = [alert for payload in started.input.payloads[:1] if (alert := json.loads(payload.data).get("alert"))]
    return alerts + [json.loads(e.workflow_execution_signaled_event_attributes.input.payloads[0].data)
                     for e in history.events if e.HasField("workflow_execution_signaled_event_attributes")
                     and e.workflow_execution_signaled_event_attributes.signal_name == "alert"]
