"""From an alert to a runbook, its workflow ID and its input (pure: the webhook does the I/O)."""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import ValidationError

from fleetmedic.ids import NODE_RUNBOOKS, cluster_workflow_id, node_workflow_id
from fleetmedic.models import Alert, NodeRunbookInput
from fleetmedic.policy import RoutingPolicy


@dataclass(frozen=True)
class Routed:
    runbook: str
    workflow_id: str
    cluster: str
    node: str
    input: NodeRunbookInput


@dataclass(frozen=True)
class Ignored:
    runbook: str | None
    reason: str


def _first(labels: dict[str, str], names: list[str]) -> str | None:
    return next((labels[n] for n in names if labels.get(n)), None)


def _int(value: str | None, what: str) -> int | None:
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"label {what}={value!r} is not a number") from None


def route(alert: Alert, policy: RoutingPolicy, available: frozenset[str]) -> Routed | Ignored:
    """Which runbook owns this alert, and for which node. `available`: runbooks the worker runs."""
    name = alert.labels.get("alertname", "")
    chosen = next((r for r in policy.routes if r.alertname == name
                   and all(alert.labels.get(k, alert.annotations.get(k)) == v for k, v in r.match.items())), None)
    if chosen is None:
        return Ignored(None, f"no route for alertname {name!r}")
    runbook = chosen.runbook
    if runbook not in available:
        return Ignored(runbook, f"runbook {runbook} is not available in this FleetMedic version")
    cluster = alert.labels.get(policy.cluster_label) or policy.default_cluster
    if runbook not in NODE_RUNBOOKS:
        workflow_id = cluster_workflow_id(runbook, cluster)
        return Routed(runbook, workflow_id, cluster, "", NodeRunbookInput(cluster=cluster, node="-", alert=alert))
    node = _first(alert.labels, policy.node_labels)
    if node is None:
        return Ignored(runbook, f"no node label ({', '.join(policy.node_labels)}) on the alert")
    try:
        gpu = _int(_first(alert.labels, policy.gpu_labels), "gpu")
        # dcgm-exporter's XID gauge carries the XID as its value: the shipped rule puts it in an
        # annotation, since PromQL cannot move a value into a label.
        xid = _int(_first(alert.labels, policy.xid_labels) or _first(alert.annotations, policy.xid_labels), "xid")
    except ValueError as exc:
        return Ignored(runbook, str(exc))
    if runbook == "xid-recovery" and xid is None:
        return Ignored(runbook, f"no XID label ({', '.join(policy.xid_labels)}) on the alert")
    try:
        # The shipped hot-GPU rules put the reading in an annotation (hot-gpu-pull reports it).
        temperature = float(alert.annotations["temperature_c"]) if "temperature_c" in alert.annotations else None
    except ValueError:
        temperature = None
    try:
        runbook_input = NodeRunbookInput(cluster=cluster, node=node, gpu=gpu, xid=xid, temperature_c=temperature,
                                         alert=alert, requested_by="alertmanager")
    except ValidationError as exc:
        error = exc.errors()[0]
        return Ignored(runbook, f"{'.'.join(map(str, error['loc']))}: {error['msg']}")
    return Routed(runbook, node_workflow_id(runbook, cluster, node), cluster, node, runbook_input)
