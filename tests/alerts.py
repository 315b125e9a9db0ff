"""Alertmanager webhook bodies (version 4) as the tests send them: the webhook's and the dashboard's."""

from __future__ import annotations

from typing import Any


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
