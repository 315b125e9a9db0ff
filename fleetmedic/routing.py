"""From an alert to a runbook, its workflow ID and its input (pure: the webhook does the I/O).

Alert labels are untrusted. They select a route, a node and a cluster among those configured;
they never choose a fleet guard of their own, never reach a query unchecked, and every alert
that is not acted on comes back with a reason code the webhook counts in `/metrics`.
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import ValidationError

from fleetmedic.errors import validation_errors
from fleetmedic.ids import NODE_RUNBOOKS, cluster_workflow_id, node_workflow_id
from fleetmedic.models import Alert, NodeRunbookInput
from fleetmedic.policy import Route, RoutingPolicy
from fleetmedic.trust import UntrustedValue, checked_cluster, checked_node

# Reason codes of alerts that are not acted on (the `reason` label of
# fleetmedic_webhook_alerts_total). Benign ones are expected in normal operation; the shipped rule
# FleetMedicAlertsRefused fires on the others, which mean alerts meant for a runbook are lost.
BENIGN_REASONS = frozenset({"no_route", "resolved_not_running", "already_remediated", "resend"})


@dataclass(frozen=True)
class Routed:
    runbook: str
    route: Route
    workflow_id: str
    cluster: str
    node: str
    input: NodeRunbookInput


@dataclass(frozen=True)
class Ignored:
    """Not for FleetMedic, or nothing to do: answered `ignored`."""

    runbook: str | None
    code: str
    reason: str


@dataclass(frozen=True)
class Refused:
    """Meant for a runbook but unusable (an unknown cluster, a bad node name, a bad number):
    answered `refused`; the rest of the batch goes on."""

    runbook: str | None
    code: str
    reason: str


@dataclass(frozen=True)
class AlertFacts:
    """What an alert says about the fault, read one way by the webhook and the runbooks."""

    node: str | None
    gpu: int | None
    xid: int | None
    temperature_c: float | None


def _first(values: dict[str, str], names: list[str]) -> str | None:
    return next((values[n] for n in names if values.get(n)), None)


def _int(value: str | None, what: str, low: int, high: int) -> int | None:
    if value is None:
        return None
    try:
        number = int(value.strip())
    except ValueError:
        raise UntrustedValue(f"label {what}={value[:40]!r} is not a number") from None
    if not low <= number <= high:
        raise UntrustedValue(f"label {what}={number} is outside {low}..{high}")
    return number


def alert_facts(alert: Alert, policy: RoutingPolicy) -> AlertFacts:
    """Node, GPU, XID and temperature as the alert states them (raw node, not yet checked).

    dcgm-exporter's XID metric carries the XID as its value: the shipped rule copies it into an
    annotation, since PromQL cannot move a value into a label, so XIDs are read from both.
    Raises UntrustedValue for a number that is not one.
    """
    gpu = _int(_first(alert.labels, policy.gpu_labels), "gpu", 0, 63)
    xid = _int(_first(alert.labels, policy.xid_labels) or _first(alert.annotations, policy.xid_labels), "xid",
               1, 1_000_000)
    try:
        # The shipped hot-GPU rules put the reading in an annotation (hot-gpu-pull reports it).
        temperature = float(alert.annotations["temperature_c"]) if "temperature_c" in alert.annotations else None
    except ValueError:
        temperature = None
    return AlertFacts(node=_first(alert.labels, policy.node_labels), gpu=gpu, xid=xid, temperature_c=temperature)


def route(alert: Alert, policy: RoutingPolicy, available: frozenset[str]) -> Routed | Ignored | Refused:
    """Which runbook owns this alert, and for which node. `available`: runbooks the worker runs."""
    name = alert.labels.get("alertname", "")
    chosen = next((r for r in policy.routes if r.alertname == name
                   and all(alert.labels.get(k, alert.annotations.get(k)) == v for k, v in r.match.items())), None)
    if chosen is None:
        return Ignored(None, "no_route", f"no route for alertname {name[:80]!r}")
    runbook = chosen.runbook
    if runbook not in available:
        return Refused(runbook, "runbook_unavailable", f"runbook {runbook} is not available in this FleetMedic version")
    try:
        cluster = checked_cluster(alert.labels.get(policy.cluster_label), policy.served_clusters,
                                  policy.default_cluster)
    except UntrustedValue as exc:
        return Refused(runbook, "unknown_cluster", str(exc))
    if runbook not in NODE_RUNBOOKS:
        workflow_id = cluster_workflow_id(runbook, cluster)
        return Routed(runbook, chosen, workflow_id, cluster, "",
                      NodeRunbookInput(cluster=cluster, node="-", alert=alert))
    try:
        facts = alert_facts(alert, policy)
    except UntrustedValue as exc:
        return Refused(runbook, "invalid_label", str(exc))
    if facts.node is None:
        return Refused(runbook, "no_node_label", f"no node label ({', '.join(policy.node_labels)}) on the alert")
    try:
        node = checked_node(facts.node)
    except UntrustedValue as exc:
        return Refused(runbook, "invalid_node", str(exc))
    if runbook == "xid-recovery" and facts.xid is None:
        return Refused(runbook, "no_xid", f"no XID label ({', '.join(policy.xid_labels)}) on the alert")
    try:
        runbook_input = NodeRunbookInput(cluster=cluster, node=node, gpu=facts.gpu, xid=facts.xid,
                                         temperature_c=facts.temperature_c, alert=alert, requested_by="alertmanager")
    except ValidationError as exc:
        where, why = validation_errors(exc)[0]
        return Refused(runbook, "invalid_label", f"{where}: {why}")
    return Routed(runbook, chosen, node_workflow_id(runbook, cluster, node), cluster, node, runbook_input)
